"""Splitting an ``IterableDataset``'s stream between processes and DataLoader workers.

Accelerate's ``IterableDatasetShard`` semantics, at batch level: the stream is cut into chunks of
``batch_size`` samples and every ``world_size`` consecutive chunks form a *round*; chunk ``r`` of
each round goes to rank ``r``. Batch-level (not sample-level) round robin so that the rank-major
``all_gather`` of one step's batches is the stream's own order: the duplicates padding adds are
then the tail of the gathered last step, which ``gather_for_metrics`` cuts off.

Workers: every reader (rank x worker) reads the whole stream and keeps its own chunks; the
rounds are dealt to the workers in turn (round ``q`` to worker ``q % num_workers``), which is the
order in which the DataLoader collects their batches, so a rank sees its chunks in stream order.
Inside the reader ``get_worker_info()`` reports a single worker, so a dataset that splits itself
between workers (as torch asks) is not split twice, and a dataset that does not is not read
``num_workers`` times over. The cost, as with Accelerate, is that every reader reads everything:
a dataset that can skip data without reading it should shard itself and opt out
(``shards_by_rank = True``, or HF ``datasets.distributed.split_dataset_by_node``, detected).

The end of the stream (``R`` samples in the last, incomplete round):

- ``drop_last=True``: the incomplete round is dropped (as Accelerate), every rank the same batches;
- ``even_batches=True`` (default): the round is completed with the stream's first samples (its first
  round, as Accelerate's ``IterableDatasetShard``; the round's own when it is the first), so every rank
  gets a full last batch; the number of duplicates travels with the batch (``TaggedBatch.padding``) so
  the loop can drop them from gathered metrics. Every reader keeps the first round it read; a Stateful
  dataset resumed past it reads it again at the end, from its state at the epoch's start (kept in the
  resumable state), and is then put back where it ended;
- ``even_batches=False``: no duplicates; the last rank(s) get a short last batch or one batch fewer.

Every reader must see the same stream: seed any shuffling per epoch (``set_epoch`` is forwarded),
not per process or per worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils import worker as _torch_worker
from torchdata.stateful_dataloader import Stateful

from ..errors import ConfigurationError
from .utils import batch_size_of

__all__ = ["TaggedBatch", "ShardedIterableDataset", "StatefulShardedIterableDataset", "shard_iterable", "shards_itself"]


class TaggedBatch(NamedTuple):
    """A collated batch, the duplicates (rows, over all ranks) padding put in its round, and (on a
    reader's first batch) a fingerprint of the first sample it read, to check that every rank reads
    the same stream."""

    data: Any
    padding: int
    fingerprint: Optional[str] = None


def fingerprint(sample: Any) -> str:
    """A digest of a sample's content (tensors by dtype, shape and bytes; containers recursively;
    other objects by type only, as their repr may hold addresses), equal on every process for equal data."""
    digest = hashlib.sha1()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            flat = x.detach().cpu().contiguous().reshape(-1)
            digest.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            digest.update(bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b"")
        elif isinstance(x, dict):
            for key in sorted(x, key=repr):
                digest.update(repr(key).encode())
                feed(x[key])
        elif isinstance(x, (list, tuple)):
            digest.update(f"L{len(x)}".encode())
            for item in x:
                feed(item)
        elif x is None or isinstance(x, (str, bytes, int, float, bool)):
            digest.update(repr(x).encode())
        else:
            digest.update(type(x).__qualname__.encode())

    feed(sample)
    return digest.hexdigest()


def shards_itself(dataset: Any) -> bool:
    """True when ``dataset`` already splits its stream between ranks: it says so with
    ``shards_by_rank = True``, or it is an HF ``datasets`` stream split by ``split_dataset_by_node``."""
    flag = getattr(dataset, "shards_by_rank", None)
    if flag is not None:
        return bool(flag)
    return getattr(dataset, "_distributed", None) is not None and type(dataset).__module__.startswith("datasets")


class _TagCollate:
    """The user's collate_fn over the samples; the round's padding count travels beside them."""

    def __init__(self, collate_fn: Callable[[Any], Any], auto_batch: bool) -> None:
        self.collate_fn, self.auto_batch = collate_fn, auto_batch

    def __call__(self, items: Any) -> TaggedBatch:
        if not self.auto_batch:  # batch_size=None: one (item, padding, fingerprint) at a time
            item, padding, mark = items
            return TaggedBatch(self.collate_fn(item), padding, mark)
        return TaggedBatch(
            self.collate_fn([sample for sample, _, _ in items]), max(p for _, p, _ in items), items[0][2]
        )


def _read_as_one_worker(dataset: Any) -> Iterator[Any]:
    """``iter(dataset)`` with ``get_worker_info()`` reporting one worker while the user's code runs."""
    info = get_worker_info()
    if info is None:
        yield from dataset
        return
    if not hasattr(_torch_worker, "_worker_info"):  # where torch (and torchdata's workers) keep it
        raise ConfigurationError(
            "this torch version keeps no torch.utils.data._utils.worker._worker_info, so "
            "trainforge cannot split an IterableDataset between DataLoader workers: use "
            "num_workers=0, dispatch_batches=True, or shard the dataset yourself "
            "(shards_by_rank = True)"
        )
    if dataclasses.is_dataclass(info):
        alone = dataclasses.replace(info, id=0, num_workers=1)
    else:  # torch < 2.6: a plain class built from keywords
        alone = type(info)(id=0, num_workers=1, seed=info.seed, dataset=info.dataset)

    def call(fn: Callable[[], Any]) -> Any:
        saved = _torch_worker._worker_info
        _torch_worker._worker_info = alone
        try:
            return fn()
        finally:
            _torch_worker._worker_info = saved

    iterator = call(lambda: iter(dataset))
    while True:
        try:
            item = call(lambda: next(iterator))
        except StopIteration:
            return
        yield item


class ShardedIterableDataset(IterableDataset):
    """This rank's chunks of ``dataset``'s stream (see the module docstring). Built by
    :func:`shard_iterable`; yields ``(sample, padding, fingerprint)`` triples that the loader's collate unpacks."""

    def __init__(
        self,
        dataset: Any,
        *,
        rank: int,
        world_size: int,
        batch_size: Optional[int],
        drop_last: bool,
        even_batches: bool,
    ) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.batch_size, self.drop_last, self.even_batches = batch_size, drop_last, even_batches
        self.chunk = batch_size or 1  # batch_size=None: the dataset's items are the batches
        self._start_round = 0  # where the next iteration starts (a restored position)
        self._round = 0  # the round after the last one this reader handed out
        self._first_round: Optional[List[Any]] = None  # the stream's first round (the last one's padding)
        self._epoch_start: Any = None  # a Stateful dataset's state when this epoch's stream began

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this rank receives (only when the dataset has a length)."""
        total = len(self.dataset)
        per_round = self.chunk * self.world_size
        full, rest = divmod(total, per_round)
        if self.drop_last or rest == 0:
            return full * self.chunk
        if self.even_batches:
            return (full + 1) * self.chunk
        return full * self.chunk + min(self.chunk, max(0, rest - self.rank * self.chunk))

    def __iter__(self) -> Iterator[Any]:  # noqa: C901 - a generator: its chunking state lives in one frame
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start, self._start_round = self._start_round, 0
        self._round = start
        if start == 0:
            self._first_round, self._epoch_start = None, self._dataset_state()
        per_round, chunk = self.chunk * self.world_size, self.chunk
        lo, hi = self.rank * chunk, (self.rank + 1) * chunk
        source = _read_as_one_worker(self.dataset)
        round_index = start
        mark: Optional[str] = None  # the fingerprint of the first sample read, on this reader's first yield
        while True:
            mine = round_index % workers == worker
            buffer: List[Any] = []
            count = 0
            first: Optional[List[Any]] = [] if round_index == 0 else None
            for sample in source:
                count += 1
                if round_index == start and count == 1:
                    mark = fingerprint(sample)
                if mine:
                    buffer.append(sample)
                if first is not None:
                    first.append(sample)
                if count == per_round:
                    break
            if first:
                self._first_round = first
            if count == 0:
                return
            if mine:
                self._round = round_index + 1  # state_dict() is asked after this round's batch
                padding = 0
                if count < per_round:
                    if self.drop_last:
                        return
                    if self.even_batches:
                        pad_from = self._padding_source(per_round) or buffer
                        extra = [pad_from[i % len(pad_from)] for i in range(per_round - count)]
                        padding = sum(1 if self.batch_size is not None else batch_size_of(x) for x in extra)
                        buffer = buffer + extra
                for sample in buffer[lo:hi]:
                    yield sample, padding, mark
                    mark = None
            if count < per_round:
                return
            round_index += 1

    def _dataset_state(self) -> Any:
        return None  # a stream without state: a resume reads it again from its start, first round included

    def _padding_source(self, per_round: int) -> Optional[List[Any]]:
        """The stream's first round (what the last round is completed with), None when this round is the first."""
        return self._first_round


class StatefulShardedIterableDataset(ShardedIterableDataset):
    """For a Stateful dataset: resumes at the saved round without reading what came before."""

    def state_dict(self) -> Dict[str, Any]:
        return {"round": self._round, "dataset": self.dataset.state_dict(), "epoch_start": self._epoch_start}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self._start_round = self._round = int(state["round"])
        self._first_round, self._epoch_start = None, state.get("epoch_start")

    def _dataset_state(self) -> Any:
        return self.dataset.state_dict()

    def _padding_source(self, per_round: int) -> Optional[List[Any]]:
        """Resumed past the first round: read it again from the epoch's start, then put the dataset back."""
        if self._first_round is None and self._epoch_start is not None:
            ended = self.dataset.state_dict()
            self.dataset.load_state_dict(self._epoch_start)
            self._first_round = list(itertools.islice(_read_as_one_worker(self.dataset), per_round))
            self.dataset.load_state_dict(ended)
        return self._first_round


def shard_iterable(dataset: Any, **kwargs: Any) -> ShardedIterableDataset:
    """The sharding wrapper: Stateful (exact resume without re-reading) iff ``dataset`` is."""
    cls = StatefulShardedIterableDataset if isinstance(dataset, Stateful) else ShardedIterableDataset
    return cls(dataset, **kwargs)
