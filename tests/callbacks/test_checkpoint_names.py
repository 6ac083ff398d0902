"""ModelCheckpoint's names as Lightning 2.6 writes them (issue 38, item 6).

``LIGHTNING`` holds what Lightning 2.6.6 wrote for the same settings: /tmp/w6/ckpt_names_ref.py-style program, a
``Linear(2, 1)`` on 10 samples in batches of 2 (5 steps an epoch), 4 epochs, validation logging ``val_acc =
epoch / 4``, each case in a fresh ``dirpath``, run with ``lightning.pytorch`` (``enable_progress_bar=False,
logger=False``) and listed with ``os.listdir``. Deliberate differences, stripped before comparing: a checkpoint
is a directory (no ``.ckpt``), the directory also holds the ``latest`` pointer, and ``/`` in a metric name
becomes ``_`` (Lightning writes ``epoch=0-val/loss=1.00.ckpt``, a file inside a folder ``epoch=0-val``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainforge import CheckpointError, ConfigurationError, Trainer, TrainingModule
from trainforge.callbacks import ModelCheckpoint

LIGHTNING = {
    "default": (["epoch=3-step=20.ckpt"], "epoch=3-step=20.ckpt"),
    "monitor": (["epoch=3-step=20.ckpt"], "epoch=3-step=20.ckpt"),
    "template": (
        [
            "epoch=0-val_acc=0.00.ckpt",
            "epoch=1-val_acc=0.25.ckpt",
            "epoch=2-val_acc=0.50.ckpt",
            "epoch=3-val_acc=0.75.ckpt",
        ],
        "epoch=3-val_acc=0.75.ckpt",
    ),
    "noinsert": (["0-0.00.ckpt", "1-0.25.ckpt", "2-0.50.ckpt", "3-0.75.ckpt"], "3-0.75.ckpt"),
    "m_epoch": (["epoch=2-step=15.ckpt", "epoch=3-step=20.ckpt"], "epoch=3-step=20.ckpt"),
    "m_step": (["epoch=3-step=20.ckpt"], "epoch=3-step=20.ckpt"),
    "fixed2": (["best-v1.ckpt", "best.ckpt"], "best-v1.ckpt"),
    "twice": (["epoch=3-step=20-v1.ckpt", "epoch=3-step=20.ckpt"], "epoch=3-step=20-v1.ckpt"),
}
CASES = {
    "default": [{}],
    "monitor": [{"monitor": "val_acc", "mode": "max"}],
    "template": [{"filename": "{epoch}-{val_acc:.2f}", "monitor": "val_acc", "mode": "max", "save_top_k": -1}],
    "noinsert": [
        {
            "filename": "{epoch}-{val_acc:.2f}",
            "auto_insert_metric_name": False,
            "monitor": "val_acc",
            "mode": "max",
            "save_top_k": -1,
        }
    ],
    "m_epoch": [{"monitor": "epoch", "mode": "max", "save_top_k": 2}],
    "m_step": [{"monitor": "step", "mode": "max", "save_top_k": 1}],
    "fixed2": [{"filename": "best", "monitor": "val_acc", "mode": "max", "save_top_k": 2}],
    "twice": [{}, {}],  # a second run into the same folder
}


class Scripted(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", self.current_epoch / 4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(directory: Path, **settings) -> ModelCheckpoint:
    torch.manual_seed(0)
    callback = ModelCheckpoint(dirpath=str(directory), **settings)
    loader = DataLoader(TensorDataset(torch.randn(10, 2)), batch_size=2)
    trainer = Trainer(
        max_epochs=4,
        callbacks=[callback],
        default_root_dir=str(directory.parent),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Scripted(), loader, loader)
    return callback


@pytest.mark.parametrize("case", sorted(CASES))
def test_names_are_lightnings(tmp_path, case):
    for settings in CASES[case]:
        callback = fit(tmp_path / case, **settings)
    written = sorted(p.name + ".ckpt" for p in (tmp_path / case).iterdir() if p.name != "latest")
    expected_files, expected_best = LIGHTNING[case]
    assert written == expected_files
    assert Path(callback.best_model_path).name + ".ckpt" == expected_best


def test_verbose_prints_lightnings_messages(tmp_path, capsys):
    fit(tmp_path / "v", monitor="val_acc", mode="min", save_top_k=1, verbose=True)
    out = capsys.readouterr().out
    path = str(tmp_path / "v" / "epoch=0-step=5")
    assert f"Epoch 0, global step 5: 'val_acc' reached 0.00000 (best 0.00000), saving model to {path!r} as top 1" in out
    assert "Epoch 1, global step 10: 'val_acc' was not in top 1" in out


def test_without_the_version_counter_another_runs_checkpoint_is_kept_and_fit_stops(tmp_path):
    """Lightning overwrites; trainforge never overwrites another run's checkpoint: it saves beside it, then stops."""
    fit(tmp_path / "d", enable_version_counter=False)
    with pytest.raises(CheckpointError, match=r"enable_version_counter=False.*epoch=3-step=20 holds another run"):
        fit(tmp_path / "d", enable_version_counter=False)
    kept = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert kept == ["epoch=2-step=15", "epoch=3-step=20", "epoch=3-step=20-v1", "latest"]  # stopped before pruning


def test_without_the_version_counter_a_kept_name_is_replaced(tmp_path):
    """Lightning: ``filename="best", save_top_k=2, enable_version_counter=False`` writes ``best.ckpt`` twice."""
    callback = fit(
        tmp_path / "f", filename="best", monitor="val_acc", mode="max", save_top_k=2, enable_version_counter=False
    )
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["best", "latest"]
    assert callback.best_model_score == 0.75


@pytest.mark.parametrize("flag", ["verbose", "enable_version_counter"])
def test_flags_must_be_bools(flag):
    with pytest.raises(ConfigurationError, match=rf"ModelCheckpoint\({flag}='yes'\) must be True or False"):
        ModelCheckpoint(**{flag: "yes"})
