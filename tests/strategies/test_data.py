"""Sharded, resumable data loading (strategies.data.loader), in one process: per-rank loaders for rank r of
W are built side by side, which is pure logic (no process group needed)."""

import collections
import io
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, SequentialSampler

from trainforge.strategies.data.loader import (
    ResumableDataLoader,
    ResumableDistributedSampler,
    drop_padding,
    load_loader_state,
    loader_state_dict,
    num_padding_samples,
    prepare_dataloader,
    set_loader_epoch,
    split_between_processes,
)
from trainforge.strategies.errors import ConfigurationError


class Ids(Dataset):
    """Item i is i; counts __getitem__ calls in this process, and logs them to a file if given
    (so calls made in worker processes are seen too)."""

    def __init__(self, n, log=None):
        self.n, self.log, self.calls = n, log, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        if self.log is not None:
            with open(self.log, "a") as handle:
                handle.write(f"{i}\n")
        return i


def logged(path):
    return [int(x) for x in Path(path).read_text().split()] if Path(path).exists() else []


def make(n, world, rank, batch, shuffle=True, workers=0, dataset=None, **kwargs):
    loader = DataLoader(dataset or Ids(n), batch_size=batch, shuffle=shuffle, num_workers=workers)
    return prepare_dataloader(loader, rank=rank, world_size=world, **kwargs)


def global_steps(loaders, steps=None):
    """Lockstep iteration of per-rank loaders: one sorted id list per global step."""
    iters, out = [iter(loader) for loader in loaders], []
    while steps is None or len(out) < steps:
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            return out
        assert all(b is not None for b in batches), "ranks ran out of batches at different steps"
        out.append(sorted(torch.cat(batches).tolist()))
    return out


# -- the sampler --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3, 10, 17, 32])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_matches_torch_distributed_sampler(n, shuffle, drop_last):
    for world in (1, 2, 3, 4, 8):
        for rank in range(world):
            for seed, epoch in ((0, 0), (5, 0), (5, 3)):
                ref = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
                ours = ResumableDistributedSampler(
                    range(n), world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
                )
                ref.set_epoch(epoch)
                ours.set_epoch(epoch)
                assert list(ours) == list(ref), (world, rank, seed, epoch)
                assert (len(ours), ours.total_size) == (len(ref), ref.total_size)


def test_sampler_starts_at_a_global_position_for_any_world_size():
    saved = ResumableDistributedSampler(range(50), 2, 0, seed=3)
    saved.set_epoch(4)
    state = {**saved.state_dict(), "consumed": 12}
    for world in (1, 2, 3, 4):
        for rank in range(world):
            sampler = ResumableDistributedSampler(range(50), world, rank, seed=3)
            sampler.load_state_dict(state)
            assert sampler.epoch == 4
            assert list(sampler) == sampler.global_order()[12 + rank :: world]
            assert list(sampler)[: 12 // world] == sampler.global_order()[rank:12:world]  # then a full pass


# -- mid-epoch resume on one process --------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_continues_at_the_next_batch_without_loading_seen_samples(tmp_path, workers):
    n, batch, taken = 40, 4, 3
    full = [b.tolist() for b in make(n, 1, 0, batch, workers=workers)]
    loader = make(n, 1, 0, batch, workers=workers)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(taken)]
    assert seen == full[:taken]
    state = loader.state_dict()
    # Only what the loop received counts, not what the workers prefetched.
    assert state["consumed"] == taken * batch
    if workers:
        assert loader.sampler.consumed > taken * batch
    del it

    log = tmp_path / "calls.txt"
    resumed = make(n, 1, 0, batch, workers=workers, dataset=Ids(n, log))
    resumed.load_state_dict(state)
    it = iter(resumed)
    first = next(it).tolist()
    prefetch = (resumed.prefetch_factor * workers) if workers else 0
    assert len(logged(log)) <= (1 + prefetch) * batch  # the new loader's prefetch, nothing more
    rest = [first] + [b.tolist() for b in it]
    assert rest == full[taken:]
    calls = logged(log)
    assert not set(calls) & {i for b in seen for i in b}
    assert sorted(calls) == sorted(i for b in full[taken:] for i in b)  # each remaining one once


def test_saved_again_right_after_a_resume_keeps_the_position():
    full = [b.tolist() for b in make(32, 1, 0, 4, workers=2)]
    loader = make(32, 1, 0, 4, workers=2)
    it = iter(loader)
    next(it), next(it)
    resumed = make(32, 1, 0, 4, workers=2)
    resumed.load_state_dict(loader.state_dict())
    del it
    it = iter(resumed)  # workers restored and prefetching, no batch taken yet
    again = make(32, 1, 0, 4, workers=2)
    again.load_state_dict(resumed.state_dict())
    del it
    assert [b.tolist() for b in again] == full[2:]


def test_resume_cost_does_not_grow_with_the_position():
    n, batch = 100_000, 10
    costs = {}
    for taken in (1, 1_000):  # global sample 10 and 10,000
        loader = make(n, 1, 0, batch)
        it = iter(loader)
        for _ in range(taken):
            next(it)
        state = loader.state_dict()
        dataset = Ids(n)
        resumed = make(n, 1, 0, batch, dataset=dataset)
        resumed.load_state_dict(state)
        got = next(iter(resumed)).tolist()
        assert got == resumed.sampler.global_order()[taken * batch : (taken + 1) * batch]
        costs[taken] = dataset.calls
    assert costs == {1: batch, 1_000: batch}


def test_resume_with_a_different_worker_count_uses_the_global_position():
    full = [b.tolist() for b in make(24, 1, 0, 3)]
    loader = make(24, 1, 0, 3)
    it = iter(loader)
    for _ in range(2):
        next(it)
    resumed = make(24, 1, 0, 3, workers=2)
    resumed.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in resumed] == full[2:]


def test_state_survives_torch_save_and_weights_only_load():
    loader = make(30, 2, 1, 3)
    it = iter(loader)
    next(it)
    buffer = io.BytesIO()
    torch.save(loader_state_dict(loader), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["consumed"] == 6 and state["world_size"] == 2
    resumed = make(30, 2, 1, 3)
    load_loader_state(resumed, state, world_size=2, rank=1)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in it]
    with pytest.raises(ConfigurationError, match="rank=0 but the loader was prepared with rank=1"):
        load_loader_state(resumed, state, world_size=2, rank=0)


# -- epochs ---------------------------------------------------------------------------------
def test_set_epoch_changes_the_order_and_keeps_a_loaded_position_of_the_same_epoch():
    loader = make(20, 1, 0, 4, seed=1)
    set_loader_epoch(loader, 1)
    epoch1 = [b.tolist() for b in loader]
    loader.set_epoch(2)
    epoch2 = [b.tolist() for b in loader]
    assert epoch1 != epoch2 and sorted(sum(epoch1, [])) == sorted(sum(epoch2, [])) == list(range(20))
    loader.set_epoch(1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    resumed = make(20, 1, 0, 4, seed=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the caller sets the epoch at every epoch start: the position stays
    assert [b.tolist() for b in resumed] == epoch1[1:]
    assert [b.tolist() for b in resumed] == epoch1  # the next pass of that epoch starts afresh
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # a different epoch starts at 0
    assert [b.tolist() for b in resumed] == epoch2


def test_saved_after_the_last_batch_resumes_empty_but_after_the_pass_resumes_full():
    loader = make(12, 1, 0, 4)
    batches = []
    for batch in loader:
        batches.append(batch.tolist())
        inside = loader.state_dict()  # saved in the loop, after the last batch
    after = loader.state_dict()  # saved once the pass ended
    for state, expected in ((inside, []), (after, batches)):
        resumed = make(12, 1, 0, 4)
        resumed.load_state_dict(state)
        resumed.set_epoch(0)
        assert [b.tolist() for b in resumed] == expected


def test_persistent_workers_follow_set_epoch_and_resume():
    loader = prepare_dataloader(
        DataLoader(Ids(16), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True),
        rank=1,
        world_size=2,
        seed=4,
    )
    for epoch in range(2):
        loader.set_epoch(epoch)
        ref = DistributedSampler(range(16), 2, 1, seed=4)
        ref.set_epoch(epoch)
        assert sum((b.tolist() for b in loader), []) == list(ref)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 4)


# -- changing the number of processes ---------------------------------------------------------
@pytest.mark.parametrize("old_world,new_world", [(2, 1), (2, 4), (1, 2)])
def test_resume_with_another_world_size_continues_the_same_global_steps(old_world, new_world):
    n, global_batch, taken = 96, 8, 5
    full = global_steps([make(n, old_world, r, global_batch // old_world) for r in range(old_world)])
    loaders = [make(n, old_world, r, global_batch // old_world) for r in range(old_world)]
    assert global_steps(loaders, taken) == full[:taken]
    states = [loader.state_dict() for loader in loaders]
    assert {(s["epoch"], s["consumed"]) for s in states} == {(0, taken * global_batch)}

    resumed = [make(n, new_world, r, global_batch // new_world) for r in range(new_world)]
    for loader in resumed:
        loader.load_state_dict(states[0])  # any rank's state: the position is global
    after = global_steps(resumed)
    assert after == full[taken:]  # each global step consumes the same set
    remaining = collections.Counter(i for step in full[taken:] for i in step)
    assert collections.Counter(i for step in after for i in step) == remaining
    assert max(remaining.values()) == 1 and len(remaining) == n - taken * global_batch


def test_world_size_change_with_padding_skips_nothing():
    n = 90  # 2 ranks pad to 90, 4 ranks to 92: only the padding duplicates may differ
    full = global_steps([make(n, 2, r, 4) for r in range(2)])
    loaders = [make(n, 2, r, 4) for r in range(2)]
    global_steps(loaders, 3)
    resumed = [make(n, 4, r, 2) for r in range(4)]
    for loader in resumed:
        loader.load_state_dict(loaders[0].state_dict())
    after = global_steps(resumed)
    assert after[:-1] == full[3:-1]
    got, remaining = collections.Counter(sum(after, [])), collections.Counter(sum(full[3:], []))
    assert not remaining - got  # nothing skipped
    assert got - remaining == collections.Counter(resumed[0].sampler.global_order()[:2])  # 4-rank padding


def test_global_batch_that_cannot_be_kept_is_refused_with_what_would_work():
    loaders = [make(96, 2, r, 4) for r in range(2)]
    global_steps(loaders, 3)
    state = loaders[0].state_dict()
    for batch in (2, 3, 4):
        with pytest.raises(
            ConfigurationError,
            match=r"global sample 24 .*2 process\(es\) x batch_size 4 = "
            r"global batch 8.* 3 processes cannot share a global "
            r"batch of 8; use .*\(1, 2, 4, 8\)",
        ):
            make(96, 3, 0, batch).load_state_dict(state)
    one = make(96, 1, 0, 4)
    # 24 is a multiple of the new global batch (4): the condition is the global batch, and the error says so
    with pytest.raises(
        ConfigurationError,
        match=r"resumes on another number of processes only with the same global batch \(processes x per-process "
        r"batch_size\).* use batch_size=8 per process",
    ):
        one.load_state_dict(state)
    assert one.sampler.consumed == 0  # nothing changed by the refused load
    at_boundary = make(96, 2, 0, 4).state_dict()
    make(96, 3, 0, 5).load_state_dict(at_boundary)  # between epochs any layout works


def test_state_from_another_dataset_or_order_is_refused():
    loader = make(96, 1, 0, 4)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ConfigurationError, match="dataset of 96 samples but this dataset has 97"):
        make(97, 1, 0, 4).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="saved with seed=0 .* Use seed=0"):
        make(96, 1, 0, 4, seed=1).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="not a ResumableDataLoader state"):
        make(96, 1, 0, 4).load_state_dict({"epoch": 0})


# -- what prepare_dataloader keeps -------------------------------------------------------------
def test_prepare_carries_the_loader_settings():
    generator = torch.Generator().manual_seed(3)

    def collate(items):
        return torch.tensor(items) * 10

    def init(worker_id):
        return None

    user = DataLoader(
        Ids(20),
        batch_size=3,
        shuffle=False,
        num_workers=2,
        collate_fn=collate,
        drop_last=True,
        timeout=7,
        worker_init_fn=init,
        prefetch_factor=3,
        persistent_workers=True,
        generator=generator,
    )
    loader = prepare_dataloader(user, rank=1, world_size=2, seed=9)
    assert isinstance(loader, ResumableDataLoader) and loader.kind == "map"
    assert (loader.batch_size, loader.drop_last, loader.num_workers, loader.timeout) == (3, True, 2, 7)
    assert (loader.collate_fn, loader.worker_init_fn, loader.generator) == (collate, init, generator)
    assert (loader.prefetch_factor, loader.persistent_workers) == (3, True)
    sampler = loader.sampler
    assert (sampler.shuffle, sampler.seed, sampler.rank, sampler.num_replicas) == (False, 9, 1, 2)
    assert prepare_dataloader(loader, rank=1, world_size=2) is loader
    with pytest.raises(ConfigurationError, match="prepared for rank 1 of 2, not rank 0 of 2"):
        prepare_dataloader(loader, rank=0, world_size=2)
    with pytest.raises(ConfigurationError, match="rank=2 is not valid for world_size=2"):
        prepare_dataloader(user, rank=2, world_size=2)
    unwrapped = BatchSampler(SequentialSampler(range(9)), 4, True)
    plain = prepare_dataloader(DataLoader(Ids(9), batch_sampler=unwrapped), rank=0, world_size=1)
    assert plain.kind == "map" and [b.tolist() for b in plain] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_user_distributed_sampler_is_kept_and_resumes_with_the_same_layout():
    sampler = DistributedSampler(range(30), 2, 1, seed=2)
    user = DataLoader(Ids(30), batch_size=4, sampler=sampler)
    loader = prepare_dataloader(user, rank=1, world_size=2)
    assert loader.sampler is sampler and loader.kind == "custom"
    set_loader_epoch(loader, 3)
    assert sampler.epoch == 3
    full = [b.tolist() for b in loader]
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    again = prepare_dataloader(DataLoader(Ids(30), batch_size=4, sampler=sampler), rank=1, world_size=2)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == full[1:]
    with pytest.raises(ConfigurationError, match="cannot be re-sharded: it was saved with world_size=2"):
        prepare_dataloader(
            DataLoader(Ids(30), batch_size=4, sampler=DistributedSampler(range(30), 1, 0)), rank=0, world_size=1
        ).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="is for rank 1 of 2 but this process is rank 0 of 2"):
        prepare_dataloader(user, rank=0, world_size=2)


def test_custom_batch_sampler_and_sampler_are_kept_with_a_warning():
    class EveryOther(BatchSampler):
        pass

    batch_sampler = EveryOther(SequentialSampler(range(10)), 2, False)
    with pytest.warns(UserWarning, match="custom batch_sampler EveryOther .* not sharded"):
        loader = prepare_dataloader(DataLoader(Ids(10), batch_sampler=batch_sampler), rank=0, world_size=2)
    assert loader.batch_sampler is batch_sampler
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 10, 10)
    with pytest.warns(UserWarning, match="custom sampler WeightedRandomSampler"):
        loader = prepare_dataloader(DataLoader(Ids(10), sampler=weighted, batch_size=2), rank=0, world_size=2)
    assert loader.sampler is weighted


class Stream(IterableDataset):
    """Counts up to n; Stateful, so it resumes without re-reading."""

    def __init__(self, n):
        self.n, self.pos, self.reads = n, 0, 0

    def __iter__(self):
        while self.pos < self.n:
            self.reads += 1
            self.pos += 1
            yield self.pos - 1

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def test_iterable_dataset_resumes_through_its_own_state():
    loader = prepare_dataloader(DataLoader(Stream(10), batch_size=3), rank=0, world_size=1)
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2]
    state = loader.state_dict()
    stream = Stream(10)
    resumed = prepare_dataloader(DataLoader(stream, batch_size=3), rank=0, world_size=1)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[3, 4, 5], [6, 7, 8], [9]]
    assert stream.reads == 7
    two = prepare_dataloader(DataLoader(Stream(10), batch_size=3), rank=0, world_size=2)
    assert two.kind == "stream"  # split between the ranks (tests/trainer/test_iterable_split.py)
    with pytest.raises(ConfigurationError, match="IterableDataset's data position is per process"):
        two.load_state_dict(state)


# -- evaluation helpers ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n,world,batch,drop_last",
    [(10, 4, 2, False), (10, 4, 3, False), (7, 2, 2, False), (9, 3, 1, False), (12, 4, 2, False), (7, 2, 2, True)],
)
def test_padding_is_counted_and_dropped_from_gathered_batches(n, world, batch, drop_last):
    loaders = [make(n, world, r, batch, drop_last=drop_last) for r in range(world)]
    pad = num_padding_samples(loaders[0])
    iters, gathered, received = [iter(loader) for loader in loaders], [], []
    steps = len(loaders[0])
    for step in range(steps):
        batches = torch.cat([next(it) for it in iters])  # what all_gather returns, rank-major
        received += batches.tolist()
        gathered += (drop_padding(batches, pad, world) if step == steps - 1 else batches).tolist()
    assert all(next(it, None) is None for it in iters)
    assert pad == len(received) - len(set(received))
    assert sorted(gathered) == sorted(set(received))  # every sample received, none twice


def test_uneven_batches_give_each_sample_once():
    loaders = [make(10, 4, r, 2, even_batches=False) for r in range(4)]
    per_rank = [sum((b.tolist() for b in loader), []) for loader in loaders]
    assert [len(p) for p in per_rank] == [3, 3, 2, 2]
    assert sorted(sum(per_rank, [])) == list(range(10)) and num_padding_samples(loaders[0]) == 0


def test_split_between_processes():
    data = list(range(10))
    parts = [split_between_processes(data, r, 3) for r in range(3)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    padded = [split_between_processes(data, r, 3, apply_padding=True) for r in range(3)]
    assert padded == [[0, 1, 2, 3], [4, 5, 6, 6], [7, 8, 9, 9]]
    tensor = torch.arange(10).reshape(5, 2)
    assert torch.equal(split_between_processes(tensor, 1, 2), tensor[3:])
    assert torch.equal(split_between_processes(tensor, 1, 2, apply_padding=True), tensor[[3, 4, 4]])
    assert split_between_processes(("a", "b"), 3, 4) == ()
    assert split_between_processes(("a", "b"), 3, 4, apply_padding=True) == ("b",)
    both = split_between_processes({"x": data, "y": torch.arange(10)}, 2, 3)
    assert both["x"] == [7, 8, 9] and both["y"].tolist() == [7, 8, 9]
    with pytest.raises(ConfigurationError, match="same length"):
        split_between_processes({"x": data, "y": [1]}, 0, 2)
    with pytest.raises(ConfigurationError, match="cannot split a set"):
        split_between_processes({1, 2}, 0, 2)
    with pytest.raises(ConfigurationError, match="num_padding=2 must be in 0..1"):
        drop_padding(torch.arange(4), 2, 2)
