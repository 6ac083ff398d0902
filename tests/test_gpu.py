"""GPU paths, on one CUDA GPU (`pytest -m gpu`; skipped without one). Each check trains for real in a
child process that sees the GPU (tests/scripts/gpu_checks.py), since the test process itself keeps
CUDA hidden for the CPU tests (tests/conftest.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import procs

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "scripts" / "gpu_checks.py"


def gpu_check(tmp_path: Path, check: str, launch: bool = False, timeout: float = 300) -> dict:
    out = tmp_path / f"{check}.json"
    args = [str(CHECKS), check, "--out", str(out)]
    cmd = procs.trainforge_launch(*args, nproc=1) if launch else [sys.executable, *args]
    procs.run(cmd, timeout=timeout, env=procs.gpu_env(DS_ACCELERATOR="cuda"))
    return json.loads(out.read_text())


def needs(module: str) -> None:
    probe = procs.run([sys.executable, "-c", f"import {module}"], timeout=120, env=procs.gpu_env(), check=False)
    if probe.returncode != 0:
        pytest.skip(f"{module} is not installed here")


def assert_trained(res: dict, precision: str) -> None:
    assert res["device"].startswith("cuda"), res
    assert res["precision"] == precision
    assert res["steps"] == 40 or res["steps"] == 60
    assert res["last_loss"] < 0.7 * res["first_loss"], res


def test_optimizers_are_built_on_the_gpu_so_fused_adamw_is_chosen(tmp_path):
    res = gpu_check(tmp_path, "bf16-true")
    assert res["configure_optimizers_saw"]["device"].startswith("cuda"), res
    assert res["configure_optimizers_saw"]["dtype"] == "torch.bfloat16"  # after the bf16-true conversion
    assert res["fused"] is True
    assert res["param_dtype"] == "torch.bfloat16"
    assert_trained(res, "bf16-true")


def test_fp16_mixed_scaler_skips_the_inf_step_and_counts_it(tmp_path):
    res = gpu_check(tmp_path, "fp16")
    assert res["skipped_steps"] == 1, res
    assert res["skipped_step_left_weights"] is True
    assert res["weights_finite"] is True
    assert_trained(res, "16-mixed")


def test_fp8_through_torchao_filters_trains_and_round_trips(tmp_path):
    needs("torchao")
    res = gpu_check(tmp_path, "fp8")
    assert res["float8"] == ["body.0", "body.2"], res  # 64->128 and 128->128
    assert "lm_head" in res["plain_linear"] and "out" in res["plain_linear"]  # head and a 16->1 layer stay
    assert res["roundtrip_equal"] is True
    assert_trained(res, "fp8")


def test_compile_on_cuda_trains(tmp_path):
    assert_trained(gpu_check(tmp_path, "compile"), "bf16-mixed")


def test_memory_monitor_reports_cuda_and_snapshots_on_oom(tmp_path):
    res = gpu_check(tmp_path, "memory")
    assert res["error"] == "OutOfMemoryError"
    cuda = {k: v for k, v in res["metrics"].items() if "cuda_allocated" in k}
    assert cuda and all(v > 0 for v in cuda.values()), res["metrics"]
    assert any(p.endswith("oom_step12.pickle") for p in res["snapshots"]), res
    assert all(size > 0 for size in res["snapshot_sizes"]) and len(res["snapshot_sizes"]) == 2


def test_ddp_over_nccl_through_trainforge_launch_with_bf16_comm_hook(tmp_path):
    res = gpu_check(tmp_path, "ddp-nccl", launch=True)
    assert res["backend"] == "nccl" and res["world_size"] == 1
    assert_trained(res, "bf16-mixed")


def test_fsdp2_with_bf16_mixed_precision(tmp_path):
    res = gpu_check(tmp_path, "fsdp-bf16", launch=True)
    assert res["backend"] == "nccl"
    assert res["fsdp_param_dtype"] == "torch.bfloat16"
    assert res["configure_optimizers_saw"]["param_type"] == "DTensor"  # built on the sharded parameters
    assert_trained(res, "bf16-mixed")


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_in_bf16(tmp_path, stage):
    needs("deepspeed")
    res = gpu_check(tmp_path, f"deepspeed-{stage}", launch=True, timeout=420)
    assert res["backend"] == "nccl"
    assert res["configure_optimizers_saw"]["device"].startswith("cuda")  # placed before DeepSpeed wraps it
    assert_trained(res, "bf16-mixed")


def test_async_checkpoints_on_cuda_stage_in_pinned_buffers_and_resume(tmp_path):
    res = gpu_check(tmp_path, "async-ckpt")
    assert res["async_used"] and res["pinned"], res  # the CUDA default: asynchronous, pinned staging
    kept = [k for k in res["kept"] if k != "latest"]  # keep_last_k=2: pruned only after each commit
    assert len(kept) == 2 and kept[-1].endswith("step=40"), res
    assert res["resumed_equal"], res
    assert_trained(res, "bf16-mixed")


def test_exact_resume_after_sigkill_on_cuda_is_bit_identical(tmp_path):
    """The resume tests' run (dropout, shuffle) in bf16-mixed on CUDA: killed right after a checkpoint,
    resumed, same final weights bit for bit as the run that never stopped."""
    script = ROOT / "tests" / "scripts" / "resume_run.py"

    def run(name, *args, killed=False):
        cmd = [
            sys.executable,
            str(script),
            "--root",
            str(tmp_path / name),
            "--record",
            str(tmp_path / f"{name}.rec"),
            "--precision",
            "bf16-mixed",
            "--workers",
            "0",
            *args,
        ]
        proc = procs.run(cmd, timeout=300, env=procs.gpu_env(), check=not killed)
        assert not killed or proc.returncode != 0
        return proc.stdout

    assert "cuda" in run("full", "--print-device")
    run("cut", "--ckpt-every", "5", "--kill-at", "5", killed=True)
    run("cut", "--resume")
    a, b = load_file(tmp_path / "full" / "final.safetensors"), load_file(tmp_path / "cut" / "final.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"final weights differ at {key}"


def test_fp8_all_gather_under_fsdp2_equals_gathering_fp32(tmp_path):
    """tests/scripts/fp8_fsdp.py on the GPU (one rank: the all-gather still goes through torchao's hook)."""
    needs("torchao")
    script = ROOT / "tests" / "scripts" / "fp8_fsdp.py"
    procs.run(procs.trainforge_launch(script, tmp_path, nproc=1), timeout=300, env=procs.gpu_env())
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r["fp8_gather"]["shard"] == "WeightWithDynamicFloat8CastTensor"
    assert r["fp8_gather_fp32_params"]["losses"] == r["fp32_gather"]["losses"]
    assert r["fp8_gather"]["gathered_bytes"] < 0.7 * r["param_gather"]["gathered_bytes"]
    assert not any(v["cpu_warning"] for v in r.values())
