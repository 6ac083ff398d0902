"""self.log: step values, weighted epoch means, precision modes on CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer


class MeanLogger(Regressor):
    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.log("val/xsum", x[:, 0].mean())  # per-batch mean; the epoch value must weight by batch size


def test_epoch_value_is_weighted_mean_over_uneven_batches(tmp_path):
    data = regression_data(n=20)
    trainer = Trainer(
        max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False
    )
    trainer.fit(MeanLogger(make_net()), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    expected = data.tensors[0][:, 0].double().mean()  # batches of 8, 8 and 4
    assert float(trainer.callback_metrics["val/xsum"]) == pytest.approx(float(expected), rel=1e-6)


def test_logging_a_tensor_of_several_values_names_the_lightning_2_way(tmp_path):
    from trainforge import ConfigurationError

    class Several(Regressor):
        def validation_step(self, batch, batch_idx):
            self.log("val/x", batch[0][0])  # one row: 8 values

    trainer = Trainer(max_steps=1, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    with pytest.raises(
        ConfigurationError,
        match=r"self.log\('val/x', ...\) got a tensor of shape \(8,\); self.log "
        r"takes one number, as in Lightning 2.x: .*self.log_dict\(\{f'val/x/\{i\}'",
    ):
        trainer.fit(Several(make_net()), DataLoader(regression_data(8), batch_size=4), DataLoader(regression_data(8)))


def test_on_step_and_on_epoch_gives_both_names(tmp_path):
    class Both(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

    trainer = Trainer(
        max_epochs=1,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(Both(make_net()), DataLoader(regression_data(), batch_size=8))
    assert {"loss_step", "loss_epoch"} <= set(trainer.callback_metrics)


class DtypeProbe(Regressor):
    def training_step(self, batch, batch_idx):
        self.output_dtype = self.net(batch[0]).dtype
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "precision,param_dtype,compute_dtype",
    [
        ("bf16-mixed", torch.float32, torch.bfloat16),
        ("bf16-true", torch.bfloat16, torch.bfloat16),
        ("32", torch.float32, torch.float32),
    ],
)
def test_precision_modes_train_on_cpu(tmp_path, precision, param_dtype, compute_dtype):
    module = DtypeProbe(make_net())
    trainer = Trainer(
        max_epochs=2,
        precision=precision,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=8))
    assert next(module.parameters()).dtype == param_dtype
    assert module.output_dtype == compute_dtype
    first, last = float(module.losses[0]), float(module.losses[-1])
    assert last < first, f"{precision}: loss did not go down ({first} -> {last})"


# ---- Lightning's logging rules (trainer/loop/metric_logging.py) ----------------------------------------
class Probe(Regressor):
    """Records what a callback would see in callback_metrics after each step; logs with the options."""

    def __init__(self):
        super().__init__(make_net())
        self.seen = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("both", float(batch_idx), on_step=True, on_epoch=True)
        self.log("biggest", float(batch_idx), on_step=False, on_epoch=True, reduce_fx="max")
        self.log("total", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("hidden", 7.0, logger=False)
        self.log("bar", 3.0, prog_bar=True, rank_zero_only=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        cm = self.trainer.callback_metrics
        self.seen.append((float(cm["train/loss"]), float(cm["both"])))

    def on_train_epoch_end(self):
        self.log("epoch_end_value", 42.0)


def test_callback_metrics_are_current_after_every_step_and_lightning_log_options(tmp_path):
    """Lightning: callback_metrics is current after every step whatever log_every_n_steps is (and
    keeps tensors); with on_step and on_epoch the plain name is there too; reduce_fx, logger=False,
    rank_zero_only; values logged in on_train_epoch_end are logged for that epoch; logged_metrics
    and progress_bar_metrics exist."""
    module = Probe()
    trainer = Trainer(
        max_epochs=1,
        log_every_n_steps=3,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(regression_data(n=32), batch_size=8))
    assert [loss for loss, _ in module.seen] == [float(v) for v in module.losses]  # every step, not every 3
    assert [both for _, both in module.seen] == [0.0, 1.0, 2.0, 3.0]
    cm = trainer.callback_metrics
    assert all(isinstance(v, torch.Tensor) for v in cm.values())
    assert float(cm["both"]) == float(cm["both_epoch"]) == 1.5  # the plain name: the newest (epoch) value
    assert float(cm["biggest"]) == 3.0 and float(cm["total"]) == 4.0
    assert float(cm["epoch_end_value"]) == 42.0 and trainer.logged_metrics["epoch_end_value"] == 42.0
    assert float(cm["hidden"]) == 7.0 and "hidden" not in trainer.logged_metrics and "bar" in trainer.logged_metrics
    assert trainer.progress_bar_metrics == {"bar": 3.0}
