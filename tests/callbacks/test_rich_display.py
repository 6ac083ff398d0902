"""``RichModelSummary`` and ``RichProgressBar`` (Lightning's names; callbacks/rich_display.py). Lightning 2.6.6
draws the same program's summary as a rich table with the columns `` ``, Name, Type, Params (right-aligned),
Mode (and FLOPs, which trainforge has not) and ``Trainable params: 17`` lines under it, and its bar as
``Epoch 1/1 ━━━ 4/4 0:00:00 • 0:00:00 99.23it/s train_loss: 0.006 val_loss: 0.002``."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainforge import ConfigurationError, Trainer, TrainingModule
from trainforge.callbacks import ModelSummary, ProgressBar, RichModelSummary, RichProgressBar

pytest.importorskip("rich")


class Small(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch[0]).pow(2).mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_rich_summary_and_bar_replace_the_defaults(tmp_path, capsys):
    stream = io.StringIO()
    bar = RichProgressBar(console_kwargs={"file": stream, "width": 120})
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = Trainer(
        max_epochs=2,
        callbacks=[RichModelSummary(max_depth=2), bar],
        default_root_dir=str(tmp_path),
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=True,
    )
    trainer.fit(Small(), loader, loader)
    assert [type(c) for c in trainer.callbacks if isinstance(c, (ProgressBar, ModelSummary))] == [
        RichModelSummary,
        RichProgressBar,
    ]
    summary = capsys.readouterr().out
    header = next(line for line in summary.splitlines() if "Name" in line)
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == ["", "Name", "Type", "Params", "Mode"]
    assert "│ 1 │ net.0 │ Linear     │     12 │ train │" in summary
    assert "Trainable params: 17\nNon-trainable params: 0\nTotal params: 17" in summary
    shown = stream.getvalue()
    assert "Epoch 1/1" in shown and "4/4" in shown, shown
    final = float(trainer.progress_bar_metrics["train_loss"])
    assert f"train_loss: {final:.3f}" in shown and "val_loss:" in shown, shown


def test_without_rich_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.progress", None)  # as if rich were not installed
    with pytest.raises(ConfigurationError, match=r"'rich' package, which is not installed: pip install rich"):
        RichProgressBar()


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigurationError, match=r"refresh_rate=-1\) must be an int >= 0"):
        RichProgressBar(refresh_rate=-1)
    with pytest.raises(ConfigurationError, match="pass theme=None"):
        RichProgressBar(theme="dark")
    with pytest.raises(ConfigurationError, match="takes only max_depth"):
        RichModelSummary(header_style="bold")
