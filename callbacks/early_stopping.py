"""EarlyStopping: stop training when a monitored metric stops improving.

It checks in ``on_validation_end`` during ``fit`` (the Trainer has put the validation epoch values
in ``trainer.callback_metrics`` by then), or at each training epoch end when there is no validation
loop or with ``check_on_train_epoch_end=True``, as Lightning does. Each rank judges the value it sees; the decisions are
then reduced (``all_reduce`` max of a 0/1 tensor: stop if any rank says stop), so every rank sets
``trainer.should_stop`` at the same step even when the metric was not synced across ranks.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError, check_metric_name, invalid_choice

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

MODES = ("min", "max")


class EarlyStopping(Callback):
    """Stop after ``patience`` validations without an improvement larger than ``min_delta``.

    Also stops at once when the value is not finite (``check_finite``), reaches
    ``stopping_threshold`` (good enough) or crosses ``divergence_threshold`` (hopeless). The arguments
    are Lightning's, in its order and with its defaults, so a ported ``EarlyStopping("val_loss", 0.01, 5)``
    means the same here. Every rank stops at the same step: the ranks' decisions are reduced (any rank's
    stop stops all).

    Args:
        monitor: the logged metric to watch (a name given to ``self.log``, e.g. ``"val/loss"``). Required.
        min_delta: how much the value must improve to count as an improvement, in the direction of ``mode``
            (default 0.0: any improvement counts; must be >= 0).
        patience: how many checks without an improvement are allowed before stopping (default 3; 0 stops at
            the first check without one).
        verbose: print the reason when stopping (default False).
        mode: ``"min"`` (default: lower is better, for losses and errors) or ``"max"`` (accuracies, scores).
        strict: a missing ``monitor`` metric is a ``ConfigurationError`` naming the available metrics
            (default True); False only warns and skips that check.
        check_finite: stop at once when the value is NaN or infinite (default True).
        stopping_threshold: stop at once when the value reaches this (good enough); default None: never.
        divergence_threshold: stop at once when the value is worse than this (hopeless); default None: never.
        check_on_train_epoch_end: check at the end of each training epoch instead of after each validation.
            Default None: only when there is no validation loop; True or False force it.
        log_rank_zero_only: with ``verbose``, the stop is printed by rank 0 only (default False: by each rank
            that asks to stop, and by rank 0).
    """

    monitors_metrics = True

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: Optional[float] = None,
        divergence_threshold: Optional[float] = None,
        check_on_train_epoch_end: Optional[bool] = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        # Lightning's order and defaults (a ported EarlyStopping("val_loss", 0.01, 5) means the same here)
        for flag, value in (("verbose", verbose), ("strict", strict), ("check_finite", check_finite)):
            if type(value) is not bool:
                raise ConfigurationError(f"EarlyStopping({flag}={value!r}) must be True or False")
        if type(log_rank_zero_only) is not bool:
            raise ConfigurationError(
                f"EarlyStopping(log_rank_zero_only={log_rank_zero_only!r}) must be True (the stop is printed by "
                "rank 0 only) or False (by each rank that asks to stop)"
            )
        if check_on_train_epoch_end not in (None, True, False):
            raise ConfigurationError(
                f"EarlyStopping(check_on_train_epoch_end={check_on_train_epoch_end!r}) must be None (at the training "
                "epoch end only without validation), True or False"
            )
        for name, bound in (("stopping_threshold", stopping_threshold), ("divergence_threshold", divergence_threshold)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))):
                raise ConfigurationError(f"EarlyStopping({name}={bound!r}) must be a number or None")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)):
            raise ConfigurationError(
                f"EarlyStopping(min_delta={min_delta!r}) must be a number >= 0 (the second argument, as in "
                "Lightning: EarlyStopping(monitor, min_delta, patience, verbose, mode, ...))"
            )
        if mode not in MODES:
            raise invalid_choice(
                "EarlyStopping(mode)", mode, MODES, "use 'min' for losses and errors, 'max' for accuracies and scores"
            )
        check_metric_name(monitor, "EarlyStopping(monitor)")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise ConfigurationError(
                f"EarlyStopping(patience={patience!r}) must be an integer >= 0 "
                "(0: stop at the first check without improvement)"
            )
        if min_delta < 0:
            raise ConfigurationError(
                f"EarlyStopping(min_delta={min_delta!r}) must be >= 0; the direction comes from mode"
            )
        self.monitor = monitor
        self.mode = mode
        self.patience = int(patience)
        self.min_delta = float(min_delta)
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.verbose = verbose
        self.strict = strict  # False: a missing metric only warns (Lightning)
        self.check_on_train_epoch_end = check_on_train_epoch_end  # None: there when there is no validation loop
        self.log_rank_zero_only = log_rank_zero_only
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

    def _on_train_epoch_end_too(self, trainer: TrainerView) -> bool:
        if self.check_on_train_epoch_end is not None:
            return self.check_on_train_epoch_end
        return not trainer.val_dataloaders

    def on_train_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._on_train_epoch_end_too(trainer):
            self._check(trainer)

    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if trainer.stage != "fit" or self._on_train_epoch_end_too(trainer):
            return  # trainer.validate()/test() never stop anything
        self._check(trainer)

    def _check(self, trainer: TrainerView) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            available = ", ".join(sorted(metrics)) or "(none: nothing was logged)"
            message = (
                f"EarlyStopping(monitor={self.monitor!r}): no such metric in trainer.callback_metrics. "
                f"Available: {available}. Log it (self.log({self.monitor!r}, value)) "
                "or monitor one of the available names"
            )
            if not self.strict:
                warnings.warn(message + " (strict=False: not checked this time)", UserWarning, stacklevel=2)
                return
            raise ConfigurationError(message)
        reason = self.judge(float(torch.as_tensor(metrics[self.monitor]).detach().float().cpu()))
        device = trainer.device
        vote = torch.tensor([1.0 if reason else 0.0], device=device)
        stop = bool(trainer.strategy.all_reduce(vote, op="max").item() > 0)
        if stop:
            self.stopped_epoch = int(trainer.current_epoch)
            self.stopped_step = int(trainer.global_step)
            self.stopping_reason = reason or "another rank asked to stop"
            trainer.should_stop = True
            if self.verbose and (
                trainer.is_global_zero if self.log_rank_zero_only else reason or trainer.is_global_zero
            ):
                print(
                    f"[rank {trainer.global_rank}] EarlyStopping at epoch {self.stopped_epoch}, "
                    f"step {self.stopped_step}: {self.stopping_reason}"
                )

    def judge(self, current: float) -> Optional[str]:
        """Update wait count / best score with one value; the reason to stop, or None."""
        op = "<" if self.mode == "min" else ">"
        if self.check_finite and not math.isfinite(current):
            return f"{self.monitor} = {current} is not finite"
        if self.stopping_threshold is not None and (
            current == self.stopping_threshold or self._better(current, self.stopping_threshold)
        ):
            return f"{self.monitor} = {current:.6g} reached stopping_threshold {self.stopping_threshold}"
        if self.divergence_threshold is not None and not (
            current == self.divergence_threshold or self._better(current, self.divergence_threshold)
        ):
            return f"{self.monitor} = {current:.6g} crossed divergence_threshold {self.divergence_threshold}"
        delta = -self.min_delta if self.mode == "min" else self.min_delta
        if self._better(current - delta, self.best_score) and math.isfinite(current):
            self.best_score = current
            self.wait_count = 0
            return None
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (
                f"{self.monitor} did not improve ({op} {self.best_score:.6g} by more than {self.min_delta}) "
                f"in the last {self.wait_count} validations"
            )
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "best_score": self.best_score,
            "stopped_epoch": self.stopped_epoch,
            "stopped_step": self.stopped_step,
            "patience": self.patience,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.wait_count = int(state_dict["wait_count"])
        self.best_score = float(state_dict["best_score"])
        self.stopped_epoch = int(state_dict.get("stopped_epoch", -1))
        self.stopped_step = int(state_dict.get("stopped_step", -1))
