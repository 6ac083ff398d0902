"""Sharded, resumable data loading on torchdata's ``StatefulDataLoader``.

``prepare_dataloader`` rebuilds a user's ``DataLoader`` as a :class:`ResumableDataLoader` whose
``ResumableDistributedSampler`` gives rank ``r`` of ``W`` its share of a seeded, epoch-aware
global order (torch ``DistributedSampler``'s exact order). Its ``state_dict`` holds the GLOBAL
sample position, so a run continues at the exact next batch -- with the same world size, or with
another one as long as the global batch (per-process batch x processes) is unchanged -- without
loading any batch already seen.

Where the position comes from: ``StatefulDataLoader`` snapshots the sampler's state each time it
dispatches a batch and returns the snapshot belonging to the last batch handed to the loop, so
batches that workers prefetched are never counted. On load, the position is applied to the
sampler directly (it must win over a later ``set_epoch``), and torchdata's own state (worker seeds,
stateful dataset states) and the workers' random streams (``worker_rng.py``) are restored only when
world size, rank, batch size and worker count match; otherwise fresh iterators start at the saved position.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List, Optional, Sized, cast

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import Stateful, StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as _TorchdataRandomSampler

from ..errors import ConfigurationError
from .iterable import _TagCollate, shard_iterable, shards_itself
from .sampler import (
    KEEP_POSITION,
    ResumableDistributedSampler,
    WholeBatchSampler,
    as_sampler_state,
    saved_epoch_length,
)
from .split import drop_padding, split_between_processes
from .worker_rng import WorkerStreams

__all__ = [
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "prepare_dataloader",
    "loader_state_dict",
    "load_loader_state",
    "set_loader_epoch",
    "num_padding_samples",
    "drop_padding",
    "split_between_processes",
]

STATE_FORMAT = 1
_KINDS = ("map", "iterable", "stream", "custom")
_FINISHED_KEY = "_iterator_finished"  # StatefulDataLoader's flag: the iterator raised StopIteration


class ResumableDataLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` that knows its rank and world size and saves a global position.

    ``kind`` is ``"map"`` (our sampler: sharded, resumable across world sizes), ``"iterable"``
    (an IterableDataset iterated as is: one process, or it shards itself; resumes through its own
    state_dict), ``"stream"`` (an IterableDataset whose stream trainforge splits between ranks and
    workers, ``trainforge.strategies.data.iterable``; batches carry their padding count, kept in
    ``last_padding``) or ``"custom"``
    (a user's sampler or batch_sampler kept as is: resumes through torchdata with the same layout).
    Build it with :func:`prepare_dataloader`.
    """

    _iterator: Any  # torchdata's iterator of the current pass (None between passes)

    def __init__(self, dataset: Any, *, rank: int, world_size: int, kind: str, **kwargs: Any) -> None:
        if kind not in _KINDS:
            raise ConfigurationError(f"kind={kind!r} is not one of: {', '.join(_KINDS)}")
        kwargs["snapshot_every_n_steps"] = 1  # a snapshot per batch: exact positions with workers
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.7+
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            super().__init__(dataset, **kwargs)
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self.last_padding = 0  # "stream": duplicates in the round of the last batch handed out
        self.last_fingerprint: Optional[str] = None  # "stream": the first sample's digest, on a reader's first batch
        self.worker_streams = WorkerStreams()  # workers' random states, saved for an exact resume (worker_rng.py)
        if kind == "map" and WholeBatchSampler is not None and self.batch_size is not None:
            # torchdata builds batches one index at a time in Python; ours takes whole batches and
            # keeps torchdata's state format. DataLoader forbids reassigning batch_sampler after
            # __init__ (to protect a running iterator); none exists yet here.
            object.__setattr__(self, "batch_sampler", WholeBatchSampler(self.sampler, self.batch_size, self.drop_last))

    def __iter__(self) -> Any:
        with self.worker_streams.starting(self):  # workers send their random states with each batch
            iterator = super().__iter__()
        iterator = self.worker_streams.handed_out(iterator) if self.num_workers > 0 else iterator
        return self._untagged(iterator) if self.kind == "stream" else iterator

    def _untagged(self, iterator: Any) -> Any:
        for tagged in iterator:
            self.last_padding, self.last_fingerprint = tagged.padding, tagged.fingerprint
            yield tagged.data

    @property
    def global_batch_size(self) -> int:
        return (self.batch_size or 1) * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; to be called before each epoch (the Trainer does)."""
        targets = [self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None), self.dataset]
        for target in targets:
            if target is not None and callable(getattr(target, "set_epoch", None)):
                target.set_epoch(epoch)
                return

    # -- save ---------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The position after the last batch handed to the loop (plain Python types)."""
        loader_state = self._torchdata_state()
        state: Dict[str, Any] = {
            "format": STATE_FORMAT,
            "kind": self.kind,
            "world_size": self.world_size,
            "rank": self.rank,
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "loader": loader_state,
            "worker_rng": self.worker_streams.state_dict(started=self._iterator is not None),
        }
        if self.kind == "map":
            sampler_state = self._position(loader_state)
            state.update(sampler=sampler_state, epoch=sampler_state["epoch"], consumed=sampler_state["consumed"])
        return state

    def _torchdata_state(self) -> Dict[str, Any]:
        if self._iterator is None:  # not iterated since construction or load: keep what is pending
            return copy.deepcopy(self.next_iter_state or {})
        return copy.deepcopy(super().state_dict())

    def release_workers(self) -> None:
        """Stop the workers of a pass left before its end (fit stopped mid-epoch) now, not when the loader
        is collected; the position is kept: ``state_dict()`` and the next ``iter()`` continue from it."""
        if self._iterator is not None and self.num_workers > 0 and self.kind == "map":  # streams: replay
            state = self.state_dict()
            self._iterator = None  # its only reference: torch's __del__ shuts the workers down
            self.load_state_dict(state)

    def _position(self, loader_state: Dict[str, Any]) -> Dict[str, Any]:
        live = self.sampler.state_dict()
        if self._iterator is None:
            return live  # the position set by load_state_dict/set_epoch, not yet started
        if loader_state.get(_FINISHED_KEY):
            return {**live, "consumed": 0}  # the epoch ran out: the next pass starts afresh
        snapshots = _find_sampler_states(loader_state)
        if len(snapshots) == 1:
            # Right after a restore the snapshot is the loaded state, marked by _keep_position.
            snap = {k: v for k, v in snapshots[0].items() if k != KEEP_POSITION}
            # A different epoch means set_epoch() was called after this pass: it starts at 0.
            return snap if snap["epoch"] == live["epoch"] else {**live, "consumed": 0}
        if self.num_workers > 0:
            warnings.warn(
                "the sampler's position was not found in the StatefulDataLoader state "
                "(torchdata version?); saving the dispatch position, which may count "
                "batches the workers prefetched",
                stacklevel=3,
            )
        return live

    # -- load ---------------------------------------------------------------------------------
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from ``state``; validates everything before changing anything."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            given = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ConfigurationError(
                f"not a ResumableDataLoader state (format {given!r}, expected "
                f"{STATE_FORMAT}): pass the dict returned by state_dict()"
            )
        same_layout = (state["world_size"], state["rank"], state["num_workers"], state["batch_size"]) == (
            self.world_size,
            self.rank,
            self.num_workers,
            self.batch_size,
        )
        if state["kind"] != self.kind:
            if {state["kind"], self.kind} == {"iterable", "stream"} and not same_layout:
                raise ConfigurationError(_layout_message(state, self))  # a stream split for another world size
            raise ConfigurationError(
                f"the data position was saved from a {state['kind']!r} loader but this loader is "
                f"{self.kind!r}: resume with the same kind of dataset and sampler"
            )
        if self.kind != "map":
            if not same_layout:
                raise ConfigurationError(_layout_message(state, self))
            self._warn_replay(state)
            self.next_iter_state = None
            super().load_state_dict(state["loader"])
            self.worker_streams.load(state, self, same_layout=True)
            return
        self.sampler.check_compatible(state["sampler"])
        self._check_global_batch(state)
        self.sampler.load_state_dict(state["sampler"])
        # torchdata would re-apply the sampler's snapshot lazily at the next iter(), after any
        # set_epoch(); mark it so the position just applied stays authoritative.
        self.next_iter_state = None
        restore = self.worker_streams.load(state, self, same_layout=same_layout)  # and the workers' random states
        super().load_state_dict(_keep_position(state["loader"]) if restore else {})

    def _warn_replay(self, state: Dict[str, Any]) -> None:
        """An IterableDataset without state_dict/load_state_dict is put back at its position by
        reading again the batches already seen (torchdata's fast-forward): say so."""
        user = getattr(self.dataset, "dataset", self.dataset) if self.kind == "stream" else self.dataset
        if self.kind == "custom" or isinstance(user, Stateful):
            return
        seen = _find_key(state["loader"], "_num_yielded")
        if seen and not _find_key(state["loader"], _FINISHED_KEY):
            warnings.warn(
                f"{type(user).__name__} has no state_dict()/load_state_dict(): its mid-epoch position is "
                f"not restored from the checkpoint but by reading again the {seen} batch(es) already "
                "seen, which is exact only if the stream yields the same samples again. Implement "
                "state_dict/load_state_dict (torchdata's Stateful) to resume without re-reading",
                UserWarning,
                stacklevel=4,
            )

    def _check_global_batch(self, state: Dict[str, Any]) -> None:
        s = state["sampler"]
        consumed = s["consumed"]
        length = saved_epoch_length(s)
        if consumed == 0 or consumed >= length:
            return  # at an epoch boundary any layout works
        old_global = (state["batch_size"] or 1) * state["world_size"]
        new_global = self.global_batch_size
        if old_global == new_global and consumed % new_global == 0:
            return
        if old_global % self.world_size == 0:
            fix = f"use batch_size={old_global // self.world_size} per process to keep the global batch of {old_global}"
        else:
            divisors = [d for d in range(1, old_global + 1) if old_global % d == 0]
            fix = (
                f"{self.world_size} processes cannot share a global batch of {old_global}; use a "
                f"number of processes that divides it ({', '.join(map(str, divisors))}) or "
                "resume from an epoch boundary"
            )
        raise ConfigurationError(
            f"cannot continue mid-epoch at global sample {consumed} of epoch {s['epoch']}: it was "
            f"saved with {state['world_size']} process(es) x batch_size {state['batch_size']} = "
            f"global batch {old_global}, this run has {self.world_size} x {self.batch_size} = "
            f"{new_global}. A mid-epoch checkpoint resumes on another number of processes only with the same "
            "global batch (processes x per-process batch_size): the run then continues exactly, while with "
            "another global batch the steps, and the position in the epoch they count, would not be the run's. "
            f"To resume, {fix}"
        )


def _find_key(obj: Any, key: str) -> Any:
    """The first value of ``key`` nested anywhere in ``obj`` (None when absent)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if key in item:
                return item[key]
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def _layout_message(state: Dict[str, Any], loader: ResumableDataLoader) -> str:
    what = "an IterableDataset's" if loader.kind in ("iterable", "stream") else "a custom sampler's"
    return (
        f"{what} data position is per process and cannot be re-sharded: it was saved with "
        f"world_size={state['world_size']}, rank={state['rank']}, num_workers="
        f"{state['num_workers']}, batch_size={state['batch_size']} but this loader has "
        f"world_size={loader.world_size}, rank={loader.rank}, num_workers={loader.num_workers}, "
        f"batch_size={loader.batch_size}. Resume with the same settings, or let trainforge "
        "shard a map-style dataset (no custom sampler) to change them"
    )


def _find_sampler_states(obj: Any) -> List[Dict[str, Any]]:
    """Every ResumableDistributedSampler state nested anywhere in ``obj`` (found by its marker,
    so this does not depend on how a torchdata version lays out its state)."""
    found, stack = [], [obj]
    while stack:
        item = stack.pop()
        if as_sampler_state(item) is not None:
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _keep_position(loader_state: Dict[str, Any]) -> Dict[str, Any]:
    loader_state = copy.deepcopy(loader_state)
    for sampler_state in _find_sampler_states(loader_state):
        sampler_state[KEEP_POSITION] = True
    return loader_state


# -- building --------------------------------------------------------------------------------
_REPLACEABLE = (SequentialSampler, RandomSampler, _TorchdataRandomSampler)


def _replaceable(sampler: Any, dataset: Any) -> bool:
    """Plain sequential/random samplers over the whole dataset, which our sampler reproduces."""
    if type(sampler) not in _REPLACEABLE:
        return False
    if isinstance(sampler, (RandomSampler, _TorchdataRandomSampler)):
        return not sampler.replacement and sampler.num_samples == len(dataset)
    return True


def loader_kwargs(dataloader: DataLoader) -> Dict[str, Any]:
    kwargs = dict(
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor,
        persistent_workers=dataloader.persistent_workers,
    )
    # Passed only when set, so older torchdata versions without them still work.
    if getattr(dataloader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = dataloader.pin_memory_device
    if getattr(dataloader, "in_order", True) is False:
        kwargs["in_order"] = False
    return kwargs


def prepare_dataloader(  # noqa: C901 - one branch per kind of loader (resumable, iterable, sampler kinds)
    dataloader: DataLoader,
    *,
    rank: int,
    world_size: int,
    seed: int = 0,
    shuffle: Optional[bool] = None,
    even_batches: bool = True,
    drop_last: Optional[bool] = None,
) -> ResumableDataLoader:
    """Rebuild ``dataloader`` as a sharded, resumable :class:`ResumableDataLoader` for ``rank``.

    - A Sequential/RandomSampler is replaced by a ``ResumableDistributedSampler`` (``shuffle=None``:
      shuffle iff it was a RandomSampler; the order is seeded by ``seed`` + epoch unless the caller
      hands each epoch's generator state to ``sampler.set_order_state`` -- the Accelerator and the
      Trainer do, drawing it as ``RandomSampler`` would, from the user's generator or the global RNG). ``even_batches=True`` pads with samples from the start of the epoch
      like ``DistributedSampler`` so every rank gets the same number of batches; ``False`` leaves
      the last ranks one sample short (evaluation without duplicates).
    - A user's ``DistributedSampler`` is kept as is (its ``set_epoch`` still works); so is any other
      custom sampler or batch_sampler, with a warning: it is not sharded or re-shardable unless it
      is itself rank-aware and Stateful.
    - An ``IterableDataset`` on several processes is split between ranks (and DataLoader workers)
      by batch-sized chunks, as Accelerate's ``IterableDatasetShard``: see
      ``trainforge.strategies.data.iterable`` (``even_batches``/``drop_last`` decide the stream's end). Every
      reader reads the whole stream; a dataset that can skip data without reading it shards
      itself and opts out with ``shards_by_rank = True`` (HF ``split_dataset_by_node`` is
      detected). It resumes exactly through its own ``state_dict``/``load_state_dict``; without
      them torchdata re-reads the batches already seen (a warning says so).
    - ``drop_last=None`` keeps the loader's own (drop each rank's last incomplete batch).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"world_size={world_size!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigurationError(f"rank={rank!r} is not valid for world_size={world_size}: use 0..{world_size - 1}")
    if isinstance(dataloader, ResumableDataLoader):
        if (dataloader.rank, dataloader.world_size) != (rank, world_size):
            raise ConfigurationError(
                f"this loader was prepared for rank {dataloader.rank} of {dataloader.world_size}, "
                f"not rank {rank} of {world_size}: prepare the original DataLoader instead"
            )
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise ConfigurationError(
            f"expected a torch.utils.data.DataLoader, got {type(dataloader).__name__}: wrap your "
            "dataset in DataLoader(dataset, batch_size=...)"
        )
    dataset, kwargs = dataloader.dataset, loader_kwargs(dataloader)
    drop_last = dataloader.drop_last if drop_last is None else drop_last
    batch_size, sampler = dataloader.batch_size, dataloader.sampler
    common = dict(rank=rank, world_size=world_size, **kwargs)
    if isinstance(dataset, IterableDataset):
        if world_size == 1 or shards_itself(dataset):
            return ResumableDataLoader(dataset, kind="iterable", batch_size=batch_size, drop_last=drop_last, **common)
        stream = shard_iterable(
            dataset,
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            drop_last=drop_last,
            even_batches=even_batches,
        )
        common["collate_fn"] = _TagCollate(common["collate_fn"], auto_batch=batch_size is not None)
        return ResumableDataLoader(stream, kind="stream", batch_size=batch_size, drop_last=drop_last, **common)
    batch_sampler = dataloader.batch_sampler
    if batch_size is None and batch_sampler is not None:  # the user passed a batch_sampler
        if type(batch_sampler) is BatchSampler and _replaceable(batch_sampler.sampler, dataset):
            batch_size, sampler = batch_sampler.batch_size, batch_sampler.sampler
            drop_last = batch_sampler.drop_last
        else:
            _warn_kept(batch_sampler, "batch_sampler", world_size)
            return ResumableDataLoader(dataset, kind="custom", batch_sampler=batch_sampler, **common)
    if isinstance(sampler, DistributedSampler):
        if (sampler.num_replicas, sampler.rank) != (world_size, rank):
            raise ConfigurationError(
                f"the DataLoader's DistributedSampler is for rank {sampler.rank} of "
                f"{sampler.num_replicas} but this process is rank {rank} of {world_size}: build it "
                "with the launcher's rank and world size, or pass no sampler and let trainforge shard"
            )
        return ResumableDataLoader(
            dataset, kind="custom", sampler=sampler, batch_size=batch_size, drop_last=drop_last, **common
        )
    if not _replaceable(sampler, dataset):
        _warn_kept(sampler, "sampler", world_size)
        return ResumableDataLoader(
            dataset, kind="custom", sampler=sampler, batch_size=batch_size, drop_last=drop_last, **common
        )
    try:
        len(cast(Sized, dataset))
    except TypeError:
        raise ConfigurationError(
            f"the map-style dataset {type(dataset).__name__} has no __len__, so it "
            "cannot be sharded: define __len__, or make it an IterableDataset"
        ) from None
    if shuffle is None:
        shuffle = isinstance(sampler, (RandomSampler, _TorchdataRandomSampler))
    ours = ResumableDistributedSampler(
        cast(Sized, dataset), world_size, rank, shuffle=shuffle, seed=seed, pad=even_batches
    )
    return ResumableDataLoader(dataset, kind="map", sampler=ours, batch_size=batch_size, drop_last=drop_last, **common)


def _warn_kept(obj: Any, what: str, world_size: int) -> None:
    warnings.warn(
        f"keeping the DataLoader's custom {what} {type(obj).__name__} as is: it is not "
        f"sharded across the {world_size} process(es) and resumes mid-epoch only if it is "
        "itself Stateful (state_dict/load_state_dict) and rank-aware",
        stacklevel=3,
    )


# -- functional API used by the Trainer and the Accelerator ----------------------------------
def loader_state_dict(loader: Any) -> Dict[str, Any]:
    """The loader's resumable position; the same global position on every rank."""
    if isinstance(loader, StatefulDataLoader):
        return loader.state_dict()
    raise ConfigurationError(
        f"{type(loader).__name__} cannot save its position: pass it through "
        "prepare_dataloader (Strategy.setup_dataloader) first"
    )


def load_loader_state(
    loader: Any, state: Dict[str, Any], *, world_size: Optional[int] = None, rank: Optional[int] = None
) -> None:
    """Continue ``loader`` from ``state``. With a different world size, load any rank's state
    (e.g. rank 0's) on every rank; ``world_size``/``rank``, if given, must be the loader's."""
    if isinstance(loader, ResumableDataLoader):
        for name, given in (("world_size", world_size), ("rank", rank)):
            if given is not None and given != getattr(loader, name):
                raise ConfigurationError(
                    f"{name}={given} but the loader was prepared with "
                    f"{name}={getattr(loader, name)}: pass the same values"
                )
    if not isinstance(loader, StatefulDataLoader):
        raise ConfigurationError(
            f"{type(loader).__name__} cannot resume: pass it through "
            "prepare_dataloader (Strategy.setup_dataloader) first"
        )
    loader.load_state_dict(state)


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on whatever in ``loader`` has one (ours, a DistributedSampler, a dataset)."""
    if isinstance(loader, ResumableDataLoader):
        loader.set_epoch(epoch)
        return
    for target in (
        getattr(loader, "sampler", None),
        getattr(loader, "batch_sampler", None),
        getattr(loader, "dataset", None),
    ):
        if target is not None and callable(getattr(target, "set_epoch", None)):
            target.set_epoch(epoch)
            return


def num_padding_samples(loader: Any) -> int:
    """Duplicates that padding added to the epoch, summed over ranks, among the batches the loop
    receives. They are the LAST sample of the last batch on the last that-many ranks: drop them
    from a gathered last batch with :func:`drop_padding`."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or not getattr(sampler, "pad", True):
        return 0
    n, total, replicas = len(cast(Sized, sampler.dataset)), sampler.total_size, sampler.num_replicas
    if getattr(sampler, "block", 1) > 1:  # whole batches: the padding is the tail of the last round
        return total - n
    batch = loader.batch_size or 1
    per_rank = total // replicas
    batches = per_rank // batch if loader.drop_last else -(-per_rank // batch)
    return max(0, min(total, batches * batch * replicas) - n)


def samples_in_last_batch(loader: Any) -> int:
    """Samples of the dataset in the epoch's last global batch (batch size x processes), as
    Accelerate's ``remainder``; 0 when the batches divide the dataset, -1 when unknown (drop_last, a
    batch sampler of the user's, a custom sampler, no length)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or loader.drop_last:
        return -1
    if loader.batch_size is None:
        return -1
    return len(cast(Sized, sampler.dataset)) % (loader.batch_size * sampler.num_replicas)
