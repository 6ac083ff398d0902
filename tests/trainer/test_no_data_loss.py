"""Nothing trainforge did not write is ever replaced or deleted; a second run never overwrites the first.

Real files in tmp_path; each test asserts the bystander files are still there, byte for byte.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Accelerator, CheckpointError, ConfigurationError, Trainer
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies.checkpoint.io import (
    CheckpointWriter,
    delete_checkpoint,
    list_checkpoints,
    read_latest_pointer,
)


def _trainer(tmp_path, callbacks=None, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    kwargs.setdefault("logger", False)  # checkpoints in <root>/checkpoints (a logger's: in its version folder)
    return Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, callbacks=callbacks, **kwargs)


def _fit(tmp_path, callbacks, **kwargs):
    torch.manual_seed(0)
    trainer = _trainer(tmp_path, callbacks, **kwargs)
    trainer.fit(
        Regressor(make_net()),
        DataLoader(regression_data(), batch_size=16),
        DataLoader(regression_data(32, seed=7), batch_size=16),
    )
    return trainer


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _fitted(tmp_path):
    return _fit(tmp_path / "run", [], max_epochs=1, enable_checkpointing=False)


def test_trainer_save_into_a_user_folder_is_refused(tmp_path):
    trainer = _fitted(tmp_path)
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "notes.md").write_text("my notes")
    with pytest.raises(
        ConfigurationError,
        match=r"refusing to save into .*experiment.*not a trainforge checkpoint"
        r".*notes\.md.*new directory",
    ):
        trainer.save_checkpoint(str(folder))
    assert _snapshot(folder) == {"notes.md": b"my notes"}
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no partial left behind
    # a sub-directory (the suggested fix) works and leaves the notes alone
    trainer.save_checkpoint(str(folder / "checkpoint"))
    assert (folder / "notes.md").read_text() == "my notes"


def test_trainer_save_onto_the_checkpoints_root_is_refused(tmp_path):
    trainer = _fit(tmp_path, [ModelCheckpoint(every_n_epochs=1, save_top_k=0)])
    root = tmp_path / "checkpoints"
    before = _snapshot(root)
    assert len(list_checkpoints(root)) == 2 and "latest" in before
    with pytest.raises(ConfigurationError, match="checkpoint root: it holds 'latest'"):
        trainer.save_checkpoint(str(root))
    assert _snapshot(root) == before


def test_accelerator_saves_never_replace_user_folders(tmp_path, monkeypatch):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(4, 2))
    outputs = tmp_path / "outputs"
    (outputs / "logs").mkdir(parents=True)
    (outputs / "logs" / "train.log").write_text("log")
    with pytest.raises(ConfigurationError, match="not a trainforge checkpoint"):
        acc.save_state(str(outputs))
    tokenizer = tmp_path / "my-model"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigurationError, match="tokenizer.json"):
        acc.save_model(model, str(tokenizer))
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "train.py").write_text("print('train')")
    monkeypatch.chdir(work)
    with pytest.raises(ConfigurationError, match="train.py"):
        acc.save_model(model, ".")
    assert _snapshot(outputs) == {"logs/train.log": b"log"}
    assert _snapshot(tokenizer) == {"tokenizer.json": b"{}"}
    assert _snapshot(work) == {"train.py": b"print('train')"} and (work / "src").is_dir()


def test_a_save_replaces_only_its_own_kind(tmp_path):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(4, 2))
    acc.save_state(str(tmp_path / "state"))
    acc.save_state(str(tmp_path / "state"))  # the same kind: replaced (atomically)
    with pytest.raises(ConfigurationError, match="'accelerator' checkpoint, not 'weights'"):
        acc.save_model(model, str(tmp_path / "state"))
    acc.save_model(model, str(tmp_path / "weights"))
    acc.save_model(model, str(tmp_path / "weights"))
    (tmp_path / "empty").mkdir()
    acc.save_model(model, str(tmp_path / "empty"))
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match="not a directory"):
        CheckpointWriter(tmp_path / "file")


def test_second_run_writes_versioned_names_and_says_how_to_resume(tmp_path, caplog):
    _fit(
        tmp_path, [ModelCheckpoint(every_n_epochs=1, save_top_k=0, filename="e{epoch}", auto_insert_metric_name=False)]
    )
    root = tmp_path / "checkpoints"
    first = {name: (root / name / "metadata.json").read_bytes() for name in ("e0", "e1")}
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        _fit(
            tmp_path,
            [ModelCheckpoint(every_n_epochs=1, save_top_k=0, filename="e{epoch}", auto_insert_metric_name=False)],
        )
    assert {name: (root / name / "metadata.json").read_bytes() for name in first} == first  # untouched
    assert sorted(p.name for p in list_checkpoints(root)) == ["e0", "e0-v1", "e1", "e1-v1"]
    assert read_latest_pointer(root) == "e1-v1"
    text = caplog.text
    assert "earlier run" in text and "resume='auto'" in text and "-v1" in text


def test_second_run_best_does_not_replace_the_first_runs_best(tmp_path):
    def run(lr):
        torch.manual_seed(0)
        trainer = _trainer(tmp_path, [ModelCheckpoint(monitor="val/loss", filename="best")], max_epochs=1)
        trainer.fit(
            Regressor(make_net(), lr=lr),
            DataLoader(regression_data(), batch_size=16),
            DataLoader(regression_data(32, seed=7), batch_size=16),
        )
        return trainer

    run(1e-2)
    best = tmp_path / "checkpoints" / "best"
    first = (best / "metadata.json").read_bytes()
    second = run(1e-6)  # a worse run
    assert (best / "metadata.json").read_bytes() == first
    mc = [cb for cb in second.callbacks if isinstance(cb, ModelCheckpoint)][0]
    assert mc.best_model_path.endswith("best-v1")


def test_resumed_run_replaces_its_own_names_without_suffix(tmp_path):
    _fit(tmp_path, [ModelCheckpoint(every_n_epochs=1, save_top_k=0, filename="last", save_last=False)], max_epochs=1)
    _fit(tmp_path, [ModelCheckpoint(every_n_epochs=1, save_top_k=0, filename="last")], max_epochs=2, resume="auto")
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["last"]
    assert json.loads((root / "last" / "metadata.json").read_text())["epoch"] == 1


def test_save_last_of_a_second_fresh_run_is_versioned_and_its_own_later_saves_replace_it(tmp_path):
    _fit(tmp_path, [ModelCheckpoint(save_top_k=0, save_last=True)], max_epochs=1)
    root = tmp_path / "checkpoints"
    first = (root / "last" / "metadata.json").read_bytes()
    second = _fit(tmp_path, [ModelCheckpoint(save_top_k=0, save_last=True)], max_epochs=2)
    assert (root / "last" / "metadata.json").read_bytes() == first  # the first run's 'last' untouched
    mc = [cb for cb in second.callbacks if isinstance(cb, ModelCheckpoint)][0]
    assert mc.last_model_path.endswith("last-v1")
    assert json.loads((root / "last-v1" / "metadata.json").read_text())["epoch"] == 1  # rewritten each epoch
    assert sorted(p.name for p in list_checkpoints(root)) == ["last", "last-v1"]


def test_pruning_never_trusts_paths_from_saved_state(tmp_path):
    outside = CheckpointWriter(tmp_path / "elsewhere" / "precious").finalize({"step": 1})
    user_dir = tmp_path / "checkpoints" / "mine"
    user_dir.mkdir(parents=True)
    (user_dir / "data.txt").write_text("keep")
    (user_dir / "metadata.json").write_text("{}")  # looks like a checkpoint, is not ours
    mc = ModelCheckpoint(every_n_steps=1, keep_last_k=1, save_top_k=0)
    mc.load_state_dict({"periodic": [str(outside), str(user_dir)], "best_k": {}, "last_saved_step": -1})
    _fit(tmp_path, [mc], max_epochs=1)
    assert (outside / "metadata.json").is_file() and (user_dir / "data.txt").read_text() == "keep"
    with pytest.raises(CheckpointError, match="not inside the checkpoint directory"):
        delete_checkpoint(outside, root=tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match="not a trainforge checkpoint"):
        delete_checkpoint(user_dir)
    assert len(list_checkpoints(tmp_path / "checkpoints")) == 1  # its own periodic saves were pruned


def test_symlinked_checkpoint_is_not_followed_for_deletion(tmp_path):
    target = CheckpointWriter(tmp_path / "real" / "step-1").finalize({"step": 1})
    root = tmp_path / "checkpoints"
    root.mkdir()
    os.symlink(target, root / "step-1")
    with pytest.raises(CheckpointError):
        delete_checkpoint(root / "step-1", root=root)
    assert (target / "metadata.json").is_file()
