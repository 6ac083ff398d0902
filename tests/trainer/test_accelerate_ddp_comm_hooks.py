"""Accelerate's DDP communication hooks (``DDPCommunicationHookType``; issue 38 item 5):
``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)`` registers torch's hook
as Accelerate 1.15's ``register_comm_hook`` does, checked on two gloo processes against what each hook computes
from the ranks' own gradients (tests/scripts/accelerate_ddp_comm_hooks.py): no hook, the exact fp32 mean; fp16, the
mean of the fp16-cast gradients summed in fp16, bit for bit; PowerSGD (``start_powerSGD_iter=2``) the exact mean
for two steps, then a rank-1 weight gradient; PowerSGD wrapped in fp16, the fp16 mean for two steps, then neither.
bf16 needs NCCL (or XCCL) in torch: refused by name on this CPU build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import forklaunch
from trainforge import ConfigurationError
from trainforge.strategies import DDPStrategy
from trainforge.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accelerate_ddp_comm_hooks.py"


def flags(step, *names):
    return tuple(step[n] for n in names)


def test_hooks_change_the_gradients_as_torchs_hooks_do_on_two_processes(tmp_path):
    forklaunch.launch(SCRIPT, str(tmp_path), timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    record = ranks[0]
    assert record["use_distributed"] is True  # Accelerator.use_distributed, Accelerate's name
    for step in record["none"]:
        assert flags(step, "mean", "fp16", "weight_rank", "same_on_ranks") == (True, False, 16, True)
    for step in record["fp16"]:  # the fp16 rounding, bit for bit, and not the fp32 mean
        assert flags(step, "mean", "fp16", "same_on_ranks") == (False, True, True)
    first, second, third = record["power_sgd"]
    assert flags(first, "mean", "weight_rank") == flags(second, "mean", "weight_rank") == (True, 16)
    assert flags(third, "mean", "weight_rank", "bias_mean", "same_on_ranks") == (False, 1, True, True)
    first, second, third = record["power_sgd+fp16"]
    assert flags(first, "fp16", "mean") == flags(second, "fp16", "mean") == (True, False)
    assert flags(third, "fp16", "mean", "same_on_ranks") == (False, False, True)
    assert record["bf16"].startswith("comm_hook='bf16': torch compresses gradients to bf16 only with CUDA and NCCL")


def test_the_enum_is_accelerates_and_its_values_are_strings():
    assert [h.value for h in DDPCommunicationHookType] == ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]
    assert DDPCommunicationHookType.FP16 == "fp16"
    kwargs = DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType.POWER_SGD,
        comm_wrapper=DDPCommunicationHookType.FP16,
        comm_state_option={"matrix_approximation_rank": 2},
    )
    assert kwargs.strategy_kwargs() == {
        "comm_hook": "power_sgd",
        "comm_wrapper": "fp16",
        "comm_hook_state": {"matrix_approximation_rank": 2},
    }
    assert DistributedDataParallelKwargs(comm_hook="no").strategy_kwargs() == {}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"comm_hook": "fp8"}, r"comm_hook='fp8'\): choose one of no, fp16, bf16, power_sgd, batched_power_sgd"),
        ({"comm_wrapper": "power_sgd"}, r"comm_wrapper='power_sgd'\): choose one of no, fp16, bf16"),
        ({"comm_wrapper": "fp16"}, r"comm_wrapper='fp16' compresses what a communication hook sends, and comm_hook"),
        (
            {"comm_hook": "fp16", "comm_state_option": {"matrix_approximation_rank": 2}},
            r"comm_state_option=\{'matrix_approximation_rank': 2\} with comm_hook='fp16': the fp16 hook takes no",
        ),
        (
            {"comm_hook": "power_sgd", "comm_state_option": {"rank": 2}},
            r"\['rank'\] not PowerSGDState options; it takes matrix_approximation_rank, start_powerSGD_iter",
        ),
        ({"comm_hook": "power_sgd", "comm_state_option": [1]}, r"comm_state_option=\[1\]\) must be a dict"),
    ],
)
def test_bad_hook_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        DistributedDataParallelKwargs(**kwargs)


def test_batched_power_sgd_is_refused_where_torchs_hook_cannot_run():
    """torch 2.13's batched_powerSGD_hook calls ``_orthogonalize`` on a 2-D matrix, which asserts it is 3-D: it
    fails at the first compressed step (under Accelerate too). Refused at construction, naming power_sgd."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(__import__("torch").ones(2, 1))
    except AssertionError:
        with pytest.raises(ConfigurationError, match=r"batched_power_sgd.*Use comm_hook='power_sgd'"):
            DDPStrategy(comm_hook="batched_power_sgd")
    else:
        assert DDPStrategy(comm_hook="batched_power_sgd").comm_hook == "batched_power_sgd"
