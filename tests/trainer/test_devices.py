"""Where a run trains: the ``accelerator`` choice (Lightning's names), and the order in which the
Trainer builds optimizers (after the strategy placed, converted and wrapped the module, as
Lightning does), so ``configure_optimizers`` sees the final device, dtype and parameters."""

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Accelerator, ConfigurationError, Trainer
from trainforge.strategies import SingleDeviceStrategy
from trainforge.strategies.devices import default_device, normalize_accelerator


class Recording(Regressor):
    def configure_optimizers(self):
        param = next(self.parameters())
        self.seen = (str(self.device), param.dtype, [id(p) for p in self.parameters()])
        return super().configure_optimizers()


def test_configure_optimizers_sees_the_converted_module():
    """bf16-true converts the weights during setup; the optimizer is built on them afterwards."""
    module = Recording(make_net())
    trainer = Trainer(
        accelerator="cpu", precision="bf16-true", max_steps=2, enable_progress_bar=False, enable_checkpointing=False
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=16))
    device, dtype, ids = module.seen
    assert device == "cpu" and dtype == torch.bfloat16
    opt_params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    assert [id(p) for p in opt_params] == ids == [id(p) for p in module.parameters()]
    assert all(p.dtype == torch.bfloat16 for p in opt_params)


def test_accelerator_cpu_pins_the_cpu_and_is_validated():
    assert Accelerator(accelerator="cpu").device == torch.device("cpu")
    assert default_device("cpu", local_rank=3) == torch.device("cpu")
    assert normalize_accelerator("GPU") == "cuda" and normalize_accelerator(None) == "auto"
    with pytest.raises(ConfigurationError, match=r"accelerator='tpu3' is not one of: auto, cpu, gpu, cuda, mps"):
        Trainer(accelerator="tpu3", max_steps=1)


def test_accelerator_gpu_without_a_gpu_says_so():
    # the test process never sees CUDA (tests/conftest.py hides it)
    with pytest.raises(ConfigurationError, match=r"accelerator='gpu' but this process sees no CUDA device.*'cpu'"):
        Accelerator(accelerator="gpu")


def test_accelerator_conflicting_with_an_explicit_strategy_device():
    with pytest.raises(ConfigurationError, match=r"accelerator='cuda' conflicts with the strategy's device=cpu"):
        Accelerator(strategy=SingleDeviceStrategy("cpu"), accelerator="cuda")
    # a device-less strategy object takes the accelerator's choice
    assert Accelerator(strategy=SingleDeviceStrategy(), accelerator="cpu").device == torch.device("cpu")
