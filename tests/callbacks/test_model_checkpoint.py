"""ModelCheckpoint: every-n, keep-last-k, monitored top-k, filename templates, resume selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import CheckpointError, ConfigurationError, Trainer
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies.checkpoint.io import read_latest_pointer


def names(directory: Path):
    return sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))


def fit(tmp_path, callbacks, module=None, val=True, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    # no logger: checkpoints in <root>/checkpoints, Lightning's place without one (with a logger they go to its
    # version folder: tests/callbacks/test_lightning_loggers.py)
    kwargs.setdefault("logger", False)
    trainer = Trainer(callbacks=callbacks, default_root_dir=str(tmp_path), enable_progress_bar=False, **kwargs)
    data = regression_data(n=32)
    trainer.fit(
        module if module is not None else Regressor(make_net()),
        DataLoader(data, batch_size=8),
        DataLoader(data, batch_size=16) if val else None,
    )
    return trainer


def test_every_n_steps_keeps_last_k_and_moves_latest(tmp_path):
    fit(tmp_path, [ModelCheckpoint(every_n_steps=2, keep_last_k=2)], val=False)
    ckpts = tmp_path / "checkpoints"
    assert names(ckpts) == ["epoch=1-step=6", "epoch=1-step=8"]
    assert read_latest_pointer(ckpts) == "epoch=1-step=8"
    meta = json.loads((ckpts / "epoch=1-step=8" / "metadata.json").read_text())
    assert meta["step"] == 8 and meta["epoch"] == 1 and meta["world_size"] == 1


class ScriptedVal(Regressor):
    """Validation loss follows a fixed script, one value per validation run."""

    def __init__(self, script):
        super().__init__(make_net())
        self.script, self.calls = list(script), 0

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.script[self.calls])

    def on_validation_end(self):
        if self.trainer.stage == "fit":  # not the sanity check
            self.calls += 1


def test_monitored_top_k_keeps_the_best(tmp_path):
    script = [5.0, 3.0, 4.0, 1.0, 2.0]
    cb = ModelCheckpoint(monitor="val/loss", mode="min", save_top_k=2, filename="{epoch}-{val/loss:.1f}")
    fit(tmp_path, [cb], module=ScriptedVal(script), max_epochs=5)
    # Lightning: metric names are inserted ("{epoch}-{val_loss:.2f}" -> "epoch=3-val_loss=0.12")
    assert names(tmp_path / "checkpoints") == ["epoch=3-val_loss=1.0", "epoch=4-val_loss=2.0"]
    assert Path(cb.best_model_path).name == "epoch=3-val_loss=1.0"
    # Lightning: best_model_score, best_k_models, kth_best_model_path, current_score
    assert cb.best_model_score == 1.0 and cb.current_score == 2.0
    assert sorted(Path(p).name for p in cb.best_k_models) == names(tmp_path / "checkpoints")
    assert Path(cb.kth_best_model_path).name == "epoch=4-val_loss=2.0"


def test_max_mode_and_every_n_epochs(tmp_path):
    best = ModelCheckpoint(monitor="val/loss", mode="max", save_top_k=1, dirpath=str(tmp_path / "best"))
    periodic = ModelCheckpoint(every_n_epochs=2, dirpath=str(tmp_path / "periodic"))
    fit(tmp_path, [best, periodic], module=ScriptedVal([1.0, 9.0, 4.0, 2.0]), max_epochs=4)
    assert names(tmp_path / "best") == ["epoch=1-step=8"]  # Lightning's default name, monitor or not
    assert names(tmp_path / "periodic") == ["epoch=1-step=8", "epoch=3-step=16"]


def test_bad_template_and_missing_monitor_are_clear(tmp_path):
    with pytest.raises(ConfigurationError, match=r"filename='\{nope\}' cannot be filled"):
        fit(tmp_path / "a", [ModelCheckpoint(every_n_steps=1, filename="{nope}")], val=False)
    assert names(tmp_path / "a" / "checkpoints") == ["epoch=0-step=1"]  # issue 25: saved, then the error
    with pytest.raises(ConfigurationError, match=r"monitor='val/acc'.*available: \['train/loss', 'val/loss'\]"):
        fit(tmp_path / "b", [ModelCheckpoint(monitor="val/acc")])
    with pytest.raises(ConfigurationError, match="mode='best' is not one of: min, max"):
        ModelCheckpoint(monitor="x", mode="best")


def test_resume_from_last_skips_a_corrupted_newest_checkpoint(tmp_path):
    fit(tmp_path, [ModelCheckpoint(every_n_steps=4)], val=False)
    ckpts = tmp_path / "checkpoints"
    newest = ckpts / "epoch=1-step=8" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    explicit = Trainer(max_epochs=3, default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False)
    with pytest.raises(CheckpointError, match="model.safetensors"):  # an explicit path never falls back
        explicit.fit(
            Regressor(make_net()), DataLoader(regression_data(n=32), batch_size=8), ckpt_path=str(newest.parent)
        )
    with pytest.warns(UserWarning, match="skipped"):
        trainer = fit(tmp_path, [ModelCheckpoint(every_n_steps=4)], val=False, max_epochs=3, resume="auto")
    # resumed from step 4 (the newest that verifies), then trained to the end of epoch 3
    assert trainer.global_step == 12


def test_keep_last_k_keeps_pruning_after_a_resume(tmp_path):
    fit(tmp_path, [ModelCheckpoint(every_n_steps=2, keep_last_k=2)], val=False, max_epochs=None, max_steps=6)
    assert names(tmp_path / "checkpoints") == ["epoch=0-step=4", "epoch=1-step=6"]
    fit(
        tmp_path,
        [ModelCheckpoint(every_n_steps=2, keep_last_k=2)],
        val=False,
        max_epochs=None,
        max_steps=10,
        resume="auto",
    )
    assert names(tmp_path / "checkpoints") == ["epoch=1-step=8", "epoch=2-step=10"]


# ---- Lightning behaviours ---------------------------------------------------------------------------
def test_dirpath_alone_saves_every_epoch_end_and_keeps_the_newest(tmp_path):
    """Lightning: ModelCheckpoint(dirpath=d) with defaults saves at every epoch end, keeps the newest."""
    d = tmp_path / "d"
    fit(tmp_path, [ModelCheckpoint(dirpath=str(d))], val=False, max_epochs=3)
    assert names(d) == ["epoch=2-step=12"]


def test_save_last_keeps_a_checkpoint_named_last(tmp_path):
    """Lightning: save_last=True keeps `last` (last_model_path); save_top_k=0 + save_last keeps only it."""
    cb = ModelCheckpoint(dirpath=str(tmp_path / "a"), save_last=True)
    fit(tmp_path, [cb], val=False, max_epochs=2)
    assert names(tmp_path / "a") == ["epoch=1-step=8", "last"]
    assert Path(cb.last_model_path).name == "last"
    assert json.loads((tmp_path / "a" / "last" / "metadata.json").read_text())["step"] == 8
    only = ModelCheckpoint(dirpath=str(tmp_path / "b"), save_top_k=0, save_last=True)
    fit(tmp_path, [only], val=False, max_epochs=2)
    assert names(tmp_path / "b") == ["last"]


def test_template_without_metric_names_and_save_top_k_without_monitor(tmp_path):
    """Lightning: auto_insert_metric_name=False keeps the template as written; save_top_k other than
    -1/0/1 without monitor is a configuration error."""
    d = tmp_path / "d"
    fit(
        tmp_path,
        [ModelCheckpoint(dirpath=str(d), filename="e{epoch:02d}", auto_insert_metric_name=False)],
        val=False,
        max_epochs=1,
    )
    assert names(d) == ["e00"]
    with pytest.raises(ConfigurationError, match=r"save_top_k=3\) without monitor.*monitor="):
        ModelCheckpoint(save_top_k=3)


class TrainMetric(Regressor):
    """The training loss is logged per step; a fixed per-epoch score as an epoch metric."""

    def __init__(self, scores):
        super().__init__(make_net())
        self.scores = scores

    def training_step(self, batch, batch_idx):
        self.log("score", self.scores[self.current_epoch], on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def test_monitor_a_training_metric_without_validation(tmp_path):
    """Lightning: with no validation loop, a monitored training metric is judged at the train epoch end."""
    cb = ModelCheckpoint(dirpath=str(tmp_path / "d"), monitor="score", mode="max", filename="{epoch}")
    fit(tmp_path, [cb], module=TrainMetric([1.0, 3.0, 2.0]), val=False, max_epochs=3)
    assert names(tmp_path / "d") == ["epoch=1"] and cb.best_model_score == 3.0


def test_every_n_train_steps_time_interval_and_weights_only_are_accepted(tmp_path):
    """Lightning names: every_n_train_steps (warns that every periodic save is kept unless keep_last_k),
    train_time_interval, save_weights_only (consolidated safetensors, not resumable)."""
    from datetime import timedelta

    with pytest.warns(UserWarning, match="keep_last_k=1"):
        steps = ModelCheckpoint(dirpath=str(tmp_path / "s"), every_n_train_steps=4)
    timed = ModelCheckpoint(
        dirpath=str(tmp_path / "t"), train_time_interval=timedelta(seconds=0), save_weights_only=True, keep_last_k=1
    )
    fit(tmp_path, [steps, timed], val=False, max_epochs=1)
    assert names(tmp_path / "s") == ["epoch=0-step=4"]
    assert names(tmp_path / "t") == ["epoch=0-step=4"]
    assert (tmp_path / "t" / "epoch=0-step=4" / "model.safetensors").is_file()
    assert not (tmp_path / "t" / "epoch=0-step=4" / "optimizers.pt").exists()


@pytest.mark.parametrize("template", ["{epoch-{step}", "model-{}", "{epoch}}", "x{", 3])
def test_malformed_filename_templates_are_refused_when_built(template):
    """Used literally they would give '{epoch-step=8', or 'model-{}' overwritten every epoch."""
    with pytest.raises(
        ConfigurationError,
        match=r"ModelCheckpoint filename=.* (is not a valid template|must be a "
        r"string template)",
    ):
        ModelCheckpoint(filename=template)


def test_names_that_change_only_with_the_epoch_are_refused_for_saves_within_an_epoch():
    """filename='{epoch}' with every_n_steps=1 would keep 2 of 8 saves, each replacing the last."""
    with pytest.raises(ConfigurationError, match=r"names change only with the epoch.*add \{step\}"):
        ModelCheckpoint(filename="{epoch}", every_n_steps=1, save_top_k=-1)
    ModelCheckpoint(filename="{epoch}-{step}", every_n_steps=1, save_top_k=-1)  # fine
    ModelCheckpoint(filename="best-{val/loss:.2f}", monitor="val/loss", every_n_steps=10)  # a metric in the name
    ModelCheckpoint(filename="{epoch}", every_n_epochs=1)  # one save per epoch


class CountSteps(Regressor):
    steps = 0

    def training_step(self, batch, batch_idx):
        CountSteps.steps += 1
        return super().training_step(batch, batch_idx)


def test_an_unwritable_checkpoint_directory_is_refused_at_fit_start(tmp_path):
    """Issue 25: a raw OSError came only at the first save, after the first epoch. The tests run as root,
    which ignores permission bits, so the directory is made unwritable another way: its parent is a
    regular file, which no user can create a directory in."""
    (tmp_path / "file").write_text("not a directory")
    CountSteps.steps = 0
    with pytest.raises(
        ConfigurationError,
        match=r"ModelCheckpoint\(dirpath='.*/file/ck'\) is not writable \(Not a directory: a part of the path is "
        r"a file, not a directory\); no checkpoint could be saved there. Pass dirpath=\.\.\. naming",
    ):
        fit(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path / "file" / "ck"))], module=CountSteps(make_net()))
    assert CountSteps.steps == 0  # before any work
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("a file where the default directory goes")
    with pytest.raises(ConfigurationError, match=r"checkpoint directory '.*/run/checkpoints' \(Trainer\(default_"):
        fit(tmp_path / "run", [ModelCheckpoint(save_last=True)], module=CountSteps(make_net()))
    assert CountSteps.steps == 0
    fit(tmp_path / "a", [ModelCheckpoint(dirpath=str(tmp_path / "file" / "ck"), save_top_k=0)], max_epochs=1)


def test_a_template_field_found_late_loses_no_work_and_a_bad_format_is_refused_when_built(tmp_path):
    """Issue 25: a field no metric fills was found at the first save (here after two epochs) and that
    save was lost; a format that cannot apply to a number was found there too. Which metrics a run logs
    is known only once they are logged, so that check stays at the first save, but the save is kept."""
    with pytest.raises(
        ConfigurationError,
        match=r"filename='\{epoch\}-\{val_acc\}' cannot be filled \('val_acc': no such logged metric\); it may "
        r"use epoch, step and the logged metrics \['train/loss', 'val/loss'\]. Nothing is lost: this checkpoint was "
        r"saved as .*epoch=1-step=8; fix filename and resume from it",
    ):
        fit(tmp_path, [ModelCheckpoint(every_n_epochs=2, filename="{epoch}-{val_acc}")], max_epochs=3)
    assert names(tmp_path / "checkpoints") == ["epoch=1-step=8"]
    assert read_latest_pointer(tmp_path / "checkpoints") == "epoch=1-step=8"
    with pytest.raises(ConfigurationError, match=r"the format 'd' of \{val/loss\} does not apply to a float \(log"):
        ModelCheckpoint(filename="{epoch}-{val/loss:d}", monitor="val/loss")
    with pytest.raises(ConfigurationError, match=r"the format 'q' of \{step\} does not apply to an int .*'\{step:d\}'"):
        ModelCheckpoint(filename="{epoch}-{step:q}")


@pytest.mark.parametrize("callback", ["ModelCheckpoint", "EarlyStopping"])
def test_a_monitored_metric_never_logged_is_reported_at_the_first_validation(tmp_path, callback):
    """Issue 25 (already so): not at the end of the first epoch but at the first validation (here mid-epoch),
    or at the first training epoch end without validation, naming the metrics that were logged."""
    from trainforge.callbacks import EarlyStopping

    make = (lambda m: ModelCheckpoint(monitor=m)) if callback == "ModelCheckpoint" else (lambda m: EarlyStopping(m))
    CountSteps.steps = 0
    with pytest.raises(ConfigurationError, match=r"monitor='val/acc'.*[Aa]vailable: \[?'?train/loss'?, '?val/loss"):
        fit(tmp_path / "v", [make("val/acc")], module=CountSteps(make_net()), val_check_interval=0.5)
    assert CountSteps.steps == 2  # of 4 per epoch: the first validation ran after batch 2
    CountSteps.steps = 0
    with pytest.raises(ConfigurationError, match=r"monitor='train/acc'.*[Aa]vailable: \[?'?train/loss'?\]?"):
        fit(tmp_path / "t", [make("train/acc")], module=CountSteps(make_net()), val=False)
    assert CountSteps.steps == 4  # the first training epoch's end
