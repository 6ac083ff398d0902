"""RNGSync: give every rank rank 0's random state, so shuffles and augmentations agree.

Synced, from global rank 0 to all ranks through ``trainer.strategy.broadcast``, at the start of
every training epoch (``every="epoch"``) or every training batch (``every="step"``):

1. the torch CPU default generator (``torch.get_rng_state``), which also seeds a ``RandomSampler``
   that has no generator of its own;
2. Python's ``random`` module state;
3. NumPy's global ``np.random`` state (when NumPy is installed);
4. for the train dataloader's samplers (``trainer.train_dataloader.sampler`` and, when different,
   ``.batch_sampler.sampler``): an integer ``seed`` attribute (``DistributedSampler`` shuffles with
   ``seed + epoch``) and a ``torch.Generator`` in a ``generator`` attribute (its state).

Not synced: CUDA generators, NumPy ``Generator`` objects the user made, and the RNGs inside
dataloader worker processes (these are seeded from the synced torch state when the iterator starts).
The Trainer creates the epoch's data iterator after ``on_train_epoch_start``, so the synced state
decides that epoch's shuffle. Note that identical torch state also means identical dropout masks
on all ranks after the sync, which is what "same randomness everywhere" implies.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import invalid_choice

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

EVERY = ("epoch", "step")


def _samplers(trainer: TrainerView) -> List[Any]:
    loader = trainer.train_dataloader
    found: List[Any] = []
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if sampler is not None and all(sampler is not s for s in found):
            found.append(sampler)
    return found


def _sampler_state(sampler: Any) -> Dict[str, Any]:
    state: Dict[str, Any] = {}
    seed = getattr(sampler, "seed", None)
    if isinstance(seed, int) and not isinstance(seed, bool):
        state["seed"] = seed
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        state["generator"] = generator.get_state()
    return state


def _apply_sampler_state(sampler: Any, state: Dict[str, Any]) -> None:
    if "seed" in state and hasattr(sampler, "seed"):
        sampler.seed = state["seed"]
    generator = getattr(sampler, "generator", None)
    if "generator" in state and isinstance(generator, torch.Generator):
        generator.set_state(state["generator"])


class RNGSync(Callback):
    """Broadcast rank 0's RNG states (see the module docstring for exactly which) to all ranks."""

    def __init__(self, every: str = "epoch") -> None:
        if every not in EVERY:
            raise invalid_choice(
                "RNGSync(every)",
                every,
                EVERY,
                "sync at each training epoch start ('epoch') or each training batch start ('step')",
            )
        self.every = every
        self.syncs = 0  # how many times the state was synced (for inspection)

    def on_train_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self.every == "epoch":
            self.sync(trainer)

    def on_train_batch_start(self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        if self.every == "step":
            self.sync(trainer)

    def sync(self, trainer: TrainerView) -> None:
        """Collective: every rank must call it at the same point."""
        samplers = _samplers(trainer)
        state: Optional[Dict[str, Any]] = None
        if trainer.global_rank == 0:
            state = {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": _numpy_state(),
                "samplers": [_sampler_state(s) for s in samplers],
            }
        state = trainer.strategy.broadcast(state, src=0)
        if trainer.global_rank != 0:
            torch.set_rng_state(state["torch"])
            random.setstate(state["python"])
            if state["numpy"] is not None:
                import numpy as np

                np.random.set_state(state["numpy"])
            for sampler, sampler_state in zip(samplers, state["samplers"]):
                _apply_sampler_state(sampler, sampler_state)
        self.syncs += 1


def _numpy_state() -> Any:
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch; nothing to sync then
        return None
    return np.random.get_state()
