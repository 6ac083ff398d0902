"""Bad input: a clear error that names the value, the choices and the fix, before any work."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Accelerator, CheckpointError, ConfigurationError, Trainer, TrainforgeError, TrainingModule


def fit(tmp_path, module=None, loader=None, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    trainer = Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False, **kwargs)
    trainer.fit(
        module if module is not None else Regressor(make_net()),
        loader if loader is not None else DataLoader(regression_data(), batch_size=8),
    )
    return trainer


def test_unknown_strategy_lists_valid_ones(tmp_path):
    with pytest.raises(ConfigurationError, match=r"strategy='ddpp' is not one of: auto, single, ddp, fsdp, deepspeed"):
        Trainer(strategy="ddpp", max_epochs=1)


def test_unknown_precision_lists_valid_ones():
    with pytest.raises(
        ConfigurationError, match=r"precision='fp17' is not one of: 32, 16-mixed, bf16-mixed, bf16-true, fp8"
    ):
        Trainer(precision="fp17", max_epochs=1)


def test_fp16_on_cpu_suggests_bf16():
    with pytest.raises(ConfigurationError, match="bf16-mixed"):
        Accelerator(precision="16-mixed")


@pytest.mark.parametrize(
    "alias,name", [("no", "32"), ("fp32", "32"), ("bf16", "bf16-mixed"), ("bf16-true", "bf16-true")]
)
def test_precision_aliases(alias, name):
    assert Accelerator(precision=alias).precision.name == name


def test_module_without_training_step(tmp_path):
    class NoStep(TrainingModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ConfigurationError, match="does not implement training_step"):
        fit(tmp_path, module=NoStep())


@pytest.mark.parametrize("returned", [None, "adam", [torch.nn.Linear(1, 1)], {"lr_scheduler": None}])
def test_unusable_configure_optimizers(tmp_path, returned):
    class Bad(Regressor):
        def configure_optimizers(self):
            return returned

    with pytest.raises(ConfigurationError, match="configure_optimizers returned"):
        fit(tmp_path, module=Bad(make_net()))


def test_neither_max_epochs_nor_max_steps():
    with pytest.raises(ConfigurationError, match="neither max_epochs nor max_steps"):
        Trainer()


def test_empty_dataloader(tmp_path):
    empty = DataLoader(TensorDataset(torch.zeros(0, 8), torch.zeros(0, 1)), batch_size=8)
    with pytest.raises(ConfigurationError, match="train_dataloaders is empty"):
        fit(tmp_path, loader=empty)
    trainer = Trainer(
        default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False, max_epochs=1
    )
    good = DataLoader(regression_data(), batch_size=8)
    with pytest.raises(ConfigurationError, match=r"val_dataloaders\[1\] is empty \(len == 0, dataset of 0 samples"):
        trainer.fit(Regressor(make_net()), good, [good, empty])  # would validate on nothing
    assert trainer.global_step == 0  # refused before any training


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_accumulate_grad_batches_below_one(value):
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches"):
        Trainer(max_epochs=1, accumulate_grad_batches=value)


def test_bad_clip_algorithm():
    with pytest.raises(ConfigurationError, match=r"gradient_clip_algorithm='l3' is not one of: norm, value"):
        Trainer(max_epochs=1, gradient_clip_algorithm="l3")


class NaNAt(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if batch_idx == 2 else loss


def test_nonfinite_loss_raises_with_step(tmp_path):
    with pytest.raises(TrainforgeError, match=r"non-finite loss .* batch 2, global step 2"):
        fit(tmp_path, module=NaNAt(make_net()))


def test_nonfinite_loss_skipped_and_counted(tmp_path):
    module = NaNAt(make_net())
    trainer = fit(tmp_path, module=module, nonfinite_loss="skip")
    assert trainer.progress.skipped_nonfinite == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_ckpt_path_last_without_checkpoints_says_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match=r"Trainer\(resume='auto'\)"):
        trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False)
        trainer.fit(Regressor(make_net()), DataLoader(regression_data(), batch_size=8), ckpt_path="last")


def test_run_settings_are_handed_over_whole_and_by_known_names():
    from trainforge import Accelerator
    from trainforge.strategies.base import RunSettings

    acc = Accelerator()
    with pytest.raises(TypeError, match="configure\\(\\) takes a RunSettings, got dict"):
        acc.strategy.configure({"accumulation_steps": 2})
    with pytest.raises(ConfigurationError, match=r"update_run_settings\(accumulation=\.\.\.\).*accumulation_steps"):
        acc.update_run_settings(accumulation=2)
    acc.update_run_settings(micro_batch_size=8)
    assert acc.strategy.settings == RunSettings(precision=acc.precision, micro_batch_size=8)
    with pytest.raises(Exception, match="frozen|cannot assign"):
        acc.strategy.settings.micro_batch_size = 4  # one object, never edited field by field
