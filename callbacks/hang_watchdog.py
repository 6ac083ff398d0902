"""HangWatchdog: a fit that makes no progress for ``timeout`` seconds dumps every rank's stacks and ends;
a rank much slower than the others is logged (stragglers).

``Trainer(hang_timeout=seconds)`` installs it; ``callbacks=[HangWatchdog(...)]`` does the same with the
straggler settings too. The process-level part (the thread, the dump, exit code 124) is
``trainforge.strategies.watchdog``; this callback arms it at fit start, beats it at every training and
validation batch start and end (a long validation is not a hang while each batch is shorter than the
timeout) and disarms it at train end (the final checkpoint wait is not watched) or on an exception.
The first batch (DataLoader workers starting, ``compile``) and a checkpoint save inside a step count
against the timeout: choose it above the longest of those.

Default off (``hang_timeout=None``): a timeout too short for a job's slowest legitimate step kills a
healthy job, which costs more than the process group's own timeout ending a hung one; every job knows
its step time, trainforge does not.

Stragglers: every ``straggler_every`` optimizer steps (default 100; nothing with one process) the ranks
all-gather their mean host-side busy time per batch since the last report (waiting for the batch,
then the forward up to ``backward``: the time in gradient collectives, which a fast rank spends
waiting for a slow one, is left out) in one small collective; rank 0 logs, as a warning, each rank
whose mean is above ``straggler_factor`` (default 2) times the median of the other ranks' (with two
ranks: the other one's), with its host.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.watchdog import ProgressWatchdog, check_hang_timeout

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

log = logging.getLogger("trainforge")


class HangWatchdog(Callback):
    def __init__(self, timeout: float, straggler_every: Optional[int] = 100, straggler_factor: float = 2.0) -> None:
        self.timeout = check_hang_timeout(timeout, "HangWatchdog", "timeout")
        if self.timeout is None:
            raise ConfigurationError(
                "HangWatchdog(timeout=None): give a positive number of seconds, or leave the callback out"
            )
        if straggler_every is not None and (
            isinstance(straggler_every, bool) or not isinstance(straggler_every, int) or straggler_every < 1
        ):
            raise ConfigurationError(
                f"HangWatchdog(straggler_every={straggler_every!r}) is not one of: None (no straggler report), "
                "a positive number of optimizer steps, e.g. 100"
            )
        if (
            isinstance(straggler_factor, bool)
            or not isinstance(straggler_factor, (int, float))
            or straggler_factor <= 1
        ):
            raise ConfigurationError(
                f"HangWatchdog(straggler_factor={straggler_factor!r}): give a number above 1, e.g. 2.0 (a rank "
                "slower than twice the median is logged)"
            )
        self.straggler_every = straggler_every
        self.straggler_factor = float(straggler_factor)
        self._dog: Optional[ProgressWatchdog] = None
        self._hosts: Optional[List[str]] = None
        self._reset_times()

    def _reset_times(self) -> None:
        self._busy, self._batches = 0.0, 0
        self._batch_end_t: Optional[float] = None
        self._batch_start_t: Optional[float] = None
        self._next_report: Optional[int] = None
        self._batch_idx = 0

    # ---- hang ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        assert self.timeout is not None
        dump_dir = os.path.join(trainer.default_root_dir, "hang")
        self._dog = ProgressWatchdog(self.timeout, dump_dir, rank=trainer.global_rank)
        self._dog.start()
        self._reset_times()

    def _beat(self, where: str) -> None:
        if self._dog is not None:
            self._dog.beat(where)

    def _disarm(self) -> None:
        dog, self._dog = self._dog, None
        if dog is not None:
            dog.stop()

    def on_train_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._disarm()

    def on_exception(self, trainer: TrainerView, module: TrainingModule, exception: BaseException) -> None:
        self._disarm()

    def on_teardown(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        self._disarm()

    def on_train_batch_start(self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        self._beat(f"training batch {batch_idx} started (global step {trainer.global_step})")
        if self._batch_end_t is not None:  # waiting for this batch counts as busy
            self._busy += now - self._batch_end_t
        self._batch_start_t, self._batch_idx = now, batch_idx

    def on_before_backward(self, trainer: TrainerView, module: TrainingModule, loss: torch.Tensor) -> None:
        self._beat(f"training batch {self._batch_idx}: forward done, in backward (global step {trainer.global_step})")
        if self._batch_start_t is not None:  # the forward; the backward's collectives are left out
            self._busy += time.monotonic() - self._batch_start_t
            self._batch_start_t = None

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        self._beat(f"training batch {batch_idx} ended (global step {trainer.global_step})")
        if self._batch_start_t is not None:  # no backward seen in this batch: the whole batch
            self._busy += now - self._batch_start_t
            self._batch_start_t = None
        self._batches += 1
        self._batch_end_t = now
        if self.straggler_every is not None and trainer.world_size > 1:
            if self._next_report is None:
                self._next_report = trainer.global_step + self.straggler_every
            elif trainer.global_step >= self._next_report:  # global_step is the same on every rank
                self._next_report = trainer.global_step + self.straggler_every
                self._report_stragglers(trainer)

    def on_validation_batch_start(
        self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._beat(f"validation batch {batch_idx} of loader {dataloader_idx} started")
        self._batch_end_t = None  # validation time is not a training batch's wait

    def on_validation_batch_end(
        self,
        trainer: TrainerView,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._beat(f"validation batch {batch_idx} of loader {dataloader_idx} ended")

    # ---- stragglers ------------------------------------------------------------------------------
    def _report_stragglers(self, trainer: TrainerView) -> None:
        mean = self._busy / max(self._batches, 1)
        self._busy, self._batches = 0.0, 0
        if self._hosts is None:  # once per fit
            self._hosts = [str(h) for h in trainer.strategy.all_gather_object(socket.gethostname())]
        means = trainer.strategy.all_gather(torch.tensor([mean], dtype=torch.float64, device=trainer.device))
        times = [float(t) for t in means.reshape(-1).cpu()]
        self._beat(f"straggler report at global step {trainer.global_step}")
        if not trainer.is_global_zero:
            return
        for r, t in enumerate(times):
            median = statistics.median(times[:r] + times[r + 1 :])  # of the others: with 2 ranks, the other one
            if not t > self.straggler_factor * median:
                continue
            log.warning(
                "trainforge: straggler: rank %d on %s spends %.1f ms per batch (data wait + forward), %.1fx the "
                "median %.1f ms of the other %d ranks (global step %d)",
                r,
                self._hosts[r],
                t * 1e3,
                t / median if median > 0 else float("inf"),
                median * 1e3,
                len(times) - 1,
                trainer.global_step,
            )


def hang_callbacks(hang_timeout: Any, callbacks: List[Callback]) -> List[Callback]:
    """``Trainer(hang_timeout=...)``: the callbacks with a ``HangWatchdog`` added (checked first)."""
    timeout = check_hang_timeout(hang_timeout, "Trainer")
    if timeout is None:
        return callbacks
    if any(isinstance(cb, HangWatchdog) for cb in callbacks):
        raise ConfigurationError(
            f"Trainer(hang_timeout={hang_timeout!r}) and a HangWatchdog in callbacks: give one of them "
            "(the callback also takes straggler_every and straggler_factor)"
        )
    return [*callbacks, HangWatchdog(timeout)]
