"""The device-agnostic path: single-device and DDP strategies take the device type and the
process-group backend from ``torch.accelerator`` (no cuda/nccl hard-coded), so a backend that
registers with torch as an accelerator (torch-tpu's PrivateUse1 "tpu") needs no strategy of its own."""

import json
import sys

import pytest
import torch
from torch.utils import backend_registration

from tests.helpers import procs
from trainforge import ConfigurationError, Trainer
from trainforge.strategies import SingleDeviceStrategy
from trainforge.strategies.devices import (
    accelerator_choices,
    current_accelerator,
    default_device,
    normalize_accelerator,
)
from trainforge.strategies.environment import default_backend, find_free_port


def test_cpu_machine_reports_no_accelerator_and_trains_on_cpu_with_gloo():
    assert current_accelerator() is None and not torch.accelerator.is_available()
    assert default_device("auto") == torch.device("cpu")
    assert default_backend("cpu") == "gloo" and default_backend("cuda:0") == "nccl"
    strategy = SingleDeviceStrategy()
    strategy.setup_environment()
    assert strategy.root_device == torch.device("cpu")
    assert accelerator_choices() == ("auto", "cpu", "gpu", "cuda", "mps")


def test_unknown_accelerator_names_the_choices_and_the_fix():
    with pytest.raises(
        ConfigurationError,
        match=r"accelerator='tpu' is not one of: auto, cpu, gpu, cuda, mps.*"
        r"torch.accelerator.*strategy='xla'",
    ):
        normalize_accelerator("tpu")  # no "tpu" backend registered in this process
    with pytest.raises(ConfigurationError, match=r"accelerator='xpu2'"):
        Trainer(accelerator="xpu2", max_steps=1)


def test_a_device_type_without_registered_backend_uses_gloo():
    assert default_backend("mps") == "gloo" and default_backend("meta") == "gloo"


@pytest.mark.skipif(
    not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"),
    reason="this torch cannot register a python PrivateUse1 backend",
)
def test_registered_privateuse1_accelerator_is_picked_without_any_trainforge_code():
    """A real PrivateUse1 backend named "tpu" (torch's python-backend registration) with a "tpu"
    process-group backend: 'auto' picks tpu:<local_rank>, DDP starts its process group with the
    "tpu" backend, accelerator='cpu' still pins the CPU and gloo."""
    port = find_free_port()
    out = procs.run(
        [sys.executable, procs.REPO / "tests" / "scripts" / "privateuse1_backend.py", str(port)], timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["current"] == "tpu" and result["normalized"] == "tpu"
    assert result["auto_device"] == "tpu:0" and result["backend"] == "tpu"
    assert result["single_device"] == "tpu:0"
    assert result["ddp_device"] == "tpu:0" and result["ddp_backend"] == "tpu"
    assert result["cpu_device"] == "cpu" and result["cpu_backend"] == "gloo"
    assert "local rank 1 has no TPU device: 1 visible" in result["rank_error"]
