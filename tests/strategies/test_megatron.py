"""MegatronStrategy: TP and FSDP2 x TP against an unsharded reference on real gloo processes, DCP
checkpoints (exact resume, reshard tp2 x dp2 -> dp2, merge-weights on one process), bad input.

Two launches (module fixture): tests/scripts/megatron_train.py on 4 processes (tp2 x dp2, 20 steps,
saves a checkpoint), then on 2 (tp2: GPT of blocks and transformers Llama with tp_plan="auto",
resume, and loading the 4-process checkpoint on dp2). Every rank trains the unsharded reference
itself, so the numbers are computed in the child processes and checked here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import forklaunch
from tests.helpers.procs import run
from trainforge.strategies import resolve_strategy
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.megatron import MegatronStrategy
from trainforge.strategies.parallel import ParallelDims, resolve_plan
from trainforge.trainer.cli.main import main as cli_main

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from fsdp_common import TinyLM  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    for mode, nproc in (("tp2dp2", 4), ("tp2", 2)):
        output = forklaunch.launch(SCRIPTS / "megatron_train.py", mode, out, nproc=nproc, timeout=400).stdout
        assert "rank 0 ok" in output, output[-3000:]
    return out, json.loads((out / "tp2dp2.json").read_text()), json.loads((out / "tp2.json").read_text())


@pytest.mark.slow
def test_tp2_matches_single_process(runs):
    _, _, tp2 = runs
    assert tp2["placements"] == "(Shard(dim=0),)"  # the colwise weight really is sharded on tp
    assert 0.5 < tp2["coverage"] < 1
    assert tp2["gpt_steps"] == 6 and tp2["gpt_loss_diff"] < 1e-5
    assert tp2["gpt_grad_diff"] < 1e-5
    assert tp2["accelerator_loss_diff"] < 1e-5  # Accelerator.prepare(model, optimizer built before)


@pytest.mark.slow
def test_tp2_llama_auto_plan_matches_single_process(runs):
    _, _, tp2 = runs
    assert tp2["llama_grad_diff"] < 1e-5 and tp2["llama_loss_diff"] < 1e-5


@pytest.mark.slow
def test_auto_sizes_choose_the_layout_that_fits(runs):
    _, _, tp2 = runs
    # a device only tp2 fits: the same losses as the explicit tensor_parallel_size=2 run
    assert tp2["auto_layout"] == "pp=1 x dp=1 x tp=2" and tp2["auto_steps"] == 3 and tp2["auto_loss_diff"] < 1e-6
    table = tp2["auto_table"]  # logged on rank 0: every layout, the chosen one marked
    assert "pp=1 x dp=2 x tp=1" in table and "pp=2 x dp=1 x tp=1" in table, table
    assert "pp=1 x dp=1 x tp=2" in table.split("<- chosen")[0].splitlines()[-1], table
    # Accelerator.prepare(model, optimizer, loader), room for all: dp2, each rank reads its own half
    assert tp2["acc_auto_layout"] == "pp=1 x dp=2 x tp=1" and tp2["acc_auto_batches"] == 20
    assert tp2["acc_auto_ranks_differ"]
    assert "prepare the model before (or together with) its loaders" in tp2["acc_loader_first_error"]


@pytest.mark.slow
def test_sequence_and_loss_parallel_switches_match_single_process(runs):
    _, _, tp2 = runs
    for name in ("sp", "lp", "splp"):  # transformers Llama, tp_plan="auto": first-step loss and gradients
        assert tp2[name]["grad"] < 1e-5 and tp2[name]["loss"] < 1e-5, (name, tp2[name])
    # sequence parallel: the norms between the TP regions see 1/tp of the tokens
    assert tp2["sp"]["norm_out"] == "(Shard(dim=1),)" and tp2["lp"]["norm_out"] == "None"
    # loss parallel: the logits stay sharded on the vocabulary
    assert tp2["lp"]["logits"] == "(Shard(dim=2),)" and tp2["sp"]["logits"] == "None"
    assert tp2["splp_trainer_steps"] == 3 and tp2["splp_trainer_loss_diff"] < 1e-5  # through the Trainer


@pytest.mark.slow
def test_fsdp_x_tp_20_steps_match_single_process(runs):
    _, res, _ = runs
    assert res["layout"] == "pp=1 x dp=2 x tp=2"
    assert res["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # dp (FSDP) over tp shards
    assert res["tp_ranks_equal"] and res["steps"] == 20 and res["loss_diff"] < 1e-4
    # data_parallel="ddp": parameters replicated on dp, the FSDP run's losses; its checkpoint loads under FSDP2
    assert res["ddp_placements"] == "(Replicate(), Shard(dim=0))"
    assert res["ddp_steps"] == 5 and res["ddp_loss_diff"] < 1e-5 and res["ddp_ckpt_diff"] == 0.0


@pytest.mark.slow
def test_checkpoint_exact_resume_and_reshard(runs, tmp_path):
    out, _, tp2 = runs
    assert tp2["resume_losses_equal"] and tp2["resume_weights_diff"] == 0.0
    assert tp2["dp2_layout"] == "pp=1 x dp=2 x tp=1" and tp2["dp2_load_diff"] == 0.0
    # one process: trainforge merge-weights consolidates the tp2 x dp2 checkpoint
    assert cli_main(["merge-weights", str(out / "ckpt_tp2dp2"), str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    saved = load_file(str(out / "tp2dp2.safetensors"))
    assert sorted(k[len("net.") :] for k in merged) == sorted(saved)
    assert all(torch.equal(merged["net." + k], v) for k, v in saved.items())


# ---- bad input: each a clear error before any process starts or any weight moves ----------------
def test_sizes_that_do_not_multiply_to_the_world():
    with pytest.raises(
        ConfigurationError,
        match=r"pipeline_parallel_size=1 x data_parallel_size=3 x "
        r"tensor_parallel_size=2 = 6, but world_size=4",
    ):
        ParallelDims.resolve(tp=2, pp=1, dp=3, world_size=4)
    with pytest.raises(
        ConfigurationError,
        match=r"tensor_parallel_size=4 x pipeline_parallel_size=1 = 4 does not "
        r"divide world_size=6",
    ):
        ParallelDims.resolve(tp=4, pp=1, dp="auto", world_size=6)
    with pytest.raises(ConfigurationError, match=r"tensor_parallel_size=0 must be a positive int"):
        MegatronStrategy(tensor_parallel_size=0)
    assert ParallelDims.resolve(tp=2, pp=1, dp="auto", world_size=8).dp == 4


def test_unknown_choices_and_unbuilt_options():
    with pytest.raises(ConfigurationError, match=r"schedule='fifo' is not one of: gpipe, 1f1b"):
        MegatronStrategy(schedule="fifo")
    with pytest.raises(ConfigurationError, match=r"data_parallel='zero' is not one of: fsdp, ddp"):
        MegatronStrategy(data_parallel="zero")
    assert MegatronStrategy(pipeline_parallel_size=2, schedule="dualpipev").schedule == "dualpipev"
    assert MegatronStrategy(tensor_parallel_size="auto", pipeline_parallel_size="auto").sizes["tp"] == "auto"
    assert isinstance(resolve_strategy("megatron", tensor_parallel_size=2), MegatronStrategy)


def test_auto_layout_bad_inputs():
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainforge.strategies.parallel.auto import choose_auto_layout

    for kwargs, match in (
        ({"seq_len": 0}, r"seq_len=0 must be None or an int >= 1"),
        ({"device_memory": "80GB"}, r"device_memory='80GB' must be None or an int >= 1 \(bytes"),
        (
            {"model_shape": {"layers": 2}},
            r"model_shape=\{'layers': 2\} must be a dict of positive "
            r"ints with keys layers, hidden, heads",
        ),
        (
            {"tensor_parallel_size": "max"},
            r"tensor_parallel_size='max' must be a positive int or "
            r"'auto'",
        ),
    ):
        with pytest.raises(ConfigurationError, match=match):
            MegatronStrategy(**kwargs)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    common = dict(
        world_size=2,
        device="cpu",
        precision="32",
        device_memory=None,
        model_shape=None,
        schedule="1f1b",
        num_microbatches=None,
        activation_checkpointing=False,
        sequence_parallel=False,
        log_table=False,
    )
    auto = {"tp": "auto", "pp": "auto", "dp": "auto"}
    with pytest.raises(
        ConfigurationError,
        match=r"sequence length \(None\).*pass MegatronStrategy\(\.\.\., "
        r"seq_len=TOKENS\)",
    ):
        choose_auto_layout(llama, auto, seq_len=None, micro_batch_size=4, **common)
    with pytest.raises(ConfigurationError, match=r"TinyLM holds no transformers model.*model_shape="):
        choose_auto_layout(TinyLM(), auto, seq_len=8, micro_batch_size=4, **common)
    with pytest.raises(ConfigurationError, match=r"(?s)no \(pp, dp, tp\) layout fits .*pp=1 x dp=2 x tp=1 .* no\n"):
        choose_auto_layout(llama, auto, seq_len=8, micro_batch_size=4, **{**common, "device_memory": 1000})
    with pytest.raises(
        ConfigurationError,
        match=r"no \(pp, dp, tp\) layout of world_size=2 matches the sizes given "
        r"\(tp=3",
    ):
        choose_auto_layout(llama, {**auto, "tp": 3}, seq_len=8, micro_batch_size=4, **common)
    # plenty of memory: the fastest (data parallel); a plain model with model_shape uses the formula
    assert (
        str(choose_auto_layout(llama, auto, seq_len=8, micro_batch_size=4, **{**common, "device_memory": 2**30}))
        == "pp=1 x dp=2 x tp=1"
    )
    shape = {"layers": 3, "hidden": 16, "heads": 2}
    assert (
        choose_auto_layout(
            TinyLM(),
            {**auto, "tp": 2},
            seq_len=8,
            micro_batch_size=4,
            **{**common, "device_memory": 2**30, "model_shape": shape},
        ).tp
        == 2
    )


def test_sequence_and_loss_parallel_bad_inputs():
    from trainforge.strategies.parallel.sp import rewrite_plan

    with pytest.raises(ConfigurationError, match=r"sequence_parallel='yes' must be True or False"):
        MegatronStrategy(tensor_parallel_size=2, sequence_parallel="yes")
    with pytest.raises(
        ConfigurationError,
        match=r"loss_parallel=True .* tensor_parallel_size=1; set "
        r"tensor_parallel_size > 1",
    ):
        MegatronStrategy(loss_parallel=True)
    with pytest.raises(ConfigurationError, match=r"sequence_parallel=True with pipeline_parallel_size=2 is not built"):
        MegatronStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True)
    plan = resolve_plan(TinyLM(), {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}, 2)
    with pytest.raises(
        ConfigurationError,
        match=r"loss_parallel=True .* no colwise layer with a replicated output.*"
        r"\{'lm_head': 'colwise_rep'\}",
    ):
        rewrite_plan(TinyLM(), plan, sequence_parallel=False, loss_parallel=True)
    with pytest.raises(ConfigurationError, match=r"sequence_parallel=True .* tp_plan has no rowwise Linear"):
        rewrite_plan(
            TinyLM(), resolve_plan(TinyLM(), {"head": "colwise_rep"}, 2), sequence_parallel=True, loss_parallel=False
        )
    sp = rewrite_plan(TinyLM(), plan, sequence_parallel=True, loss_parallel=False)
    assert {type(sp[n]).__name__ for n in ("ln_f", "blocks.0.ln1", "blocks.2.ln2")} == {"SequenceParallel"}
    assert (
        type(sp["embed"]).__name__ == "PrepareModuleOutput"
        and str(sp["blocks.0.mlp.2"].output_layouts) == "(Shard(dim=1),)"
    )


def test_model_without_plan_lists_its_linear_layers():
    with pytest.raises(
        ConfigurationError,
        match=r"TinyLM has no tensor-parallel plan.*blocks\.0\.mix.*head.*"
        r"Example: \{\"blocks",
    ):
        resolve_plan(TinyLM(), "auto", 2)


def test_plan_glob_that_matches_nothing_and_unknown_style():
    with pytest.raises(ConfigurationError, match=r"tp_plan glob 'layers\.\*\.mlp' matches no module of TinyLM"):
        resolve_plan(TinyLM(), {"layers.*.mlp": "colwise"}, 2)
    with pytest.raises(ConfigurationError, match=r"tp_plan\['head'\]='columnwise' is not one of: colwise"):
        resolve_plan(TinyLM(), {"head": "columnwise"}, 2)


def test_tp_size_that_does_not_divide_the_hidden_size_or_heads():
    with pytest.raises(
        ConfigurationError,
        match=r"tensor_parallel_size=3 does not divide blocks\.0\.mlp\.0\."
        r"out_features=64",
    ):
        resolve_plan(TinyLM(), {"blocks.*.mlp.0": "colwise"}, 3)
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=36,
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=6,
            num_key_value_heads=3,
        )
    )
    with pytest.raises(ConfigurationError, match=r"tensor_parallel_size=2 does not divide num_key_value_heads=3"):
        resolve_plan(llama, "auto", 2)
    plan = resolve_plan(llama, "auto", 3)
    assert "model.layers.0.self_attn.q_proj" in plan and "lm_head" in plan


def test_plan_globs_are_one_path_component():
    plan = resolve_plan(TinyLM(), {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}, 2)
    assert sorted(plan) == [f"blocks.{i}.mlp.{j}" for i in range(3) for j in (0, 2)]


def test_megatron_section_of_the_launch_config():
    from trainforge.trainer.cli.launch_settings import strategy_kwargs

    kwargs = strategy_kwargs("megatron", {"megatron": {"tensor_parallel_size": 2, "schedule": "gpipe"}})
    assert kwargs == {"tensor_parallel_size": 2, "schedule": "gpipe"}
    assert MegatronStrategy(**kwargs).sizes["tp"] == 2
    with pytest.raises(
        ConfigurationError,
        match=r"megatron.tp_size is not a MegatronStrategy setting; valid keys: "
        r"tensor_parallel_size",
    ):
        strategy_kwargs("megatron", {"megatron": {"tp_size": 2}})


@pytest.mark.slow
def test_parallel_benchmark_smoke():
    # its ranks forked, as torchrun starts them (its own relaunch through torch.distributed.run is one call)
    script = SCRIPTS.parents[1] / "benchmarks" / "parallel.py"
    size = ["--dim", "16", "--depth", "2", "--vocab", "32", "--seq", "8", "--steps", "1", "--warmup", "0"]
    out = forklaunch.launch(script, *size, nproc=2, timeout=300).stdout
    for layout in ("dp2 ", "tp2 ", "pp2 "):
        line = next(line for line in out.splitlines() if line.startswith(layout))
        assert "per-rank MiB [" in line and "formula" in line and " ms" in line, out[-2000:]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_parallel_benchmark_on_gpus_reports_tokens_per_second():
    out = run(
        [sys.executable, str(SCRIPTS.parents[1] / "benchmarks" / "parallel.py"), "--processes", "2", "--steps", "2"],
        timeout=300,
    ).stdout
    assert "tok/s" in out and "tp2 " in out, out[-2000:]
