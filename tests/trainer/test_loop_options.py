"""Loop options: validation cadence, limits, epoch schedulers, clip by value, validate/test/predict,
the progress display."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer
from trainforge.callbacks import Callback, ProgressBar


class CountValidations(Callback):
    def __init__(self):
        self.at = []

    def on_validation_end(self, trainer, module):
        if trainer.stage == "fit":
            self.at.append((trainer.current_epoch, trainer.batch_idx))


def run(tmp_path, module=None, val=True, callbacks=(), **kwargs):
    kwargs.setdefault("max_epochs", 2)
    trainer = Trainer(
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=list(callbacks),
        **kwargs,
    )
    data = regression_data(n=64)
    trainer.fit(
        module if module is not None else Regressor(make_net()),
        DataLoader(data, batch_size=8),
        DataLoader(data, batch_size=32) if val else None,
    )
    return trainer


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"val_check_interval": 0.5}, [(0, 4), (0, 8), (1, 4), (1, 8)]),
        # Lightning: validation where it is due, no extra run at the epoch end
        ({"val_check_interval": 3}, [(0, 3), (0, 6), (1, 3), (1, 6)]),
        ({"val_check_interval": 0.3}, [(0, 2), (0, 4), (0, 6), (0, 8), (1, 2), (1, 4), (1, 6), (1, 8)]),
        ({"val_check_interval": 3, "check_val_every_n_epoch": None}, [(0, 3), (0, 6), (1, 1), (1, 4), (1, 7)]),
        ({"check_val_every_n_epoch": 2}, [(1, 8)]),
        ({"limit_train_batches": 5}, [(0, 5), (1, 5)]),
        ({"limit_train_batches": 0.25, "max_epochs": 1}, [(0, 2)]),
    ],
)
def test_validation_cadence_and_limits(tmp_path, kwargs, expected):
    counter = CountValidations()
    run(tmp_path, callbacks=[counter], **kwargs)
    assert counter.at == expected


def test_limit_val_batches_and_max_steps_cut(tmp_path):
    class CountVal(Regressor):
        val_batches = 0

        def validation_step(self, batch, batch_idx):
            type(self).val_batches += 1
            super().validation_step(batch, batch_idx)

    trainer = run(
        tmp_path,
        module=CountVal(make_net()),
        limit_val_batches=1,
        max_steps=11,
        max_epochs=None,
        num_sanity_val_steps=0,
    )
    assert trainer.global_step == 11 and trainer.current_epoch == 1
    assert CountVal.val_batches == 1  # one full epoch (validation at its end), one batch per validation


def test_epoch_scheduler_with_frequency(tmp_path):
    class EpochSched(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch", "frequency": 2}}

    trainer = run(tmp_path, module=EpochSched(make_net()), val=False, max_epochs=5)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * 0.25)  # after epochs 2 and 4


def test_clip_by_value_bounds_every_gradient(tmp_path):
    before, after = [], []
    module = Regressor(make_net(), lr=0.0)

    def largest_grad():
        return max(p.grad.abs().max().item() for p in module.parameters() if p.grad is not None)

    class Watch(Callback):  # fires before clipping; the optimizer's pre-hook sees the clipped grads
        def on_fit_start(self, trainer, module):
            trainer.optimizers[0].register_step_pre_hook(lambda *a: after.append(largest_grad()))

        def on_before_optimizer_step(self, trainer, module, optimizer):
            before.append(largest_grad())

    run(
        tmp_path,
        module=module,
        val=False,
        max_epochs=1,
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        callbacks=[Watch()],
    )
    assert max(before) > 1e-3, "gradients were already small: the test would prove nothing"
    assert len(after) == 8 and max(after) <= torch.tensor(1e-3).item()  # 1e-3 as float32


def test_validate_test_predict(tmp_path):
    class Full(Regressor):
        def test_step(self, batch, batch_idx):
            self.log("test/loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

    module = Full(make_net())
    trainer = Trainer(
        max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False
    )
    data = regression_data(n=20)
    loader = DataLoader(data, batch_size=8)
    (val,) = trainer.validate(module, loader)  # one dict per dataloader (Lightning)
    (test,) = trainer.test(module, loader)
    preds = trainer.predict(module, loader)
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(module.net(data.tensors[0]), data.tensors[1])
    assert val["val/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert test["test/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert torch.allclose(torch.cat(preds), module.net(data.tensors[0]).detach())


def test_progress_lines_when_not_a_terminal(tmp_path):
    stream = io.StringIO()
    trainer = Trainer(
        max_epochs=1,
        log_every_n_steps=2,
        default_root_dir=str(tmp_path),
        enable_checkpointing=False,
        callbacks=[ProgressBar(stream=stream)],
    )
    trainer.fit(Regressor(make_net()), DataLoader(regression_data(n=64), batch_size=8))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("epoch 0 step 2 loss=") and lines[-1].endswith("it/s")


def test_progress_bar_on_a_terminal(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    trainer = Trainer(
        max_epochs=1,
        default_root_dir=str(tmp_path),
        enable_checkpointing=False,
        callbacks=[ProgressBar(stream=stream, refresh_every_n_steps=1)],
    )
    trainer.fit(Regressor(make_net()), DataLoader(regression_data(n=64), batch_size=8))
    # Lightning's postfix: v_num (the default logger's version) and the prog_bar values (none here)
    assert "8/8" in stream.getvalue() and "v_num=0" in stream.getvalue()


def test_disabled_progress_bar_prints_nothing(tmp_path, capsys):
    run(tmp_path, val=False, max_epochs=1)
    assert "it/s" not in capsys.readouterr().err


@pytest.mark.slow
def test_compile_compiles_submodules_and_trains(tmp_path):
    module = Regressor(make_net())
    run(tmp_path, module=module, val=False, max_epochs=1, compile=True)
    assert module.net._compiled_call_impl is not None  # nn.Module.compile() in place: training_step uses it
    assert float(module.losses[-1]) < float(module.losses[0])
