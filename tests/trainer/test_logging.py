"""self.log: step values, weighted epoch means, precision modes on CPU."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainer import Trainer


class MeanLogger(Regressor):
    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.log("val/xsum", x[:, 0].mean())  # per-batch mean; the epoch value must weight by batch size


def test_epoch_value_is_weighted_mean_over_uneven_batches(tmp_path):
    data = regression_data(n=20)
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_checkpointing=False)
    trainer.fit(MeanLogger(make_net()), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    expected = data.tensors[0][:, 0].double().mean()  # batches of 8, 8 and 4
    assert float(trainer.callback_metrics["val/xsum"]) == pytest.approx(float(expected), rel=1e-6)


def test_on_step_and_on_epoch_gives_both_names(tmp_path):
    class Both(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

    trainer = Trainer(max_epochs=1, log_every_n_steps=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_checkpointing=False)
    trainer.fit(Both(make_net()), DataLoader(regression_data(), batch_size=8))
    assert {"loss_step", "loss_epoch"} <= set(trainer.callback_metrics)


class DtypeProbe(Regressor):
    def training_step(self, batch, batch_idx):
        self.output_dtype = self.net(batch[0]).dtype
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision,param_dtype,compute_dtype", [("bf16-mixed", torch.float32, torch.bfloat16),
                                                                 ("bf16-true", torch.bfloat16, torch.bfloat16),
                                                                 ("32", torch.float32, torch.float32)])
def test_precision_modes_train_on_cpu(tmp_path, precision, param_dtype, compute_dtype):
    module = DtypeProbe(make_net())
    trainer = Trainer(max_epochs=2, precision=precision, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_checkpointing=False)
    trainer.fit(module, DataLoader(regression_data(), batch_size=8))
    assert next(module.parameters()).dtype == param_dtype
    assert module.output_dtype == compute_dtype
    first, last = float(module.losses[0]), float(module.losses[-1])
    assert last < first, f"{precision}: loss did not go down ({first} -> {last})"
