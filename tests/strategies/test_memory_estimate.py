"""The ZeRO memory arithmetic, the recommendation, and `trainforge estimate-memory`."""

import sys
import textwrap

import pytest
import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.memory_estimate import (
    DEEPSPEED_ROWS,
    SPEED_ORDER,
    bytes_per_param,
    choose_deepspeed,
    count_parameters,
    estimate_memory,
    optimizer_kind,
    recommend,
)
from trainforge.trainer.cli import main as cli

PSI, N = 7_500_000_000, 64  # the ZeRO paper's figure 1: 7.5B parameters on 64 GPUs


def _by_name(rows):
    return {r.name: r for r in rows}


def test_mixed_precision_adam_matches_the_zero_paper():
    rows = _by_name(estimate_memory(PSI, N, "bf16-mixed", "adam"))
    assert bytes_per_param("bf16-mixed") == bytes_per_param("16-mixed") == (2, 2, 12)
    assert rows["DDP"].device == 16 * PSI == 120 * 10**9  # paper: 120 GB
    assert rows["ZeRO-1"].device == 2 * PSI + 2 * PSI + 12 * PSI // N  # paper: 31.4 GB
    assert round(rows["ZeRO-1"].device / 1e9, 1) == 31.4
    assert rows["ZeRO-2"].device == 2 * PSI + 14 * PSI // N  # paper: 16.6 GB
    assert round(rows["ZeRO-2"].device / 1e9, 1) == 16.6
    assert rows["ZeRO-3"].device == 16 * PSI // N  # paper: 1.9 GB
    assert round(rows["ZeRO-3"].device / 1e9, 1) == 1.9
    assert rows["FSDP full"].device == rows["ZeRO-3"].device
    assert rows["FSDP grad-op"].device == rows["ZeRO-2"].device
    assert (rows["ZeRO-1"].params, rows["ZeRO-1"].grads, rows["ZeRO-1"].optimizer) == (2 * PSI, 2 * PSI, 12 * PSI // N)


def test_fp32_and_other_optimizers():
    psi, n = 1000, 4
    rows = _by_name(estimate_memory(psi, n, "32", "adamw"))
    assert bytes_per_param("32") == (4, 4, 8)
    assert rows["DDP"].device == 16 * psi and rows["ZeRO-3"].device == 16 * psi // n
    assert rows["ZeRO-2"].device == 4 * psi + 12 * psi // n
    assert bytes_per_param("32", "sgd") == (4, 4, 4) and bytes_per_param("bf16-mixed", "sgd") == (2, 2, 8)
    assert bytes_per_param("bf16-true", "adam") == (2, 2, 4) and bytes_per_param("32", "none") == (4, 4, 0)
    odd = _by_name(estimate_memory(1001, 4, "32"))  # partitions round up, as DeepSpeed pads them
    assert odd["ZeRO-3"].params == 1001


def test_offload_rows_move_partitions_to_host_memory():
    psi, n = 10**6, 8
    rows = _by_name(estimate_memory(psi, n, "bf16-mixed"))
    z2, z3, z3all = rows["ZeRO-2 + offload opt"], rows["ZeRO-3 + offload opt"], rows["ZeRO-3 + offload opt+params"]
    assert (z2.device, z2.cpu) == (2 * psi, (2 + 12) * psi // n)
    assert (z3.device, z3.cpu) == (2 * psi // n, 14 * psi // n)
    assert (z3all.device, z3all.cpu) == (0, 16 * psi // n)
    assert z2.options == {"stage": 2, "offload_optimizer": True}
    assert z3all.options == {"stage": 3, "offload_optimizer": True, "offload_parameters": True}


def test_count_parameters_on_meta_counts_tied_weights_once():
    with torch.device("meta"):
        emb = nn.Embedding(100, 16)
        head = nn.Linear(16, 100, bias=False)
        head.weight = emb.weight
        model = nn.ModuleDict({"emb": emb, "head": head, "mlp": nn.Linear(16, 16)})
    assert count_parameters(model) == 100 * 16 + 16 * 16 + 16
    assert estimate_memory(model, 1, "32")[0].params == 4 * count_parameters(model)
    assert optimizer_kind(torch.optim.AdamW(nn.Linear(1, 1).parameters())) == "adam"
    assert optimizer_kind(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1, momentum=0.9)) == "sgd"
    assert optimizer_kind(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)) == "none"


def test_recommend_takes_the_fastest_row_that_fits():
    rows = estimate_memory(10**9, 8, "bf16-mixed")  # DDP 16 GB, ZeRO-1 5.5 GB, ZeRO-2 3.75 GB, ZeRO-3 2 GB
    assert [r.name for r in rows][0] == "DDP" and len(rows) == len(SPEED_ORDER)
    assert recommend(rows, 24 * 10**9).name == "DDP"
    assert recommend(rows, 8 * 10**9).name == "ZeRO-1"  # 5.5 GB <= 75% of 8 GB
    # 4 GB: ZeRO-2 (3.75 GB) > 3 GB; ZeRO-2 + offload needs 8 ranks x 1.75 GB of host memory
    assert recommend(rows, 4 * 10**9, cpu_memory=10**12, ranks_per_node=8).name == "ZeRO-2 + offload opt"
    assert recommend(rows, 4 * 10**9, cpu_memory=10**10, ranks_per_node=8).name == "ZeRO-3"
    assert recommend(rows, 4 * 10**9).name == "ZeRO-2 + offload opt"  # host memory unknown: assumed to fit
    assert recommend(rows, 10**8, cpu_memory=10**9, ranks_per_node=8) is None


def test_choose_deepspeed_for_stage_auto():
    row, text = choose_deepspeed(10**9, 8, "bf16-mixed", "adam", 8 * 10**9, 10**12, 8)
    assert row.name == "ZeRO-1" and row.options == {"stage": 1}
    assert "1,000,000,000 parameters" in text and "* ZeRO-1" in text and "-> ZeRO-1" in text
    row, text = choose_deepspeed(10**9, 8, "bf16-mixed", "adam", 10**9, 10**12, 8)
    assert row.options == {"stage": 3, "offload_optimizer": True}  # 2 bytes/8 ranks on device, rest on host
    row, text = choose_deepspeed(10**9, 2, "32", "adam", 10**9, None)  # training on the CPU: no offload rows
    assert row.name == "ZeRO-3" and "nothing fits" in text and "offload opt" not in text
    assert row.optimizer == 12 * 10**9 // 2  # DeepSpeed's fp32 master partition counted on top of Adam's 8 bytes
    assert bytes_per_param("32", "adam", master_weights=True) == (4, 4, 12)
    assert set(DEEPSPEED_ROWS) <= set(SPEED_ORDER)


@pytest.mark.parametrize(
    "args, match",
    [
        ((100, 2, "fp17"), "precision='fp17'"),
        ((100, 0, "32"), "world_size=0"),
        ((-1, 2, "32"), "parameter count"),
    ],
)
def test_bad_inputs(args, match):
    with pytest.raises(ConfigurationError, match=match):
        estimate_memory(*args)
    with pytest.raises(ConfigurationError, match="optimizer='lion'.*adam"):
        bytes_per_param("32", "lion")


# ---- the CLI ---------------------------------------------------------------------------------------
def test_cli_on_gpt2_prints_a_table_per_process_count_and_a_recommendation(capsys):
    pytest.importorskip("transformers")
    assert cli.main(["estimate-memory", "gpt2", "--num-processes", "1", "8", "--device-memory", "2GB"]) == 0
    out = capsys.readouterr().out
    assert "gpt2: 124,439,808 parameters" in out  # GPT2LMHeadModel with the tied head, built on meta
    assert "== 1 process ==" in out and "== 8 processes ==" in out
    # 8 processes, 2 GB: DDP (16 B/param = 1.99 GB) does not leave 25% free, ZeRO-1 (4 + 12/8 B) does
    assert "recommendation: ZeRO-1: strategy='deepspeed', i.e. DeepSpeedStrategy(stage=1)" in out
    assert "recommendation: ZeRO-2 + offload opt" in out  # 1 process: only offloading fits 1.5 GB


def test_cli_on_a_module_factory_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent("""
        import torch
        def build():
            assert torch.empty(1).device.type == "meta"  # built without allocating
            return torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        cli.main(
            [
                "estimate-memory",
                "my_models:build",
                "--num-processes",
                "2",
                "--precision",
                "fp32",
                "--device-memory",
                "1GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "my_models:build: 1,011,010 parameters; precision 32" in out
    assert "recommendation: DDP: strategy='ddp'" in out
    sys.modules.pop("my_models", None)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["no_such_module:build"], ["no_such_module", "package.module:factory"]),
        (["not-a-model-type"], ["not-a-model-type", "gpt2", "model type"]),
        (["gpt2", "--precision", "fp17"], ["fp17", "bf16-mixed"]),
        (["gpt2", "--device-memory", "lots"], ["--device-memory='lots'", "5GB"]),
    ],
)
def test_cli_bad_input_exits_2_with_the_reason(argv, words, capsys):
    if "gpt2" in argv or "not-a" in argv[0]:
        pytest.importorskip("transformers")
    assert cli.main(["estimate-memory", *argv]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err
