"""DataLoader workers' random streams, saved with the data position for an exact mid-epoch resume.

torch seeds worker ``i`` (torch, python ``random``, numpy) from the epoch's base seed + ``i``, and
torchdata's state restores the base seed on resume, but not how far each worker had drawn: a
resumed worker would start its streams again from its seed, and random augmentation in
``Dataset.__getitem__`` (or an IterableDataset, or collate_fn) would differ from the uninterrupted run
for the rest of the epoch (with persistent workers, for the rest of the run).

So each worker sends its generator states beside every batch, taken right after producing it
(:class:`RecordingCollate`, around the loader's collate_fn). Cost: about 10 KB of bytes per batch
(torch's Mersenne Twister state is 5 KB, python's and numpy's 2.5 KB each) and about 0.1 ms in the
worker (numpy's get_state is most of it), which runs ahead of the loop: nothing measurable beside a batch. The main process strips them
before anyone sees the batch and keeps, per worker id, the states that came with the last batch
handed to the loop (:class:`WorkerStreams`; batches the workers prefetched do not count), which the
loader's ``state_dict`` saves. The workers of the resumed iterator restore their saved states
(:class:`RestoreWorkerStreams`) after the user's worker_init_fn, which had run before the saved
states were drawn, and before their first batch. The next batch goes to the same worker id as in
the uninterrupted run: torchdata restores its round-robin position (the last worker that yielded).

Not restored, the workers starting from their seeds as before: with another number of workers or
processes or another batch size (torchdata's state is not restored either; the loader warns); after
the last batch of an epoch, unless workers are persistent (the next epoch starts new workers from a
new base seed, as an uninterrupted run does); and for an IterableDataset that torchdata resumes by
reading its batches again (neither it nor its iterator has ``state_dict``): that replay draws the
same numbers again and brings the workers to the saved states by itself. Not covered: numbers drawn
by torchdata's restore in the worker (a dataset's ``load_state_dict``, an ``__iter__`` that draws
before its first ``yield``), and, with persistent workers, by the fetch that ends a stream's epoch.
"""

from __future__ import annotations

import contextlib
import random
import struct
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional

import torch
from torch.utils.data import get_worker_info

from ..errors import ConfigurationError
from .sampler import saved_epoch_length

__all__ = ["RecordingCollate", "RestoreWorkerStreams", "WorkerBatch", "WorkerStreams", "capture", "restore"]

_MT_WORDS = 624  # Mersenne Twister state words (python's state adds its position: 625)


def capture() -> Dict[str, Any]:
    """This process's torch CPU, python ``random`` and (if imported) numpy generator states, as bytes
    and numbers: cheap to copy, and loadable with ``torch.load(weights_only=True)``."""
    version, words, gauss = random.getstate()
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "python": struct.pack(f"<{len(words)}I", *words),
        "python_version": version,
        "python_gauss": gauss,
        "numpy": None,
    }
    np = sys.modules.get("numpy")
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state.update(numpy=keys.tobytes(), numpy_pos=int(pos), numpy_has_gauss=int(has_gauss), numpy_gauss=cached)
    return state


def restore(state: Dict[str, Any]) -> None:
    """Set this process's generators to ``capture()``'s ``state``."""
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    words = struct.unpack(f"<{len(state['python']) // 4}I", state["python"])
    random.setstate((state["python_version"], words, state["python_gauss"]))
    if state["numpy"] is not None:
        import numpy as np

        keys = np.frombuffer(state["numpy"], dtype=np.uint32).copy()
        np.random.set_state(("MT19937", keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))


def check_states(states: Any, num_workers: int) -> Dict[int, Dict[str, Any]]:
    """``states`` from a checkpoint, checked before any worker uses them: worker id -> ``capture()``."""
    torch_size = torch.get_rng_state().numel()
    expected = {"torch": torch_size, "python": (_MT_WORDS + 1) * 4, "numpy": _MT_WORDS * 4}
    ok = isinstance(states, dict)
    for worker, state in states.items() if ok else ():
        ok = ok and isinstance(worker, int) and 0 <= worker < num_workers and isinstance(state, dict)
        ok = ok and all(
            isinstance(state.get(key), bytes) and len(state[key]) == size
            for key, size in expected.items()
            if key != "numpy" or state.get("numpy") is not None
        )
        ok = ok and isinstance(state.get("python_version"), int)
        ok = ok and (state.get("python_gauss") is None or isinstance(state.get("python_gauss"), float))
        numbers = [state.get("numpy_pos"), state.get("numpy_has_gauss"), state.get("numpy_gauss")]
        ok = ok and (state.get("numpy") is None or all(isinstance(n, (int, float)) for n in numbers))
    if not ok:
        raise ConfigurationError(
            f"the DataLoader workers' random states in this data position are malformed (expected, for worker "
            f"ids 0..{num_workers - 1}, the generator states that trainforge saves): pass the dict returned by "
            "state_dict()"
        )
    return states


class WorkerBatch(NamedTuple):
    """A batch and the state of the worker's generators right after producing it (a NamedTuple, so that
    pin_memory pins ``data`` and passes the bytes and numbers of ``rng`` through)."""

    data: Any
    worker_id: int
    rng: Dict[str, Any]


class RecordingCollate:
    """The loader's collate_fn, in a worker: the batch travels with the worker's generator states."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: Any) -> Any:
        batch = self.collate_fn(items)
        info = get_worker_info()
        return batch if info is None else WorkerBatch(batch, info.id, capture())


class RestoreWorkerStreams:
    """A resumed iterator's worker_init_fn: the user's, then the generator states saved for this worker."""

    def __init__(self, worker_init_fn: Optional[Callable[[int], Any]], states: Dict[int, Dict[str, Any]]) -> None:
        self.worker_init_fn, self.states = worker_init_fn, states

    def __call__(self, worker_id: int) -> None:
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)
        state = self.states.get(worker_id)
        if state is not None:
            restore(state)


def _rereads(loader_state: Dict[str, Any]) -> bool:
    """Whether torchdata resumes an IterableDataset by reading its batches again: neither the dataset nor
    its iterator saved a state (torchdata 0.11's test, on its per-worker snapshots)."""
    stack: list = [loader_state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            fetcher = item.get("fetcher_state")
            if isinstance(fetcher, dict) and "dataset_state" in item:  # an IterableDataset's worker
                return item["dataset_state"] is None and fetcher.get("dataset_iter_state") is None
            stack.extend(item.values())
    return False


class WorkerStreams:
    """A multi-worker loader's record of its workers' generator states (see the module docstring)."""

    def __init__(self) -> None:
        self.last: Dict[int, Dict[str, Any]] = {}  # worker id -> states after its last batch handed out
        self.pending: Optional[Dict[int, Dict[str, Any]]] = None  # loaded: for the next iterator's workers
        self.applied: Dict[int, Dict[str, Any]] = {}  # what the iterator being started restores
        self.iterator: Optional[weakref.ref] = None  # torchdata's iterator whose batches are recorded

    @contextlib.contextmanager
    def starting(self, loader: Any) -> Iterator[None]:
        """Around ``iter()`` of ``loader``: workers it starts record their states, and those of an
        iterator resumed from a loaded position (``next_iter_state``) restore the saved ones. The
        loader's own ``collate_fn`` and ``worker_init_fn`` are what the user sees again afterwards."""
        if loader.num_workers == 0:
            yield
            return
        pending = self.pending if loader.next_iter_state is not None else None
        self.pending, self.applied = None, pending or {}
        collate_fn, worker_init_fn = loader.collate_fn, loader.worker_init_fn
        loader.collate_fn = RecordingCollate(collate_fn)
        if pending:
            loader.worker_init_fn = RestoreWorkerStreams(worker_init_fn, pending)
        try:
            yield
        finally:
            loader.collate_fn, loader.worker_init_fn = collate_fn, worker_init_fn

    def handed_out(self, iterator: Any) -> Iterator[Any]:
        """The batches of torchdata's ``iterator`` without their states, which are kept per worker as each
        batch leaves. A new iterator has new workers: the record starts from the states they restored, if
        any; persistent workers keep theirs from epoch to epoch (torchdata reuses the iterator)."""
        if self.iterator is None or self.iterator() is not iterator:
            self.last, self.iterator = dict(self.applied), weakref.ref(iterator)
        return self._strip(iterator, self.last)

    @staticmethod
    def _strip(iterator: Any, last: Dict[int, Dict[str, Any]]) -> Iterator[Any]:
        for batch in iterator:
            if isinstance(batch, WorkerBatch):
                last[batch.worker_id] = batch.rng
                batch = batch.data
            yield batch

    def state_dict(self, started: bool) -> Dict[int, Dict[str, Any]]:
        """What to save: the states of the last batches handed out; not yet ``started``: those loaded."""
        return dict(self.last if started else self.pending or {})

    def load(self, state: Dict[str, Any], loader: Any, *, same_layout: bool) -> bool:
        """Take the saved states of ``state`` (a loader state) for the next iterator's workers where they
        apply (see the module docstring). Returns whether torchdata's own state is to be restored: with the
        same layout, except after an epoch's last batch with workers that are not persistent, which are new
        ones in the next epoch, seeded from a new base seed as in an uninterrupted run (torchdata's state
        would give them the saved one)."""
        saved = check_states(state.get("worker_rng") or {}, int(state["num_workers"]))
        finished = bool(state["loader"].get("_iterator_finished"))  # torchdata's iterator ran out
        if "sampler" in state:  # ours: or no batch of the epoch is left
            s = state["sampler"]
            left = saved_epoch_length(s) - s["consumed"]
            finished = finished or left < (loader.global_batch_size if loader.drop_last else 1)
        restore = same_layout and not (finished and loader.num_workers > 0 and not loader.persistent_workers)
        self.pending = saved if restore and saved and not _rereads(state["loader"]) else None
        if saved and not same_layout and not finished and state["world_size"] == loader.world_size:
            warnings.warn(  # (another world size: the checkpoint's own warning says it)
                f"resuming mid-epoch with num_workers={loader.num_workers}, batch_size={loader.batch_size} (saved "
                f"with {state['num_workers']}, {state['batch_size']}): the data position continues, but the "
                "DataLoader workers' random streams (augmentation) restart from their seeds for the rest of the "
                "epoch instead of continuing as in the uninterrupted run",
                UserWarning,
                stacklevel=4,
            )
        return restore
