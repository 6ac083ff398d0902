"""A ``DistributedSampler`` that can start mid-epoch at a global sample position.

Global order of epoch ``e``: exactly torch's ``DistributedSampler`` order (``randperm`` from a
generator seeded with ``seed + e``, or from the generator state given by ``set_order_state`` for
this epoch -- how the Accelerator follows ``RandomSampler``'s semantics --, padded by repeating from the start to a multiple of the world
size, or the tail dropped with ``drop_last``). Rank ``r`` of ``W`` takes ``order[start + r :: W]``,
where ``start`` is the number of global samples already consumed this epoch. Because the position
is global, a run saved with ``W`` processes can continue with ``W'`` from the same sample, and
resuming costs one ``randperm`` of the dataset length, whatever the position.

``pad=False`` neither pads nor drops: the last ranks may get one sample fewer (uneven; meant for
evaluation, where duplicates would skew metrics and no gradient all-reduce can hang).

``block=b`` (``set_layout``) deals the global order out in runs of ``b`` positions instead of one:
rank ``r`` takes ``order[p]`` for every ``p`` with ``(p // b) % W == r``, so with ``b`` its batch size
each rank gets whole consecutive batches (Accelerate's ``BatchSamplerShard``: batch 2 on 2 processes,
rank 0 ``[0, 1], [4, 5]``, rank 1 ``[2, 3], [6, 7]``); the epoch is then padded (by wrapping around to
its start) or cut (``drop_last``) to a multiple of ``W * b``, a round of one batch per rank. The
position stays global, so a resume on another number of processes keeps exactly the same order
as long as processes x batch size (the round) is unchanged.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Dict, Iterator, Optional, Sized, cast

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from ..errors import ConfigurationError

#: Key that marks a state dict as this sampler's (found by value, wherever a loader nests it).
SAMPLER_STATE_MARKER = "trainforge_sampler"
#: A marked state carrying this key is ignored by ``load_state_dict`` (see ``data.py``).
KEEP_POSITION = "keep_position"


def epoch_length(num_samples: int, num_replicas: int, drop_last: bool, pad: bool = True, block: int = 1) -> int:
    """Global positions in one epoch: ``DistributedSampler.total_size`` (``block=1``), a multiple of
    ``num_replicas * block`` (one round), or the dataset length when neither padding nor dropping."""
    if not pad and not drop_last:
        return num_samples
    round_size = num_replicas * block
    rounds = num_samples // round_size if drop_last else math.ceil(num_samples / round_size)
    return rounds * round_size


def rank_share(total: int, num_replicas: int, rank: int, block: int = 1) -> int:
    """How many of ``total`` global positions rank ``rank`` takes when they are dealt in runs of ``block``."""
    rounds, rest = divmod(total, num_replicas * block)
    return rounds * block + min(max(rest - rank * block, 0), block)


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` with a global, saveable position inside the epoch.

    ``state_dict()["consumed"]`` counts the global samples handed out so far this epoch (indices
    this sampler yielded, times ``num_replicas``). Under a ``StatefulDataLoader`` that number is
    snapshotted when each batch is dispatched, and the loader's state carries the snapshot of the
    last batch handed to the loop, so prefetched batches are never counted.
    ``set_epoch`` to a different epoch starts that epoch at 0; ``set_epoch`` to the current epoch
    keeps a position just loaded (so callers may call it unconditionally at every epoch start).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        pad: bool = True,
    ) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ConfigurationError(f"num_replicas={num_replicas!r} must be an integer >= 1")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ConfigurationError(
                f"rank={rank!r} is not valid for num_replicas={num_replicas}: use 0..{num_replicas - 1}"
            )
        super().__init__(
            cast("Dataset[Any]", dataset),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.pad = pad
        self.set_layout(block=1, drop_last=drop_last, pad=pad)
        self._consumed = 0  # global position when no iteration is under way
        self._resume_at = 0  # one-shot start of the next __iter__, set by load_state_dict
        self._it: Optional[Iterator[int]] = None  # this rank's indices of the iteration under way
        self._start = self._end = self._count = 0
        self._order_state: Optional[torch.Tensor] = None  # this epoch's permutation generator state

    def set_layout(self, *, block: int, drop_last: bool, pad: bool) -> None:
        """Deal the order out in runs of ``block`` positions (see the module's docstring), pad or drop the
        epoch's end to whole rounds; before the first iteration."""
        if not isinstance(block, int) or block < 1:
            raise ConfigurationError(f"block={block!r} must be an integer >= 1 (a per-process batch size)")
        self.block, self.drop_last, self.pad = block, drop_last, pad
        self.total_size = epoch_length(len(cast(Sized, self.dataset)), self.num_replicas, drop_last, pad, block)
        self.num_samples = rank_share(self.total_size, self.num_replicas, self.rank, block)

    # -- order ----------------------------------------------------------------------------
    def global_order(self) -> list:
        """All ranks' indices for the current epoch, in global position order."""
        n = len(cast(Sized, self.dataset))
        if self.shuffle:
            g = torch.Generator()
            if self._order_state is not None:
                g.set_state(self._order_state)
            else:
                g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        if self.drop_last or not self.pad:
            return indices[: self.total_size]
        padding = self.total_size - n  # same padding rule as torch's DistributedSampler
        if padding <= n:
            return indices + indices[:padding]
        return indices + (indices * math.ceil(padding / n))[:padding]

    def __iter__(self) -> Iterator[int]:
        # This rank's indices are handed out by a C-level list iterator (the loader pulls one
        # index at a time: a Python generator here cost ~0.6 us per sample); the position is
        # computed from what is left in it only when state_dict() asks. The start is read now (a
        # snapshot taken right after iter() is right) but the one-shot resume offset is cleared
        # only when iteration really begins: StatefulDataLoader may call iter() on the sampler
        # more than once while restoring, without pulling from it.
        start = min(self._resume_at, self.total_size)
        order = self.global_order()
        mine = self._mine(order, start)
        self._consumed, self._start, self._end, self._count = start, start, len(order), len(mine)
        self._it = iter(mine)
        return itertools.chain(self._clear_resume_offset(), self._it)

    def _mine(self, order: list, start: int) -> list:
        """This rank's indices of ``order`` from global position ``start`` (a multiple of the round)."""
        step, block = self.num_replicas * self.block, self.block
        if block == 1:
            return order[start + self.rank : len(order) : step]
        first = start + self.rank * block
        return list(itertools.chain.from_iterable(order[p : p + block] for p in range(first, len(order), step)))

    def _clear_resume_offset(self) -> Iterator[int]:
        self._resume_at = 0
        return
        yield  # a generator: the line above runs when the first index is pulled

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._consumed = 0
            self._resume_at = 0
            self._it = None
            self._order_state = None
        self.epoch = epoch

    def set_order_state(self, state: Optional[torch.Tensor]) -> None:
        """Draw the current epoch's permutation from a generator in ``state`` (``Generator.get_state()``)
        instead of ``seed + epoch``; saved in ``state_dict`` so the epoch resumes on any world size."""
        self._order_state = None if state is None else state.clone()

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {
            SAMPLER_STATE_MARKER: 1,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "dataset_len": len(cast(Sized, self.dataset)),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
            "block": self.block,
            "order_state": self._order_state,
        }

    def check_compatible(self, state: Dict[str, Any]) -> None:
        """Raise ConfigurationError if ``state`` describes a different epoch order."""
        if state.get(SAMPLER_STATE_MARKER) != 1:
            raise ConfigurationError(
                f"not a ResumableDistributedSampler state (keys: {sorted(state)}); pass the dict "
                "returned by state_dict()"
            )
        n = len(cast(Sized, self.dataset))
        if state["dataset_len"] != n:
            raise ConfigurationError(
                f"the data position was saved for a dataset of {state['dataset_len']} samples but "
                f"this dataset has {n}: resume with the same dataset, or do not load the data state "
                "(start the epoch over)"
            )
        for key in ("seed", "shuffle", "drop_last", "pad"):
            if state[key] != getattr(self, key):
                raise ConfigurationError(
                    f"the data position was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}: the epoch order would differ, so samples would "
                    f"repeat or be skipped. Use {key}={state[key]!r} to resume"
                )

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue at ``state``'s epoch and global position, whatever its ``num_replicas``."""
        if state.get(KEEP_POSITION):
            return  # already applied by ResumableDataLoader.load_state_dict
        self.check_compatible(state)
        consumed, old_replicas = int(state["consumed"]), int(state["num_replicas"])
        finished = consumed >= saved_epoch_length(state)
        round_size = self.num_replicas * self.block
        if not finished and consumed % round_size != 0:
            what = "processes" if self.block == 1 else f"processes x batch size ({self.num_replicas} x {self.block})"
            raise ConfigurationError(
                f"cannot continue at global sample {consumed} with num_replicas={self.num_replicas}"
                f"{'' if self.block == 1 else f' and whole batches of {self.block}'}: the position must be a "
                f"multiple of the {what} so every rank gets whole batches of the same samples as the saved run. "
                f"Resume with a number of processes (and batch size) whose product divides {consumed} (it was "
                f"saved with {old_replicas} process(es))"
            )
        self.epoch = int(state["epoch"])
        self._order_state = state.get("order_state")
        self._resume_at = self.total_size if finished else consumed
        self._consumed = self._resume_at
        self._it = None

    @property
    def consumed(self) -> int:
        """Global samples of this epoch handed out so far (including any prefetched ones)."""
        if self._it is None:
            return self._consumed
        taken = self._count - operator.length_hint(self._it)
        rounds = -(-taken // self.block)  # a rank's short last run still ends the round
        return min(self._start + rounds * self.block * self.num_replicas, self._end)


def saved_epoch_length(state: Dict[str, Any]) -> int:
    """The epoch length of a saved sampler state (states written before ``block`` existed: 1)."""
    return epoch_length(
        state["dataset_len"], int(state["num_replicas"]), state["drop_last"], state["pad"], int(state.get("block", 1))
    )


def as_sampler_state(obj: Any) -> Optional[Dict[str, Any]]:
    """``obj`` if it is a ResumableDistributedSampler state dict, else None."""
    if isinstance(obj, dict) and obj.get(SAMPLER_STATE_MARKER) == 1:
        return obj
    return None


try:  # torchdata's batch sampler (its iterator class is private, hence the guard)
    from torchdata.stateful_dataloader.sampler import BatchSampler as _StatefulBatchSampler
    from torchdata.stateful_dataloader.sampler import _BatchSamplerIterator
except ImportError:  # pragma: no cover - another torchdata layout: keep torchdata's own
    _StatefulBatchSampler = None


if _StatefulBatchSampler is not None:

    class _WholeBatchIterator(_BatchSamplerIterator):
        """torchdata's batch iterator, with each batch taken by ``itertools.islice`` (C speed)
        instead of a Python loop per index (~40 us per batch of 64). Same state, same restore."""

        def __next__(self) -> list:
            batch = list(itertools.islice(self.sampler_iter, self.batch_size))
            self.samples_yielded += len(batch)
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                raise StopIteration
            return batch

    class WholeBatchSampler(_StatefulBatchSampler):
        def __iter__(self) -> Iterator[list]:
            return _WholeBatchIterator(self.sampler, self.batch_size, self.drop_last)
else:  # pragma: no cover
    WholeBatchSampler = None  # type: ignore[misc, assignment]  # without torchdata: no class (callers check for None)
