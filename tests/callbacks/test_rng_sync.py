"""RNGSync: ranks seeded differently shuffle alike after the sync (2 real processes)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from tests.scripts.cb_launch import multirank
from tests.scripts.cb_standin import StandInTrainer
from trainforge.callbacks.rng_sync import RNGSync, _apply_sampler_state, _sampler_state, _samplers
from trainforge.strategies.errors import ConfigurationError


def test_single_process_sync_keeps_the_streams():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expected = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    cb = RNGSync()
    cb.sync(StandInTrainer([cb]))  # rank 0 of 1: broadcasting to itself changes nothing
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == expected and cb.syncs == 1


def test_sampler_seed_and_generator_are_carried():
    src = RandomSampler(range(10), generator=torch.Generator().manual_seed(1))
    dst = RandomSampler(range(10), generator=torch.Generator().manual_seed(2))
    assert list(src) != list(dst)
    _apply_sampler_state(dst, _sampler_state(src))
    assert list(src) == list(dst)

    class Seeded:
        seed = 5

    target = Seeded()
    _apply_sampler_state(target, {"seed": 9})
    assert target.seed == 9

    trainer = StandInTrainer([])
    trainer.train_dataloader = DataLoader(range(10), batch_size=2, shuffle=True)
    assert _samplers(trainer) == [trainer.train_dataloader.sampler]  # batch_sampler.sampler is the same one


def test_bad_every():
    with pytest.raises(ConfigurationError, match=r"every\)='batch' is not one of: epoch, step"):
        RNGSync(every="batch")


@pytest.mark.slow
def test_two_ranks_seeded_differently_shuffle_alike():
    r0, r1 = multirank("rng")

    def shards(res, mode):
        by_epoch = {}
        for epoch, indices in res[mode]["seen"]:
            by_epoch.setdefault(epoch, []).extend(int(i) for i in indices)
        return by_epoch

    for mode in ("nosync", "sync"):
        assert sorted(shards(r0, mode)) == sorted(shards(r1, mode)) == [0, 1]
    # Without the sync the seeds differ, so random draws differ; the shuffle order is still one
    # (the loader shards rank 0's permutation, as Accelerate synchronises its sampler generator).
    nosync0, nosync1 = shards(r0, "nosync"), shards(r1, "nosync")
    for epoch in (0, 1):
        assert sorted(nosync0[epoch] + nosync1[epoch]) == list(range(16))
    assert r0["nosync"]["draws"] != r1["nosync"]["draws"]
    # With it, one shuffle order is shared: the shards split the dataset exactly, every epoch,
    # and torch / random / numpy give the same numbers on both ranks.
    sync0, sync1 = shards(r0, "sync"), shards(r1, "sync")
    for epoch in (0, 1):
        assert sorted(sync0[epoch] + sync1[epoch]) == list(range(16))
    assert sync0[0] != sync0[1]  # and it still reshuffles per epoch
    assert r0["sync"]["draws"] == r1["sync"]["draws"]
