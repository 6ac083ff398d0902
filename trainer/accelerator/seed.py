"""Seeding every generator a run uses, and capturing/restoring their states for exact resume."""

from __future__ import annotations

import os
import random
from typing import Any, Dict, Optional, Tuple, cast

import numpy as np
import torch

_MAX_SEED = 2**32 - 1
_seed_workers = False  # set by seed_everything(workers=...); read when loaders are prepared


def seed_everything(seed: int = 0, workers: bool = True, rank_offset: bool = False) -> int:
    """Seed python, numpy, torch (and all CUDA devices).

    Dataloader workers derive their seeds from this one whatever ``workers`` says: torch seeds
    torch, numpy and python ``random`` in worker ``i`` from ``base + i``, the base seed being drawn
    from torch's generator when an epoch starts. A prepared loader keeps those seeds (on one process
    exactly a plain DataLoader's; on several, each data-parallel rank's workers get their own: see
    ``PreparedDataLoader``), so ``workers`` (Lightning's argument, which installs its own
    ``worker_init_fn``) changes nothing and is recorded only (``seeds_workers``).
    ``rank_offset=True`` adds the process rank (from RANK) so augmentation differs across ranks
    while staying reproducible. Returns the seed used."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _MAX_SEED:
        from trainforge.strategies.errors import ConfigurationError

        raise ConfigurationError(f"seed={seed!r} must be an int in [0, {_MAX_SEED}]")
    if rank_offset:
        seed = (seed + int(os.environ.get("RANK", "0"))) % (_MAX_SEED + 1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA devices too
    xm = _xla_model()
    if xm is not None:  # torch_xla's device generator is its own
        xm.set_rng_state(seed)
    global _seed_workers
    _seed_workers = workers
    return seed


def seeds_workers() -> bool:
    """Whether the last ``seed_everything`` asked for worker seeding (recorded; prepared loaders keep
    torch's worker seeds either way)."""
    return _seed_workers


def worker_init_fn(worker_id: int) -> None:
    """Seed numpy and python ``random`` inside a dataloader worker from torch's per-worker seed, for a
    loader given it explicitly (torch already seeds both per worker; prepared loaders add nothing)."""
    seed = torch.initial_seed() % (_MAX_SEED + 1)
    np.random.seed(seed)
    random.seed(seed)


def raw_rng_state() -> Tuple[Any, ...]:
    """The CPU generators' states as the libraries return them: the cheapest copy (a loader takes one per
    batch it reads ahead); ``rng_state(raw)`` makes it the saved form. Not XLA's, and CUDA only when it is
    initialized (as ``rng_state``)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]  # unannotated in torch
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def rng_state(raw: Optional[Tuple[Any, ...]] = None) -> Dict[str, Any]:
    """This process's generator states, as tensors and plain values (loadable with weights_only); ``raw``:
    those ``raw_rng_state`` took earlier, instead of the current ones."""
    python, numpy_state, torch_state, cuda = raw if raw is not None else (random.getstate(), None, None, None)
    # the legacy tuple (numpy's default, legacy=True; its stubs give a dict-or-tuple union)
    np_state = cast(Tuple[str, np.ndarray, int, int, float], numpy_state if raw is not None else np.random.get_state())
    state: Dict[str, Any] = {
        "python": _plain(python),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch_state if raw is not None else torch.get_rng_state(),
    }
    if raw is not None:
        if cuda is not None:
            state["cuda"] = cuda
        return state
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # unannotated in torch
        state["cuda"] = torch.cuda.get_rng_state_all()
    xm = _xla_model()
    if xm is not None:
        # torch_xla derives random seeds per executed graph, and set_rng_state(get_rng_state()) is not
        # the identity: the generator is re-seeded with its current value here, so the run that saved
        # and a run resumed from this state continue from the same seed.
        seed = int(xm.get_rng_state())
        xm.set_rng_state(seed)
        state["xla"] = seed
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    np.random.set_state(
        (npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda: Optional[Any] = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    xm = _xla_model()
    if xm is not None and state.get("xla") is not None:
        xm.set_rng_state(int(state["xla"]))


def _xla_model() -> Any:
    """torch_xla's xla_model where strategy 'xla' already imported torch_xla (never imported here)."""
    import sys

    if "torch_xla" not in sys.modules or "torch_xla.core.xla_model" not in sys.modules:
        return None
    return sys.modules["torch_xla.core.xla_model"]


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
