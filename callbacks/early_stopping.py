"""EarlyStopping: stop training when a validation metric stops improving.

It checks in ``on_validation_end`` during ``fit`` (the Trainer has put the validation epoch values
in ``trainer.callback_metrics`` by then). Each rank judges the value it sees; the decisions are
then reduced (``all_reduce`` max of a 0/1 tensor: stop if any rank says stop), so every rank sets
``trainer.should_stop`` at the same step even when the metric was not synced across ranks.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from callbacks.base import Callback
from strategies.errors import ConfigurationError, check_metric_name, invalid_choice

if TYPE_CHECKING:  # pragma: no cover
    from trainer import Trainer, TrainingModule

MODES = ("min", "max")


class EarlyStopping(Callback):
    """Stop after ``patience`` validations without an improvement larger than ``min_delta``.

    Also stops at once when the value is not finite (``check_finite``), reaches
    ``stopping_threshold`` (good enough) or crosses ``divergence_threshold`` (hopeless).
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 check_finite: bool = True, stopping_threshold: Optional[float] = None,
                 divergence_threshold: Optional[float] = None, verbose: bool = True) -> None:
        if mode not in MODES:
            raise invalid_choice("EarlyStopping(mode)", mode, MODES,
                                 "use 'min' for losses and errors, 'max' for accuracies and scores")
        check_metric_name(monitor, "EarlyStopping(monitor)")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigurationError(f"EarlyStopping(patience={patience!r}) must be an int >= 1 (validation checks "
                                     "without improvement before stopping)")
        if min_delta < 0:
            raise ConfigurationError(f"EarlyStopping(min_delta={min_delta!r}) must be >= 0; "
                                     "the direction comes from mode")
        self.monitor = monitor
        self.mode = mode
        self.patience = int(patience)
        self.min_delta = float(min_delta)
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.verbose = verbose
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = -1
        self.stopped_step = -1
        self.stopping_reason: Optional[str] = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def on_validation_end(self, trainer: "Trainer", module: "TrainingModule") -> None:
        if getattr(trainer, "stage", "fit") != "fit":
            return  # trainer.validate()/test() never stop anything
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            available = ", ".join(sorted(metrics)) or "(none: nothing was logged)"
            raise ConfigurationError(
                f"EarlyStopping(monitor={self.monitor!r}): no such metric in trainer.callback_metrics. "
                f"Available: {available}. Log it in validation_step (self.log({self.monitor!r}, value)) "
                "or monitor one of the available names")
        reason = self.judge(float(torch.as_tensor(metrics[self.monitor]).detach().float().cpu()))
        device = getattr(trainer.strategy, "root_device", torch.device("cpu"))
        vote = torch.tensor([1.0 if reason else 0.0], device=device)
        stop = bool(trainer.strategy.all_reduce(vote, op="max").item() > 0)
        if stop:
            self.stopped_epoch = int(trainer.current_epoch)
            self.stopped_step = int(trainer.global_step)
            self.stopping_reason = reason or "another rank asked to stop"
            trainer.should_stop = True
            if self.verbose and (reason or trainer.is_global_zero):
                print(f"[rank {trainer.global_rank}] EarlyStopping at epoch {self.stopped_epoch}, "
                      f"step {self.stopped_step}: {self.stopping_reason}")

    def judge(self, current: float) -> Optional[str]:
        """Update wait count / best score with one value; the reason to stop, or None."""
        op = "<" if self.mode == "min" else ">"
        if self.check_finite and not math.isfinite(current):
            return f"{self.monitor} = {current} is not finite"
        if self.stopping_threshold is not None and (
                current == self.stopping_threshold or self._better(current, self.stopping_threshold)):
            return f"{self.monitor} = {current:.6g} reached stopping_threshold {self.stopping_threshold}"
        if self.divergence_threshold is not None and not (
                current == self.divergence_threshold or self._better(current, self.divergence_threshold)):
            return f"{self.monitor} = {current:.6g} crossed divergence_threshold {self.divergence_threshold}"
        delta = -self.min_delta if self.mode == "min" else self.min_delta
        if self._better(current - delta, self.best_score) and math.isfinite(current):
            self.best_score = current
            self.wait_count = 0
            return None
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (f"{self.monitor} did not improve ({op} {self.best_score:.6g} by more than {self.min_delta}) "
                    f"in the last {self.wait_count} validations")
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score, "stopped_epoch": self.stopped_epoch,
                "stopped_step": self.stopped_step, "patience": self.patience}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.wait_count = int(state_dict["wait_count"])
        self.best_score = float(state_dict["best_score"])
        self.stopped_epoch = int(state_dict.get("stopped_epoch", -1))
        self.stopped_step = int(state_dict.get("stopped_step", -1))
