"""LearningRateMonitor: the learning rate (and momentum) of every optimizer and param group.

Names follow Lightning's, which users already chart: ``lr-<OptimizerClass>`` (or the ``name`` of
the scheduler config driving that optimizer), ``-<k>`` for the k-th further optimizer of the same
class (``lr-SGD``, ``lr-SGD-1``), and ``/pg<i>`` (1-based, or ``/<group name>`` when the group has a
``"name"``) when an optimizer has several param groups. Momentum (``log_momentum=True``) is
``momentum-...`` from the group's ``momentum`` or ``betas[0]``.

``logging_interval="step"``: the value logged at step ``k`` is the lr the ``k``-th optimizer step
used (read in ``on_before_optimizer_step``, before the scheduler moves it), every
``trainer.log_every_n_steps`` steps, next to the loss of that step. ``"epoch"``: at each epoch
start, the lr the epoch begins with, at step ``trainer.global_step``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Dict, Optional

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import invalid_choice

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

INTERVALS = ("step", "epoch")


class LearningRateMonitor(Callback):
    """Log lr per optimizer / param group through ``trainer.log_metrics``."""

    def __init__(self, logging_interval: str = "step", log_momentum: bool = False) -> None:
        if logging_interval not in INTERVALS:
            raise invalid_choice(
                "LearningRateMonitor(logging_interval)",
                logging_interval,
                INTERVALS,
                "log once per optimizer step ('step') or once per epoch ('epoch')",
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.last_metrics: Dict[str, float] = {}
        self._pending: Optional[Dict[str, float]] = None
        self._pending_step = -1
        self._last_step = -1

    def on_train_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self.logging_interval == "epoch":
            self._log(trainer, self.current_values(trainer), trainer.global_step)

    def on_before_optimizer_step(self, trainer: TrainerView, module: TrainingModule, optimizer: Any) -> None:
        # Fires once per optimizer; the first call of a step reads all of them (none has stepped yet).
        if self.logging_interval == "step" and self._pending_step != trainer.global_step:
            self._pending = self.current_values(trainer)
            self._pending_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.logging_interval != "step" or step == 0 or step == self._last_step:
            return
        self._last_step = step
        if step % max(1, int(trainer.log_every_n_steps)) == 0:
            fresh = self._pending is not None and self._pending_step == step - 1
            self._log(trainer, self._pending if fresh else self.current_values(trainer), step)
        self._pending = None

    def _log(self, trainer: TrainerView, metrics: Optional[Dict[str, float]], step: int) -> None:
        if metrics:
            self.last_metrics = dict(metrics)
            trainer.log_metrics(metrics, step=step)

    def current_values(self, trainer: TrainerView) -> Dict[str, float]:
        """``{name: value}`` for every optimizer and param group right now."""
        scheduler_names = {}
        for config in trainer.lr_scheduler_configs:
            scheduler = config.get("scheduler")
            if config.get("name") and scheduler is not None and hasattr(scheduler, "optimizer"):
                scheduler_names[id(scheduler.optimizer)] = str(config["name"])
        seen: Counter = Counter()
        out: Dict[str, float] = {}
        for optimizer in trainer.optimizers:
            base = scheduler_names.get(id(optimizer))
            if base is None:
                cls = type(optimizer).__name__
                base = f"lr-{cls}" + (f"-{seen[cls]}" if seen[cls] else "")
                seen[cls] += 1
            groups = optimizer.param_groups
            for i, group in enumerate(groups):
                suffix = "" if len(groups) == 1 else "/" + str(group.get("name") or f"pg{i + 1}")
                out[base + suffix] = float(group["lr"])
                if self.log_momentum:
                    momentum = group.get("momentum", group.get("betas", (None,))[0])
                    if momentum is not None:
                        name = base[3:] if base.startswith("lr-") else base
                        out[f"momentum-{name}{suffix}"] = float(momentum)
        return out
