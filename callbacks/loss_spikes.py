"""``LossSpikes``: skip the optimizer step of a non-finite loss or of a loss far above its running median.

Design. The policy is a callback (``Trainer(callbacks=[LossSpikes(threshold=10.0, window=50)])``) so
that its state rides in every checkpoint as a callback state; it is a ``StepGuard``
(callbacks/base.py), the seam through which the loop (``trainer/loop/fit_loop.py``) asks, at every optimizer step,
whether to step, skip or roll back, without naming this class:

- every training loss of an optimizer step's accumulation window is added, detached, to a sum kept
  on the device (``record``: no device sync per micro-batch);
- at the step, after the backward of the window's last micro-batch and before the gradients are
  unscaled, clipped or stepped, ``should_skip`` all-reduces ``[sum, count]`` once (SUM over the
  ranks) and reads it: the same numbers on every rank, so every rank takes the same decision and all
  ranks skip together (a NaN on one rank makes the sum NaN everywhere). This is the one collective
  and the one device sync per optimizer step the policy costs; without the policy the loop pays one
  ``is None`` test per step;
- the window's mean loss is skipped when it is not finite, or when ``window`` earlier accepted step
  losses are known and it is above ``threshold`` times their median. A skipped step zeroes the
  gradients and steps neither the optimizer nor the schedulers (``global_step`` counts optimizer
  steps, so it does not advance: a run bounded by ``max_steps`` reads one more batch per skip); the
  batches still count (the data position advances, so a resumed run reads what an uninterrupted one
  reads). A skipped loss does not enter the median's window. Each skip is logged as
  ``train/skipped_steps`` (the run's total) and a warning on rank 0.
- ``state_dict`` holds the median's window, the counters and the partial sum of a window cut by a
  checkpoint, so a resumed run takes the same decisions (``tests/trainer/test_loss_spikes.py`` checks
  bit-identical weights against an uninterrupted run).

The loss the policy sees is what ``training_step`` returns (before accumulation scaling). The
policy decides non-finite losses itself: ``nonfinite_loss="skip"`` (which skips one rank's backward
per batch) cannot be combined with it. Manual optimization is refused (the user's code steps).

Rollback (``rollback_after=N``): after N consecutive skipped steps the loop restores the newest
checkpoint this run committed (``trainer/loop/fit_checkpoints.py`` ``FitCheckpoints.roll_back``, through the resume path
``load_state``): the weights, optimizers, schedulers, grad scaler, ``global_step``, every rank's RNG and
the states of the callbacks that follow the weights (``Callback.restore_on_rollback``: weight
averaging). The data position is *not* restored: the loop goes on with the batch after the last
skipped one, so the batches read since the checkpoint are not replayed (the weights rolled back, the
data skipped, as the PaLM and OPT runs restarted past their spikes; replaying them would spike the
same way, deterministically). ``global_step`` goes back with the weights (it counts the optimizer
steps they had), so a run bounded by ``max_steps`` reads more batches. This callback's own state is
kept (it counts what the run has done) except ``consecutive_skips``, which restarts at 0; other
callbacks (checkpointing, trackers, timers, early stopping) keep theirs. Every rank rolls back at the
same step (the skip decision is agreed), to the checkpoint rank 0 names. Rollbacks are counted
(``rollbacks``, in the checkpoint), logged as ``train/rollbacks`` and warned about on rank 0; after
``max_rollbacks`` the next one is a ``TrainforgeError`` instead (the run keeps spiking: something
other than a few bad batches is wrong). A rollback needs a checkpoint: a fit without a
``ModelCheckpoint`` that writes full checkpoints is refused at its start, and a streak before the
run's first checkpoint is a ``CheckpointError`` naming the fix. A checkpoint written after a
rollback resumes exactly, as every checkpoint does; one written before it replays the same spikes and
the same rollback. Save often (``ModelCheckpoint(every_n_steps=...)``): the newest checkpoint is the
one restored, and the nearer it is to the streak, the fewer good steps are lost.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, Optional

import torch

from trainforge.callbacks.base import Checkpointer, StepDecision, StepGuard
from trainforge.strategies.errors import ConfigurationError, TrainforgeError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy

log = logging.getLogger("trainforge")

METRIC = "train/skipped_steps"
ROLLBACK_METRIC = "train/rollbacks"


class LossSpikes(StepGuard):
    """Skip optimizer steps whose loss is non-finite or above ``threshold`` x the median of the
    last ``window`` accepted step losses; with ``rollback_after=N``, restore the newest checkpoint
    after N consecutive skips, at most ``max_rollbacks`` times (see the module docstring)."""

    def __init__(
        self, threshold: float = 10.0, window: int = 50, rollback_after: Optional[int] = None, max_rollbacks: int = 3
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 1:
            raise ConfigurationError(
                f"LossSpikes(threshold={threshold!r}): threshold must be a number > 1 (a step is skipped when "
                "its loss is above threshold x the running median; at <= 1 ordinary steps would be skipped); "
                "pass e.g. threshold=10.0, or float('inf') to skip only non-finite losses"
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ConfigurationError(
                f"LossSpikes(window={window!r}): window must be an int >= 2 (the number of earlier step "
                "losses the median is taken over); pass e.g. window=50"
            )
        if rollback_after is not None and (
            isinstance(rollback_after, bool) or not isinstance(rollback_after, int) or rollback_after < 1
        ):
            raise ConfigurationError(
                f"LossSpikes(rollback_after={rollback_after!r}): rollback_after must be None (never roll back) or "
                "an int >= 1 (the number of consecutive skipped steps after which the newest checkpoint is "
                "restored); pass e.g. rollback_after=3"
            )
        if isinstance(max_rollbacks, bool) or not isinstance(max_rollbacks, int) or max_rollbacks < 1:
            raise ConfigurationError(
                f"LossSpikes(max_rollbacks={max_rollbacks!r}): max_rollbacks must be an int >= 1 (rollbacks "
                "allowed before the run stops with an error); pass e.g. max_rollbacks=3"
            )
        self.threshold = float(threshold)
        self.window = window
        self.rollback_after = rollback_after
        self.max_rollbacks = max_rollbacks
        self.rollbacks = 0
        self.history: Deque[float] = deque(maxlen=window)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._sum: Optional[torch.Tensor] = None  # this rank's losses of the current window
        self._count = 0
        self._just_rolled_back = False

    def record(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (a one-value tensor); no device sync."""
        value = loss.detach().float().reshape(())
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def decide(self, strategy: Strategy, step: int, is_global_zero: bool) -> StepDecision:
        """``StepGuard``: skip a spike; roll back after ``rollback_after`` consecutive skips."""
        if not self.should_skip(strategy, step, is_global_zero):
            return "step"
        return "rollback" if self.rollback_due else "skip"

    def metrics(self) -> Dict[str, float]:
        """After a skip: the run's skipped steps; after a rollback, the run's rollbacks too."""
        out = {METRIC: float(self.skipped_steps)}
        if self._just_rolled_back:
            out[ROLLBACK_METRIC] = float(self.rollbacks)
            self._just_rolled_back = False
        return out

    def check(self, trainer: Any, automatic_optimization: bool, nonfinite_loss: str) -> None:
        """Refused where it cannot decide: manual optimization, ``nonfinite_loss='skip'``, a rollback
        without checkpoints."""
        check_loss_spikes(self, trainer.callbacks, automatic_optimization, nonfinite_loss)

    def should_skip(self, strategy: Strategy, step: int, is_global_zero: bool) -> bool:
        """At an optimizer step, on every rank: whether to skip it (the same answer on every rank)."""
        device = self._sum.device if self._sum is not None else strategy.root_device
        local = torch.zeros(2, dtype=torch.float64, device=device)
        if self._sum is not None:
            local[0] = self._sum.double()
        local[1] = self._count
        total, count = strategy.all_reduce(local, "sum").tolist()
        self._sum, self._count = None, 0
        if count == 0:  # every training_step of the window returned None: nothing to judge
            return False
        loss = total / count
        median = statistics.median(self.history) if len(self.history) >= self.window else None
        if math.isfinite(loss) and (median is None or loss <= self.threshold * median):
            self.history.append(loss)
            self.consecutive_skips = 0
            return False
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if is_global_zero:
            why = "is not finite" if not math.isfinite(loss) else f"is above {self.threshold:g} x median {median:.6g}"
            log.warning(
                "trainforge: LossSpikes skipped the optimizer step after global step %d: its loss %.6g %s "
                "(%d skipped so far, %d in a row)",
                step,
                loss,
                why,
                self.skipped_steps,
                self.consecutive_skips,
            )
        return True

    @property
    def rollback_due(self) -> bool:
        """Whether the loop rolls back now: ``rollback_after`` consecutive steps were skipped (the same on
        every rank). Past ``max_rollbacks`` this raises instead."""
        if self.rollback_after is None or self.consecutive_skips < self.rollback_after:
            return False
        if self.rollbacks >= self.max_rollbacks:
            raise TrainforgeError(
                f"LossSpikes: {self.consecutive_skips} consecutive optimizer steps were skipped again after "
                f"{self.rollbacks} rollback(s) (max_rollbacks={self.max_rollbacks}); the loss keeps spiking on "
                "fresh data from restored weights, so more than a few bad batches is wrong. Lower the learning "
                "rate (or add warmup / gradient clipping), check the data, or raise max_rollbacks"
            )
        return True

    def rolled_back(self, path: str, from_step: int, to_step: int, is_global_zero: bool) -> None:
        """Called by the loop once the checkpoint at ``path`` is restored."""
        self.rollbacks += 1
        self.consecutive_skips = 0
        self._just_rolled_back = True
        if is_global_zero:
            log.warning(
                "trainforge: LossSpikes rolled back to %s after %d consecutive skipped steps: global step %d -> "
                "%d, the weights, optimizer, schedulers and RNG of that checkpoint; the data goes on after the "
                "skipped batches (rollback %d of at most %d)",
                path,
                self.rollback_after,
                from_step,
                to_step,
                self.rollbacks,
                self.max_rollbacks,
            )

    def state_dict(self) -> Dict[str, Any]:
        return {
            "history": list(self.history),
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "rollbacks": self.rollbacks,
            "window_sum": None if self._sum is None else float(self._sum),
            "window_count": self._count,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.history = deque((float(v) for v in state_dict["history"]), maxlen=self.window)
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.consecutive_skips = int(state_dict["consecutive_skips"])
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        partial = state_dict.get("window_sum")
        self._sum = None if partial is None else torch.tensor(float(partial))
        self._count = int(state_dict.get("window_count", 0))


def check_loss_spikes(spikes: LossSpikes, callbacks: Any, automatic_optimization: bool, nonfinite_loss: str) -> None:
    """Refuse a fit ``spikes`` cannot decide for, before any work."""
    if not automatic_optimization:
        raise ConfigurationError(
            "LossSpikes needs automatic optimization: the loop skips the optimizer step, but with "
            "automatic_optimization=False training_step calls opt.step() itself; check the loss there "
            "(torch.isfinite) and skip opt.step(), or remove LossSpikes"
        )
    if nonfinite_loss == "skip":
        raise ConfigurationError(
            "nonfinite_loss='skip' and LossSpikes both skip non-finite losses (the first per rank and batch, "
            "LossSpikes per optimizer step on every rank together); remove nonfinite_loss='skip'"
        )
    writes = any(isinstance(cb, Checkpointer) and cb.writes_full_checkpoints for cb in callbacks)
    if spikes.rollback_after is not None and not writes:
        raise ConfigurationError(
            f"LossSpikes(rollback_after={spikes.rollback_after}) restores the newest checkpoint of the run, "
            "and this fit writes none (no ModelCheckpoint, enable_checkpointing=False, or only "
            "save_weights_only=True ones); add ModelCheckpoint(every_n_steps=...) to the callbacks, or leave "
            "rollback_after out"
        )
