"""DeepSpeedStrategy: ZeRO 1/2/3 against DDP through Trainer.fit on 2 real CPU processes (gloo).

The slow tests share two launches (2 processes: everything; 1 process: the ZeRO-3 memory baseline)
because DeepSpeed's import dominates the time; see tests/scripts/ds_parity.py.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import forklaunch, procs
from trainforge.strategies import strategy_class
from trainforge.strategies.checkpoint.io import load_tensors
from trainforge.strategies.deepspeed import DeepSpeedStrategy
from trainforge.strategies.errors import ConfigurationError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ds_parity.py"
TIMEOUT = 420


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    env = procs.test_env(DS_ACCELERATOR="cpu")
    # ranks forked as torchrun starts them (tests/helpers/forklaunch.py): 2 processes, everything; then
    # 1 process, the ZeRO-3 memory baseline
    forklaunch.launch(SCRIPT, out, nproc=2, env=env, timeout=TIMEOUT)
    forklaunch.launch(SCRIPT, out, "--memory-only", nproc=1, env=env, timeout=TIMEOUT)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, ranks, json.loads((out / "memory_world1.json").read_text())


def _max_rel(a, b):
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_loss_curve_and_lr_match_ddp(results, stage):
    _, ranks, _ = results
    for rank in ranks:
        for config, micro_batches in (("A", 20), ("B", 40)):  # B: accumulation 2, clip 0.05, StepLR per step
            ddp, zero = rank["runs"][f"ddp-{config}"], rank["runs"][f"zero{stage}-{config}"]
            assert len(zero["losses"]) == micro_batches
            assert _max_rel(ddp["losses"], zero["losses"]) <= 1e-5, (config, ddp["losses"], zero["losses"])
            assert zero["lrs"] == ddp["lrs"]  # the scheduler is stepped once per optimizer step, not twice
        assert len(set(rank["runs"]["ddp-B"]["lrs"])) == 7  # the LR really changed (halved every 3 steps)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_consolidated_weights_equal_ddp(results, stage):
    out, ranks, _ = results
    for config in ("A", "B"):
        ddp = load_tensors(out / "weights" / f"ddp-{config}")
        zero = load_tensors(out / "weights" / f"zero{stage}-{config}")
        assert set(zero) == set(ddp) and all(zero[k].dtype == torch.float32 for k in zero)
        for key in ddp:
            torch.testing.assert_close(zero[key], ddp[key], rtol=1e-5, atol=1e-6)
    for rank in ranks:  # DDP's weights loaded into the partitioned engine read back unchanged
        assert rank["runs"][f"zero{stage}-A"]["reload_max_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_save_load_continue_equals_uninterrupted(results, stage):
    out, ranks, _ = results
    for rank in ranks:
        resumed, full = rank["runs"][f"zero{stage}-B-resumed"], rank["runs"][f"zero{stage}-B"]
        assert resumed["losses"] == full["losses"][14:]  # saved after 7 steps x 2 micro-batches, mid-epoch
        assert resumed["lrs"] == full["lrs"][14:]
        files = resumed["files"]
        assert "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt" in files
        assert "trainer_state.pt" in files and "optimizers.pt" not in files and "model.safetensors" not in files
    a = load_tensors(out / "weights" / f"zero{stage}-B-resumed")
    b = load_tensors(out / "weights" / f"zero{stage}-B")
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
@pytest.mark.parametrize("name, devices", [("zero2-offload", ["cpu", None]), ("zero3-offload-all", ["cpu", "cpu"])])
def test_cpu_offload_matches_ddp(results, name, devices):
    _, ranks, _ = results
    for rank in ranks:
        run, ddp = rank["runs"][f"{name}-B"], rank["runs"]["ddp-B"]
        assert run["offload"] == devices  # what the generated config asked DeepSpeed for
        assert _max_rel(ddp["losses"], run["losses"]) <= 1e-5 and run["lrs"] == ddp["lrs"]


@pytest.mark.slow
def test_activation_checkpointing_recomputes_without_changing_the_losses(results):
    _, ranks, _ = results
    for rank in ranks:
        run = rank["runs"]["zero3-A-checkpointed"]
        assert run["wrapped"] == 2  # both Linear layers of the net
        assert _max_rel(rank["runs"]["ddp-A"]["losses"], run["losses"]) <= 1e-5


@pytest.mark.slow
def test_zero3_state_per_rank_halves_with_two_processes(results):
    _, ranks, one = results
    for rank in ranks:
        assert rank["params"] == one["params"] == 8 * 512 + 512 + 512 + 1
        assert rank["zero3_bytes"] <= 0.55 * one["zero3_bytes"], (rank["zero3_bytes"], one["zero3_bytes"])
    assert one["zero3_bytes"] >= 16 * one["params"]  # fp32 params + DeepSpeed's fp32 master + Adam's two states


@pytest.mark.slow
def test_stage_auto_chooses_from_the_estimate_and_reports_a_table(results):
    _, ranks, one = results
    for record in (*ranks, one):
        assert record["auto_stage"] == 1  # a 161-parameter model fits anywhere: the fastest stage wins
        assert "* ZeRO-1" in record["auto_report"] and "ZeRO-3" in record["auto_report"]
        assert "offload opt" not in record["auto_report"]  # training on the CPU: nothing to offload to


@pytest.mark.slow
def test_deepspeed_loader_refuses_pickled_code_and_tampered_shards(results):
    _, ranks, _ = results
    for rank in ranks:
        safety = rank["safety"]
        assert "refused to load" in safety["refused"] and not safety["executed"]
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in safety["tamper_error"]
        assert "manifest" in safety["tamper_error"]


# ---- construction (no deepspeed import needed) ----------------------------------------------------
def test_registry_and_launch_config_spellings():
    assert strategy_class("deepspeed") is DeepSpeedStrategy
    s = DeepSpeedStrategy(zero_stage=3, offload_optimizer_device="cpu", offload_param_device="nvme")
    assert (s.stage, s.zero.offload_optimizer_device, s.zero.offload_param_device) == (3, "cpu", "nvme")
    assert (
        DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_device="nvme").zero.offload_optimizer_device
        == "nvme"
    )
    assert DeepSpeedStrategy(offload_optimizer_device="none").zero.offload_optimizer_device is None


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"stage": 5}, ["stage=5", "0, 1, 2, 3, auto"]),
        ({"offload_device": "disk"}, ["offload_device='disk'", "cpu, nvme"]),
        ({"offload_parameters": True}, ["offload_parameters needs stage=3", "stage=2"]),
        ({"offload_param_device": "gpu", "stage": 3}, ["offload_param_device='gpu'", "none, cpu, nvme"]),
        ({"config": "/no/such/ds.json"}, ["/no/such/ds.json", "no such DeepSpeed config file"]),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, words):
    with pytest.raises(ConfigurationError) as e:
        DeepSpeedStrategy(**kwargs)
    for word in words:
        assert word in str(e.value)


def test_clip_gradients_only_checks_the_configured_norm():
    s = DeepSpeedStrategy()
    s.config = {"gradient_clipping": 1.0}
    assert s.clip_gradients([], max_norm=1.0) is None
    with pytest.raises(ConfigurationError, match=r"max_norm=0\.5.*gradient_clipping=1\.0"):
        s.clip_gradients([], max_norm=0.5)
    with pytest.raises(ConfigurationError, match="global norm only"):
        s.clip_gradients([], clip_value=0.1)
