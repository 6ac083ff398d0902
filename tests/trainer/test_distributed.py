"""Two real processes (gloo on CPU), started as torchrun starts workers (tests/helpers/forklaunch.py;
the launcher itself is tested in test_cli.py and test_examples.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import forklaunch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def launch(script: str, *args: str, nproc: int = 2, timeout: int = 180):
    return forklaunch.launch(SCRIPTS / script, *args, nproc=nproc, timeout=timeout)


@pytest.mark.slow
def test_ddp_trainer_and_accelerator_match_raw_ddp_bit_for_bit(tmp_path):
    launch("dist_parity.py", str(tmp_path))
    initial = load_file(tmp_path / "initial.safetensors")
    for accum in (1, 2):
        raw = load_file(tmp_path / f"raw_accum{accum}.safetensors")
        assert any(not torch.equal(raw[k], initial[k]) for k in raw), "raw DDP loop did not train"
        # the Trainer shards samples as Lightning's DistributedSampler, the Accelerator whole batches as Accelerate
        for other, reference in (
            ("trainer", raw),
            ("accelerator", load_file(tmp_path / f"raw_accelerate_accum{accum}.safetensors")),
        ):
            got = load_file(tmp_path / f"{other}_accum{accum}.safetensors")
            for key, value in reference.items():
                assert torch.equal(got[key], value), f"{other} with accumulation {accum} differs at {key}"


@pytest.mark.slow
def test_gather_for_metrics_counts_each_sample_once_and_collectives(tmp_path):
    out = tmp_path / "result.json"
    launch("dist_collectives.py", str(out))
    r = json.loads(out.read_text())
    assert sorted(r["seen"]) == list(range(13))  # 13 samples on 2 ranks: the padding dropped
    assert r["doubled"] == [2 * i for i in r["seen"]]  # nested structures gathered in the same order
    rank0, rank1 = r["per_rank"]
    # whole batches of 4 in turn, the last round completed from the epoch's start (Accelerate's BatchSamplerShard)
    assert rank0 == [0, 1, 2, 3, 8, 9, 10, 11] and rank1 == [4, 5, 6, 7, 12, 0, 1, 2]
    assert r["gathered_scalar"] == [0.0, 1.0]
    assert (r["reduce_sum"], r["reduce_mean"], r["reduce_max"]) == (3.0, 1.5, 2.0)
    assert r["broadcast"] == {"from": 1}
    assert r["padded"] == [0, 1, -1, 0, 1, 2]
    # Accelerate: gather_for_metrics outside a dataloader loop is a plain gather (no rows dropped)
    assert r["after_loop_rows"] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    # Accelerate: gather_object concatenates lists in rank order; main_process_first lets rank 0 in
    # first; on_process runs on that process only; even_batches=False drops the padding (13 samples in
    # batches of 4: 8 + 5); split_batches divides the batch; a prepared scheduler steps once per process.
    assert r["gather_object"] == ["r0", "r1"]
    assert r["main_first_order"] == ["0", "1"]
    assert r["on_process_1"] == [None, 1]
    assert r["uneven_counts"] == [8, 5]
    assert r["split_batch_sizes"] == [4, 4]
    assert r["lr_after_one_step"] == 0.25
    assert r["no_sync_then_trigger"] == [True, True]  # Accelerate test_sync: trigger_sync_in_backward
    assert r["split"] == [[0, 1, 2], [3, 4]]
    assert r["fp16_hook_weights_agree"] is True
    assert "comm_hook='bf16'" in r["bf16_hook_error"] and "'gloo'" in r["bf16_hook_error"]


def _parity_in_notebook(out_dir: str) -> None:
    sys.path.insert(0, str(SCRIPTS))
    import dist_parity

    dist_parity.main(out_dir)


@pytest.mark.slow
def test_notebook_launcher_ddp_matches_raw_ddp(tmp_path):
    from trainforge import notebook_launcher

    notebook_launcher(_parity_in_notebook, args=(str(tmp_path),), num_processes=2, timeout=240)
    for accum in (1, 2):
        raw = load_file(tmp_path / f"raw_accum{accum}.safetensors")
        trained = load_file(tmp_path / f"trainer_accum{accum}.safetensors")
        assert all(torch.equal(trained[k], raw[k]) for k in raw), f"accumulation {accum}: Trainer != raw DDP"


@pytest.mark.slow
def test_manual_optimization_with_two_optimizers_under_ddp(tmp_path):
    """Lightning: a GAN-style manual optimization step (two optimizers, two backward passes per
    forward) trains under DDP (with find_unused_parameters=True) like the raw DDP loop."""
    out = tmp_path / "manual.json"
    launch("dist_manual.py", str(out))
    r = json.loads(out.read_text())
    assert r == {"agree": True, "global_step": 8, "matches_raw_ddp": True}
