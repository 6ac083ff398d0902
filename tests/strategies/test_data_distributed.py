"""strategies.data.loader with real processes (gloo, 2 ranks, started as torchrun starts workers)."""

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers import forklaunch
from trainforge.strategies.data.loader import prepare_dataloader

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "data_shard_check.py"


@pytest.mark.slow
def test_two_ranks_get_disjoint_covering_shards_that_change_with_set_epoch_and_resume_on_one(tmp_path):
    out = tmp_path / "records.pt"
    forklaunch.launch(SCRIPT, out, timeout=120)
    records = torch.load(out, weights_only=True)
    n, batch, steps = 44, 4, 3
    assert [r["rank"] for r in records] == [0, 1] and {r["world_size"] for r in records} == {2}
    orders = []
    for epoch in range(2):
        shards = [sum(r["epochs"][epoch], []) for r in records]
        assert not set(shards[0]) & set(shards[1])  # disjoint
        assert sorted(shards[0] + shards[1]) == list(range(n))  # together: the dataset, once
        for rank, shard in enumerate(shards):  # exactly torch's DistributedSampler
            ref = DistributedSampler(range(n), 2, rank, seed=11)
            ref.set_epoch(epoch)
            assert shard == list(ref)
        orders.append(shards)
    assert orders[0][0] != orders[1][0]  # set_epoch changed the order

    # Both ranks saved the same global position; one process with the doubled batch goes on from it.
    states = [r["state"] for r in records]
    assert {(s["epoch"], s["consumed"]) for s in states} == {(2, steps * batch * 2)}
    taken = {i for r in records for b in r["epoch2_taken"] for i in b}
    single = prepare_dataloader(
        DataLoader(list(range(n)), batch_size=2 * batch, shuffle=True), rank=0, world_size=1, seed=11
    )
    single.load_state_dict(states[0])
    single.set_epoch(2)
    resumed_steps = [sorted(b.tolist()) for b in single]
    rest = sum(resumed_steps, [])
    assert not taken & set(rest) and len(rest) == n - len(taken)
    assert sorted(taken | set(rest)) == list(range(n))
    refs = []
    for rank in range(2):
        ref = DistributedSampler(range(n), 2, rank, seed=11)
        ref.set_epoch(2)
        refs.append(list(ref))
    uninterrupted = [sorted(refs[0][s : s + batch] + refs[1][s : s + batch]) for s in range(0, n // 2, batch)]
    assert resumed_steps == uninterrupted[steps:]  # the same global steps as two ranks would take
