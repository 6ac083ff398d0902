"""Timer: time the stages of a run and stop training after a wall-clock duration.

Stages are the Trainer's: ``"fit"`` (from fit start to fit end, validation inside included),
``"validate"`` (validation loops, inside fit or not) and ``"test"``. The stop decision is taken on
rank 0 and broadcast (``trainer.strategy.broadcast``), so all ranks stop after the same batch or
epoch even though their clocks differ slightly. The elapsed times are saved in ``state_dict``: a
resumed run counts the time already spent.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

import torch

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError, invalid_choice

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

INTERVALS = ("step", "epoch")
STAGES = ("fit", "validate", "test")
_DURATION = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def parse_duration(duration: Union[str, timedelta, Dict[str, float], None]) -> Optional[timedelta]:
    """``"DD:HH:MM:SS"``, a ``timedelta`` or ``timedelta`` keyword arguments (``dict(hours=2)``)."""
    if duration is None or isinstance(duration, timedelta):
        return duration
    if isinstance(duration, str):
        match = _DURATION.match(duration.strip())
        if match is None:
            raise ConfigurationError(
                f"Timer(duration={duration!r}) is not of the form 'DD:HH:MM:SS' "
                "(e.g. '00:12:00:00' for 12 hours); or pass a timedelta or dict(hours=12)"
            )
        days, hours, minutes, seconds = (int(g) for g in match.groups())
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    if isinstance(duration, dict):
        try:
            return timedelta(**duration)
        except TypeError as err:
            raise ConfigurationError(
                f"Timer(duration={duration!r}): {err}. Valid keys: weeks, days, hours, "
                "minutes, seconds, milliseconds, microseconds"
            ) from None
    raise ConfigurationError(
        f"Timer(duration={duration!r}) must be a 'DD:HH:MM:SS' string, a timedelta, "
        "a dict such as dict(hours=12), or None"
    )


class Timer(Callback):
    """Stop ``fit`` once ``duration`` has passed, checked after every batch or every epoch.

    ``duration=None`` only measures. ``time_elapsed(stage)`` and ``time_remaining()`` are seconds.
    """

    def __init__(
        self,
        duration: Union[str, timedelta, Dict[str, float], None] = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        if interval not in INTERVALS:
            raise invalid_choice(
                "Timer(interval)",
                interval,
                INTERVALS,
                "check the time after every training batch ('step') or epoch ('epoch')",
            )
        self.duration = parse_duration(duration)
        if self.duration is not None and self.duration.total_seconds() <= 0:
            raise ConfigurationError(f"Timer(duration={duration!r}) must be longer than zero")
        self.interval = interval
        self.verbose = verbose
        self._start: Dict[str, Optional[float]] = dict.fromkeys(STAGES)
        self._end: Dict[str, Optional[float]] = dict.fromkeys(STAGES)
        self._offset: Dict[str, float] = dict.fromkeys(STAGES, 0.0)  # time of earlier runs / stage loops

    # ---- clocks ---------------------------------------------------------------------------
    def _check_stage(self, stage: str) -> None:
        if stage not in STAGES:
            raise invalid_choice("Timer stage", stage, STAGES)

    def start_time(self, stage: str = "fit") -> Optional[float]:
        self._check_stage(stage)
        return self._start[stage]

    def time_elapsed(self, stage: str = "fit") -> float:
        """Seconds spent in ``stage``, including the time of runs before a resume."""
        self._check_stage(stage)
        start, end = self._start[stage], self._end[stage]
        running = 0.0 if start is None else (end if end is not None else time.monotonic()) - start
        return self._offset[stage] + running

    def time_remaining(self, stage: str = "fit") -> Optional[float]:
        return None if self.duration is None else self.duration.total_seconds() - self.time_elapsed(stage)

    def _begin(self, stage: str) -> None:
        start, end = self._start[stage], self._end[stage]
        if start is not None and end is not None:
            self._offset[stage] += end - start  # a second loop of the stage
        self._start[stage], self._end[stage] = time.monotonic(), None

    def _finish(self, stage: str) -> None:
        if self._start[stage] is not None and self._end[stage] is None:
            self._end[stage] = time.monotonic()

    # ---- hooks ----------------------------------------------------------------------------
    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._begin("fit")

    def on_fit_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._finish("fit")

    def on_validation_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._begin("test" if trainer.stage == "test" else "validate")

    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._finish("test" if trainer.stage == "test" else "validate")

    def on_test_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._begin("test")

    def on_test_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._finish("test")

    def on_teardown(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        for name in STAGES:  # an exception skipped the *_end hook: stop the clock anyway
            self._finish(name)

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.interval == "step":
            self._check_time(trainer)

    def on_train_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self.interval == "epoch":
            self._check_time(trainer)

    def _check_time(self, trainer: TrainerView) -> None:
        if self.duration is None:
            return
        expired = self.time_elapsed("fit") >= self.duration.total_seconds()
        # Rank 0's clock decides for everyone: every rank calls broadcast at the same point. A tensor,
        # not a Python bool: one small collective per batch instead of pickling through broadcast_object.
        device = trainer.device
        decision = trainer.strategy.broadcast(
            torch.tensor([1 if expired else 0], dtype=torch.int32, device=device), src=0
        )
        if bool(decision.item()):
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero:
                print(
                    f"Timer: {self.duration} elapsed; stopping at epoch {trainer.current_epoch}, "
                    f"step {trainer.global_step}"
                )

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        elapsed = state_dict.get("time_elapsed", {})
        self._offset = {s: float(elapsed.get(s, 0.0)) for s in STAGES}
        self._start = dict.fromkeys(STAGES)
        self._end = dict.fromkeys(STAGES)
