"""The order of events in a fit with validation is the order callbacks/events.py documents."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Event, Trainer
from trainforge.callbacks import Callback


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda trainer, module, *args: object.__getattribute__(self, "events").append(name)
        return object.__getattribute__(self, name)


# Recorder overrides every hook dynamically; make the dispatcher see it as overriding them all.
for _event in Event:
    setattr(Recorder, _event.value, lambda self, *a: None)


class RecordingModule(Regressor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []

    def on_fit_start(self):  # Lightning's module signatures
        self.events.append("on_fit_start")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.events.append("on_train_batch_end")


def test_fit_event_order_matches_documented_loop(tmp_path):
    rec = Recorder()
    module = RecordingModule(make_net())
    trainer = Trainer(
        max_epochs=1,
        log_every_n_steps=1,
        callbacks=[rec],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    data = regression_data(n=16)
    trainer.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=16))
    step = [
        "on_train_batch_start",
        "on_before_zero_grad",  # Lightning's place: before the backward of a window's first batch
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_log",
    ]
    validation = [
        "on_validation_start",
        "on_validation_epoch_start",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_validation_epoch_end",
        "on_log",  # the epoch's values with what on_validation_epoch_end logged: one LOG (Lightning's row)
        "on_validation_end",
    ]
    sanity = ["on_sanity_check_start"] + [e for e in validation if e != "on_log"] + ["on_sanity_check_end"]
    expected = (
        ["on_setup", "on_fit_start"]
        + sanity
        + ["on_train_start", "on_train_epoch_start"]
        + step
        + ["on_train_batch_end"]
        + step
        + validation
        + ["on_train_batch_end"]
        + ["on_train_epoch_end", "on_train_end", "on_fit_end", "on_teardown"]
    )
    assert rec.events == expected
    # the module receives the same events, after the callbacks (Lightning 2.6's order)
    assert module.events == ["on_fit_start", "on_train_batch_end", "on_train_batch_end"]


def test_exception_fires_exception_then_teardown_and_reraises(tmp_path):
    rec = Recorder()

    class Boom(Regressor):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom at batch 1")
            return super().training_step(batch, batch_idx)

    trainer = Trainer(
        max_epochs=1,
        callbacks=[rec],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    with pytest.raises(RuntimeError, match="boom at batch 1"):
        trainer.fit(Boom(make_net()), DataLoader(regression_data(n=32), batch_size=8))
    assert rec.events[-2:] == ["on_exception", "on_teardown"]
