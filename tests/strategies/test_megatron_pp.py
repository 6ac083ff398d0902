"""MegatronStrategy pipeline parallelism: schedules against a single-process run on real gloo
processes, validation, tied embeddings, TP x PP and PP x FSDP2, DCP checkpoints across layouts
(with the optimizer state), bad input.

Two launches (module fixture): tests/scripts/megatron_pp.py on 4 processes (tp2 x pp2 for 20 steps
with a checkpoint, loaded under FSDPStrategy; pp2 x dp2 with tied embeddings), then on 2 (pp2:
gpipe, 1f1b, interleaved_1f1b, validation, activation checkpointing, tied embeddings, resume, the
4-process checkpoint on pp2 and dp2, pp2 -> tp2 resume, refusals). Every rank trains the
single-process reference itself, so the numbers are computed in the child processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.helpers import forklaunch
from trainforge import TrainingModule
from trainforge.strategies.base import RunSettings
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.megatron import MegatronStrategy
from trainforge.strategies.parallel import ParallelDims
from trainforge.strategies.parallel.pp import check_tied_placement, plan_split, prune, stage_ids, stage_module
from trainforge.trainer.cli.main import main as cli_main

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from megatron_pp import GPT, LitGPT  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_pp")
    for mode, nproc in (("tp2pp2", 4), ("pp2", 2)):
        output = forklaunch.launch(SCRIPTS / "megatron_pp.py", mode, out, nproc=nproc, timeout=400).stdout
        assert "rank 0 ok" in output, output[-3000:]
    return out, json.loads((out / "pp2.json").read_text()), json.loads((out / "tp2pp2.json").read_text())


@pytest.mark.slow
def test_pp2_schedules_match_single_process(runs):
    _, res, _ = runs
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv"):
        assert res[f"{schedule}_loss_diff"] < 1e-5 and res[f"{schedule}_weights_diff"] < 1e-5, schedule
    # rank 0 really holds only its stages: embedding + first half (single), stages 0 and 2 (interleaved)
    assert res["1f1b_stages"] == [0] and res["1f1b_local_params"] == ["blocks.0", "blocks.1", "embed"]
    assert res["interleaved_1f1b_stages"] == [0, 2]
    assert res["interleaved_1f1b_local_params"] == ["blocks.0", "blocks.2", "embed"]
    assert res["zbv_stages"] == [0, 3]  # V-shaped: rank 0 holds the first and the last stage
    assert res["zbv_local_params"] == ["blocks.0", "blocks.3", "embed", "head", "ln_f"]
    assert res["ac_wrapped"] == 2 and res["ac_loss_diff"] < 1e-5 and res["ac_weights_diff"] < 1e-5  # + checkpointing


@pytest.mark.slow
def test_accelerator_loop_on_a_plain_model(runs):
    _, res, _ = runs
    assert res["accelerator_loss_diff"] < 1e-5
    assert res["accelerator_param_groups"] == 1 + 2 * 10  # rank 0: the embedding and two blocks of 10 tensors
    assert "backward(loss) with pipeline parallelism" in res["accelerator_backward"]


@pytest.mark.slow
def test_validation_runs_the_loss_through_the_stages(runs):
    _, res, _ = runs
    assert res["val_loss_diff"] < 1e-5 and res["val_train_loss_diff"] < 1e-5
    assert res["validate_diff"] < 1e-5  # Trainer.validate without fit


@pytest.mark.slow
def test_tied_embeddings_stay_tied_across_stages(runs):
    _, res, tp = runs
    assert res["tied_rank0_holds"] == ["net.embed.weight"] and res["pp_split_rank0_blocks"] == ["0"]  # pp_split
    assert res["tied_copies_equal"]  # gradients summed over the embedding group: both copies step alike
    assert res["tied_loss_diff"] < 1e-5 and res["tied_weights_diff"] < 1e-5
    assert tp["pp2dp2_layout"] == "pp=2 x dp=2 x tp=1" and tp["pp2dp2_placements"] == "(Shard(dim=0),)"
    assert tp["pp2dp2_loss_diff"] < 1e-5 and tp["pp2dp2_weights_diff"] < 1e-5  # FSDP2 per stage, tied
    # data_parallel="ddp": each stage replicated on dp (not sharded), the same losses
    assert tp["pp2dp2_ddp_placements"] == "(Replicate(),)" and tp["pp2dp2_ddp_steps"] == 3
    assert tp["pp2dp2_ddp_loss_diff"] < 1e-6
    assert tp["tied_tp2pp2_loss_diff"] < 1e-5 and tp["tied_tp2pp2_weights_diff"] < 1e-4  # TP-sharded tied copies
    assert (
        "tied parameter 'net.embed.weight' is sharded differently on the stages sharing it"
        in tp["tied_tp2pp2_mismatch"]
        or "'net.head.weight' is sharded differently" in tp["tied_tp2pp2_mismatch"]
    )


@pytest.mark.slow
def test_tp2_x_pp2_20_steps_match_single_process(runs):
    _, _, tp = runs
    assert tp["layout"] == "pp=2 x dp=1 x tp=2" and tp["placements"] == "(Shard(dim=0),)"
    assert tp["steps"] == 20 and tp["loss_diff"] < 1e-4 and tp["weights_diff"] < 1e-3


@pytest.mark.slow
def test_checkpoints_resume_reshard_and_merge(runs, tmp_path):
    out, res, tp = runs
    assert res["resume_losses_equal"] and res["resume_weights_diff"] == 0.0
    assert res["tp2pp2_to_pp2_diff"] == 0.0  # tp2 x pp2 -> pp2 through DCP
    assert tp["tp2pp2_to_fsdp_diff"] == 0.0 and tp["tp2pp2_to_fsdp_steps"] == [20]  # and under FSDPStrategy
    assert res["tp2pp2_to_dp2_layout"] == "pp=1 x dp=2 x tp=1" and res["tp2pp2_to_dp2_diff"] == 0.0
    # resume with the optimizer state on another layout: tp2 x pp2 -> pp2, and pp2 -> tp2
    assert res["tp2pp2_resumed_on_pp2_loss_diff"] < 1e-4 and res["pp2_resumed_on_tp2_loss_diff"] < 1e-5
    # one process: merge-weights of the tp2 x pp2 checkpoint gives exactly the weights it saved,
    # under the original model's names (loadable into the unsplit model)
    assert cli_main(["merge-weights", str(out / "ckpt_tp2pp2"), str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    saved = load_file(str(out / "tp2pp2.safetensors"))
    assert sorted(merged) == sorted(saved) == sorted(LitGPT().state_dict())
    assert all(torch.equal(merged[k], v) for k, v in saved.items())
    # the pp2 checkpoint (step 3) on one process equals a single-process run of 3 steps
    assert cli_main(["merge-weights", str(out / "ckpt_pp2"), str(tmp_path / "merged_pp2")]) == 0
    merged = load_file(str(tmp_path / "merged_pp2" / "model.safetensors"))
    ref = load_file(str(out / "ref_step3.safetensors"))
    module = LitGPT()
    module.load_state_dict(merged)
    assert max(float((merged[k] - ref[k]).abs().max()) for k in ref) < 1e-5


@pytest.mark.slow
def test_refusals_inside_a_run(runs):
    _, res, _ = runs
    assert "batch_size=4 does not split into num_microbatches=3" in res["bad_batch"]
    assert "reads 10 samples an epoch, so its last batch holds 2 instead of batch_size=4" in res["last_batch"]
    assert "compile=True with pipeline parallelism is not built yet" in res["compile"]
    assert "automatic_optimization=False with pipeline parallelism" in res["manual"]
    assert (
        "schedule='interleaved_1f1b' with num_microbatches=5 on pipeline_parallel_size=2"
        in res["schedule_microbatches"]
        and "choose num_microbatches as a multiple of 2" in res["schedule_microbatches"]
    )


# ---- the split, and bad input: clear errors before any process starts or any weight moves --------
def test_split_balanced_by_parameter_count_and_by_cut_points():
    split = plan_split(LitGPT(), 2)
    assert split.prefix == "net" and split.blocks == "blocks"
    assert split.stages == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "head"]]
    split = plan_split(LitGPT(), 2, ["net.blocks.3"])
    assert split.stages == [["embed", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "ln_f", "head"]]
    lit = LitGPT()
    lit.net.blocks[0] = nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)])  # a heavy first block
    assert plan_split(lit, 2).stages[0] == ["embed", "blocks.0"]
    tied = plan_split(LitGPT(tied=True), 2)
    assert tied.tied == [[(0, "net.embed.weight"), (1, "net.head.weight")]]
    check_tied_placement(tied, 2, "1f1b")  # first and last stage on two ranks: fine
    assert stage_ids(0, 2, 4, "zbv") == [0, 3] and stage_ids(1, 2, 4, "interleaved_1f1b") == [1, 3]
    with pytest.raises(
        ConfigurationError,
        match=r"tied parameter net.embed.weight = net.head.weight is used by "
        r"stages \[0, 3\], which run on pipeline ranks \[0, 0\]",
    ):
        check_tied_placement(plan_split(LitGPT(tied=True), 4), 2, "zbv")


def test_stage_modules_keep_original_names_and_compute_the_model():
    lit, ref = LitGPT(), LitGPT()
    split = plan_split(lit, 2)
    stages = [stage_module(lit, split, s) for s in (0, 1)]
    prune(lit, split, [1])
    assert sorted({n.split(".")[2] for n in dict(lit.named_parameters()) if ".blocks." in n}) == ["2", "3"]
    assert "net.embed.weight" not in dict(lit.named_parameters())
    x = torch.randint(0, 32, (2, 8))
    assert torch.allclose(stages[1](stages[0](x)), ref.net(x))


def test_bad_pipeline_settings():
    with pytest.raises(
        ConfigurationError,
        match=r"makes 2 stages; schedule='zbv' runs two stages per rank: give "
        r"2 x pipeline_parallel_size - 1 = 3 cut points",
    ):
        MegatronStrategy(pipeline_parallel_size=2, schedule="zbv", pp_split=["net.blocks.2"])
    with pytest.raises(ConfigurationError, match=r"schedule='fifo' is not one of: gpipe, 1f1b"):
        MegatronStrategy(pipeline_parallel_size=2, schedule="fifo")
    with pytest.raises(ConfigurationError, match=r"num_microbatches=0 must be a positive int"):
        MegatronStrategy(pipeline_parallel_size=2, num_microbatches=0)
    with pytest.raises(ConfigurationError, match=r"pipeline_parallel_size=-1 must be a positive int"):
        MegatronStrategy(pipeline_parallel_size=-1)
    assert MegatronStrategy(pipeline_parallel_size="auto").sizes["pp"] == "auto"  # chosen at setup
    with pytest.raises(ConfigurationError, match=r"pp_split=\['net.blocks.2'\] with pipeline_parallel_size='auto'"):
        MegatronStrategy(pipeline_parallel_size="auto", pp_split=["net.blocks.2"])
    with pytest.raises(ConfigurationError, match=r"pp_split='net.blocks.2' must be None .* list of block names"):
        MegatronStrategy(pipeline_parallel_size=2, pp_split="net.blocks.2")
    with pytest.raises(ConfigurationError, match=r"need pipeline_parallel_size > 1"):
        MegatronStrategy(pp_split=["net.blocks.2"])
    with pytest.raises(
        ConfigurationError,
        match=r"makes 3 stages, but schedule='1f1b' runs one stage per rank: "
        r"give pipeline_parallel_size - 1 = 1 cut point",
    ):
        MegatronStrategy(pipeline_parallel_size=2, pp_split=["net.blocks.1", "net.blocks.2"])
    with pytest.raises(ConfigurationError, match=r"makes 2 stages; schedule='interleaved_1f1b' runs several"):
        MegatronStrategy(pipeline_parallel_size=2, schedule="interleaved_1f1b", pp_split=["net.blocks.1"])


def test_bad_splits_of_the_model():
    with pytest.raises(ConfigurationError, match=r"5 pipeline stages but net.blocks has only 4 block\(s\)"):
        plan_split(LitGPT(), 5)
    with pytest.raises(
        ConfigurationError,
        match=r"pp_split entry 'net.layers.2' is not a block that can begin a "
        r"stage; valid cut points: net.blocks.1, net.blocks.2, net.blocks.3",
    ):
        plan_split(LitGPT(), 2, ["net.layers.2"])
    with pytest.raises(ConfigurationError, match=r"valid cut points"):
        plan_split(LitGPT(), 2, ["net.blocks.0"])  # the first block cannot begin a later stage
    with pytest.raises(ConfigurationError, match=r"distinct blocks in increasing order"):
        plan_split(LitGPT(), 3, ["net.blocks.3", "net.blocks.1"])
    with pytest.raises(ConfigurationError, match=r"Plain has no nn.ModuleList of blocks"):
        plan_split(Plain(), 2)
    lit = LitGPT()
    lit.extra_head = nn.Linear(16, 2)
    with pytest.raises(ConfigurationError, match=r"parameters outside the pipelined model net .*: extra_head.weight"):
        plan_split(lit, 2)
    lit = LitGPT()
    lit.net.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ConfigurationError, match=r"net \(GPT\) has parameters of its own \(scale\)"):
        plan_split(lit, 2)


@pytest.mark.slow
def test_transformers_causal_lm_head_outside_the_base_model(runs):
    _, pp, _ = runs
    for key in ("llama_tied0", "llama_tied1"):  # 1f1b untied, gpipe with tied embeddings
        res = pp[key]
        assert res["loss"] < 1e-5 and res["weights"] < 1e-4, (key, res)
        assert res["embed_on"] == [True, False] and res["head_on"] == [False, True]
        assert res["layers_on"] == [["0", "1"], ["2", "3"]]


def test_causal_lm_split_puts_the_head_on_the_last_stage():
    from transformers import LlamaConfig, LlamaForCausalLM

    lit = TrainingModule()
    lit.net = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    split = plan_split(lit, 2)
    assert (split.prefix, split.blocks, split.heads) == ("net.model", "layers", ["net.lm_head"])
    assert split.stages == [["embed_tokens", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "net.lm_head"]]
    assert split.child("net.lm_head.weight") == "net.lm_head"  # rotary_emb (no parameters): on every stage
    from transformers import GPT2Config, GPT2LMHeadModel

    lit.net = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16))
    with pytest.raises(ConfigurationError, match=r"GPT2LMHeadModel \(model_type='gpt2'\) is not built yet.*llama"):
        plan_split(lit, 2)


class Plain(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


class NoLoss(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = GPT()


def test_pipeline_settings_from_the_launch_config():
    from trainforge.trainer.cli.launch_settings import strategy_kwargs

    kwargs = strategy_kwargs(
        "megatron",
        {
            "megatron": {
                "pipeline_parallel_size": 2,
                "schedule": "interleaved_1f1b",
                "num_microbatches": 4,
                "pp_split": ["net.blocks.1", "net.blocks.2", "net.blocks.3"],
            }
        },
    )
    strategy = MegatronStrategy(**kwargs)
    assert strategy.sizes["pp"] == 2 and strategy.num_microbatches == 4 and len(strategy.pp_split) == 3


def test_pipeline_needs_loss_fn_and_no_extra_accumulation():
    strategy = MegatronStrategy(pipeline_parallel_size=2)
    strategy.dims = ParallelDims.resolve(tp=1, pp=2, dp="auto", world_size=2)  # as setup_environment would
    with pytest.raises(ConfigurationError, match=r"NoLoss must define loss_fn\(self, output, target\)"):
        strategy.setup(NoLoss(), lambda: [])
    strategy.configure(RunSettings(accumulation_steps=2))
    with pytest.raises(
        ConfigurationError,
        match=r"accumulate_grad_batches=2: with pipeline parallelism the "
        r"micro-batches are the accumulation",
    ):
        strategy.setup(LitGPT(), lambda: [])


def test_base_forward_backward_is_the_plain_step():
    """Strategies without a pipeline: forward_backward is the Trainer's inline path (step, then backward)."""
    from trainforge.strategies.single import SingleDeviceStrategy

    strategy, net = SingleDeviceStrategy(), nn.Linear(3, 1)
    assert not strategy.pipelined
    seen = []
    out = strategy.forward_backward(
        net,
        lambda batch, i: net(batch).sum(),
        torch.ones(2, 3),
        0,
        backward=lambda loss: (seen.append(loss), loss.backward()),
    )
    assert seen == [out] and torch.equal(net.weight.grad, torch.full((1, 3), 2.0))


def test_accelerator_forward_backward_without_a_pipeline():
    """The same loop runs without pipelining: loss_fn(model(inputs), target), then backward."""
    from trainforge import Accelerator

    acc, net = Accelerator(strategy="single"), nn.Linear(3, 1)
    ref = nn.Linear(3, 1)
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    net = acc.prepare(net)
    loss = acc.forward_backward(net, (x, y), torch.nn.functional.mse_loss)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    assert torch.allclose(net.weight.grad, ref.weight.grad) and loss.requires_grad
    with pytest.raises(ConfigurationError, match=r"needs loss_fn\(output, target\): pass loss_fn= or define"):
        acc.forward_backward(net, (x, y))
