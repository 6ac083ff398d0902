"""``LossSpikes``: skip the optimizer step of a non-finite loss or of a loss far above its running median.

Design. The policy is a callback (``Trainer(callbacks=[LossSpikes(threshold=10.0, window=50)])``) so
that its state rides in every checkpoint as a callback state; the decision itself is taken by the
loop (``trainer/fit_loop.py``), which finds the policy among the callbacks at fit start:

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

Not built: rolling back to the last checkpoint after N consecutive skips. Reloading in-process means
either reading the bad batches again (the same spike repeats, deterministically) or keeping the
data position while restoring older weights, a mix no checkpoint describes, so resume would no
longer be exact; ``consecutive_skips`` is exposed for a user's callback to stop the run instead.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, Optional

import torch

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy

log = logging.getLogger("trainforge")

METRIC = "train/skipped_steps"


class LossSpikes(Callback):
    """Skip optimizer steps whose loss is non-finite or above ``threshold`` x the median of the
    last ``window`` accepted step losses (see the module docstring)."""

    def __init__(self, threshold: float = 10.0, window: int = 50) -> None:
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
        self.threshold = float(threshold)
        self.window = window
        self.history: Deque[float] = deque(maxlen=window)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._sum: Optional[torch.Tensor] = None  # this rank's losses of the current window
        self._count = 0

    def record(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (a one-value tensor); no device sync."""
        value = loss.detach().float().reshape(())
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def should_skip(self, strategy: "Strategy", step: int, is_global_zero: bool) -> bool:
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

    def state_dict(self) -> Dict[str, Any]:
        return {
            "history": list(self.history),
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "window_sum": None if self._sum is None else float(self._sum),
            "window_count": self._count,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.history = deque((float(v) for v in state_dict["history"]), maxlen=self.window)
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.consecutive_skips = int(state_dict["consecutive_skips"])
        partial = state_dict.get("window_sum")
        self._sum = None if partial is None else torch.tensor(float(partial))
        self._count = int(state_dict.get("window_count", 0))


def find_loss_spikes(callbacks: Any, automatic_optimization: bool, nonfinite_loss: str) -> Optional[LossSpikes]:
    """The fit's ``LossSpikes`` among ``callbacks`` (at most one), or None; refused where it cannot decide."""
    found = [cb for cb in callbacks if isinstance(cb, LossSpikes)]
    if not found:
        return None
    if len(found) > 1:
        raise ConfigurationError(f"{len(found)} LossSpikes callbacks were passed; pass one")
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
    return found[0]
