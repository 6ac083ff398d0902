"""FSDPStrategy (FSDP2) against DDP on 2 real gloo processes, and ``trainforge merge-weights``.

The multi-process runs happen once per module (``runs`` fixture): tests/scripts/fsdp_train.py on
2 ranks, then tests/scripts/fsdp_one.py on 1 process resuming the 2-rank checkpoint. Each test
below checks one property from the files they wrote.

Tolerances: FSDP and DDP reduce gradients in different collectives and FSDP computes the clipping
norm from per-shard partial norms, so they agree to float rounding (1e-5 relative asked, ~1e-7
seen). Resuming on the same world size is bit-identical: DCP and the full state dict store the
exact tensors, the data position and RNG states are restored, and the same collectives run in the
same order. On another world size only rounding differs (the loss is a mean over the same 8
samples split differently), so 1e-5.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.helpers import forklaunch, procs
from trainforge.strategies import FSDPStrategy
from trainforge.strategies.errors import CheckpointError, ConfigurationError
from trainforge.strategies.fsdp_wrap import repeated_blocks, select_modules
from trainforge.trainer.cli.main import main as cli_main

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from fsdp_common import BLOCK_NAMES, TinyLM  # noqa: E402

ENV = procs.test_env(PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    output = forklaunch.launch(SCRIPTS / "fsdp_train.py", out, env=ENV, timeout=240).stdout
    assert "rank 0 ok" in output and "rank 1 ok" in output
    assert "one ok" in forklaunch.run_script(SCRIPTS / "fsdp_one.py", out, env=ENV, timeout=120).stdout
    return out, json.loads((out / "results.json").read_text()), json.loads((out / "one.json").read_text())


def _rel(a, b) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _weights(out: Path, name: str):
    return load_file(str(out / f"{name}.safetensors"))


def _assert_same_weights(a, b, rtol: float = 0.0, atol: float = 0.0) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


# ---- multi-process ------------------------------------------------------------------------------
@pytest.mark.slow
def test_loss_curve_matches_ddp(runs):
    out, r, _ = runs
    for kind in ("full_shard", "shard_grad_op"):  # 20 steps, each rank's losses
        for rank in (0, 1):
            assert len(r[kind][rank]) == 20
            assert _rel(r[kind][rank], r["ddp"][rank]) <= 1e-5, kind
        _assert_same_weights(_weights(out, kind), _weights(out, "ddp"), rtol=1e-5, atol=1e-6)
    for kind in ("hybrid_shard", "no_shard", "offload", "ac"):  # 6 steps
        for rank in (0, 1):
            assert _rel(r[kind][rank], r["ddp"][rank][:6]) <= 1e-5, kind
    assert r["hybrid_shard_placements"] == "(Replicate(), Shard(dim=0))"  # mesh (1 node, 2 ranks)
    assert r["no_shard_placements"] == "(Replicate(), Shard(dim=0))"  # mesh (2, 1): replicas
    assert r["wrap"]["placements"] == ["(Shard(dim=0),)"]


@pytest.mark.slow
def test_auto_wrap_shards_the_repeated_blocks_then_the_root(runs):
    _, r, _ = runs
    wrap = r["wrap"]
    assert wrap["wrapped"] == BLOCK_NAMES[::-1]  # bottom-up order
    assert wrap["units_are_fsdp"] == [True] * len(BLOCK_NAMES) and wrap["root_is_fsdp"]
    assert wrap["other_fsdp"] == [] and wrap["params_are_dtensors"]
    assert wrap["checkpointed"] == []
    ac = r["ac_wrap"]  # activation checkpointing on the same blocks; state dict names unchanged
    assert ac["checkpointed"] == BLOCK_NAMES[::-1] and ac["wrapped"] == BLOCK_NAMES[::-1]
    assert ac["units_are_fsdp"] == [True] * len(BLOCK_NAMES)
    assert ac["state_keys"] == wrap["state_keys"] and not any("_checkpoint" in k for k in ac["state_keys"])


@pytest.mark.slow
def test_resume_sharded_and_full_is_bit_identical(runs):
    out, r, _ = runs
    for kind, reference in (("sharded", "full_shard"), ("full", "shard_grad_op")):
        for rank in (0, 1):
            assert r[f"resumed_{kind}"][rank] == r[reference][rank][10:], kind
        _assert_same_weights(_weights(out, f"resumed_{kind}"), _weights(out, reference))
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(r["resumed_sharded_files"])
    assert not any(f.startswith("model") for f in r["resumed_sharded_files"])
    assert {"model.safetensors", "optimizers.pt"} <= set(r["resumed_full_files"])
    assert not any(f.startswith("dcp/") for f in r["resumed_full_files"])


@pytest.mark.slow
def test_full_shard_halves_per_rank_state(runs):
    _, r, one = runs
    two, single = r["memory"], one["memory"]
    assert two["params"] > 0 and two["optimizer"] >= 2 * two["params"]  # AdamW: 2 states per param + step
    assert two["total"] <= 0.55 * single["total"], (two, single)
    assert two["params"] <= 0.55 * single["params"] and two["optimizer"] <= 0.55 * single["optimizer"]


@pytest.mark.slow
def test_two_process_checkpoint_continues_on_one_process(runs):
    out, r, one = runs
    assert one["global_step"] == 20 and len(one["losses"]) == 10
    both = [(a + b) / 2 for a, b in zip(r["full_shard"][0][10:], r["full_shard"][1][10:])]
    assert _rel(one["losses"], both) <= 1e-5  # the same 8 samples per step, mean over one process
    _assert_same_weights(_weights(out, "one_final"), _weights(out, "full_shard"), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_merge_weights_equals_gathered_state(runs, tmp_path, capsys):
    out, _, _ = runs
    assert cli_main(["merge-weights", str(out / "ckpt" / "step-10"), str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    _assert_same_weights(merged, _weights(out, "gathered_step10"))
    # a checkpoint root (its latest), sharded output with an HF index
    assert cli_main(["merge-weights", str(out / "ckpt"), str(tmp_path / "shards"), "--max-shard-size", "4KB"]) == 0
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1
    parts = {k: v for f in files for k, v in load_file(str(tmp_path / "shards" / f)).items()}
    _assert_same_weights(parts, merged)
    # a full-state-dict checkpoint has nothing to merge; OUT that is not ours is never replaced
    assert cli_main(["merge-weights", str(out / "ckpt_full" / "step-10"), str(tmp_path / "x")]) == 2
    assert cli_main(["merge-weights", str(out / "ckpt" / "step-10"), str(out / "ddp")]) == 2
    err = capsys.readouterr().err
    assert "nothing to merge" in err and "does not hold weights written by trainforge" in err


@pytest.mark.slow
def test_accumulation_matches_ddp(runs):
    out, r, _ = runs
    for rank in (0, 1):
        assert len(r["fsdp_accum"][rank]) == 12  # 6 optimizer steps of 2 micro-batches
        assert _rel(r["fsdp_accum"][rank], r["ddp_accum"][rank]) <= 1e-5
    _assert_same_weights(_weights(out, "fsdp_accum"), _weights(out, "ddp_accum"), rtol=1e-5, atol=1e-6)
    # inside the window no gradient is reduced (no sharded grad yet); the last backward reduces
    assert r["no_sync"] == [[False, False], [True, True]]


@pytest.mark.slow
def test_accelerator_prepare_remaps_optimizer_and_matches_trainer(runs):
    out, r, _ = runs
    assert r["acc_remapped"]
    for rank in (0, 1):
        assert _rel(r["accelerator"][rank], r["full_shard"][rank][:10]) <= 1e-6
    _assert_same_weights(_weights(out, "acc_final"), _weights(out, "gathered_step10"), rtol=1e-6, atol=1e-7)
    for norm, unsharded, kind in r["acc_norms"]:  # clip_grad_norm_ over DTensor grads: a plain, full norm
        assert kind == "Tensor" and abs(norm - unsharded) <= 1e-6 * unsharded


# ---- one process, no process group ---------------------------------------------------------------
def test_bad_settings_name_the_choices():
    with pytest.raises(
        ConfigurationError,
        match=r"sharding_strategy='zero3' is not one of: full_shard, "
        r"shard_grad_op, hybrid_shard, no_shard",
    ):
        FSDPStrategy(sharding_strategy="zero3")
    with pytest.raises(ConfigurationError, match=r"state_dict_type='pt' is not one of: sharded, full"):
        FSDPStrategy(state_dict_type="pt")
    with pytest.raises(ConfigurationError, match="MixedPrecisionPolicy"):
        FSDPStrategy(mixed_precision="bf16")
    assert FSDPStrategy(sharding_strategy="HYBRID_SHARD").sharding_strategy == "hybrid_shard"  # as config writes


def test_select_modules_policies():
    model = TinyLM()
    assert [n for n, _ in repeated_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    by_class = select_modules(model, {nn.Linear})
    assert len(by_class) == 3 * 3 + 1 and by_class[-1][0] == "blocks.0.mix"  # bottom-up
    assert [n for n, _ in select_modules(model, {"LayerNorm"})][0] == "ln_f"
    assert [n for n, _ in select_modules(model, lambda m, name: name == "head")] == ["head"]
    with pytest.raises(ConfigurationError, match="matches no module of TinyLM; its module classes are: Block"):
        select_modules(model, {"GPT2Block"})
    with pytest.raises(ConfigurationError, match="not one of"):
        select_modules(model, 3)


@pytest.mark.slow
def test_auto_wrap_finds_hf_gpt2_blocks():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    assert [n for n, _ in repeated_blocks(model)] == ["transformer.h.0", "transformer.h.1"]


def test_merge_weights_refuses_what_is_not_a_sharded_checkpoint(tmp_path, capsys):
    assert cli_main(["merge-weights", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli_main(["merge-weights", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert cli_main(["merge-weights", str(tmp_path / "empty"), str(tmp_path / "out"), "--max-shard-size", "x"]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "no sharded checkpoint here" in err and "--max-shard-size='x'" in err
    with pytest.raises(CheckpointError):
        from trainforge.trainer.cli.merge_weights import find_dcp_dir

        find_dcp_dir(tmp_path / "empty")
