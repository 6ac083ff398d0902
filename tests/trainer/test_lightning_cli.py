"""``LightningCLI`` (``trainforge.lightning.cli``; trainer/compat/lightning/cli.py) on jsonargparse.

Lightning 2.6.6 figures: the program ``/tmp/w6/cli/train.py`` (``MyModel``/``MyDataModule`` below, ``LightningCLI(MyModel,
MyDataModule, trainer_defaults=TRAINER_DEFAULTS)``) with ``lightning.pytorch.cli.LightningCLI``, run by
/tmp/refvenv/bin/python: ``fit --trainer.max_epochs 2 --model.lr 0.1 --seed_everything 7`` ends at global_step 8
with ``net[0].weight[:3] = SEVEN``; ``fit --trainer.max_epochs 3 --model.hidden 6 --print_config`` written to a
file and run back with ``fit --config <file> --seed_everything 7`` ends at step 12 with ``HIDDEN_SIX``.
"""

from __future__ import annotations

import sys

import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

import trainforge.lightning as L
from trainforge import ConfigurationError

pytest.importorskip("jsonargparse")
from trainforge.lightning.cli import LightningCLI

SEVEN = [-0.29600808024406433, -0.5845848321914673, 0.15479405224323273]
HIDDEN_SIX = [0.10438825935125351, -0.3860687017440796, 0.21674147248268127]
TRAINER_DEFAULTS = {
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "logger": False,
}


class MyModel(L.LightningModule):
    def __init__(self, hidden: int = 4, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class MyDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 8, n: int = 32):
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def setup(self, stage):
        x = torch.randn(self.n, 2, generator=torch.Generator().manual_seed(1))
        self.ds = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size)


def cli(*args, **kwargs):
    return LightningCLI(MyModel, MyDataModule, trainer_defaults=TRAINER_DEFAULTS, args=list(args), **kwargs)


def first_weights(cli_):
    return cli_.model.net[0].weight.flatten()[:3].tolist()


def test_fit_with_trainer_and_model_arguments_gives_lightnings_weights(tmp_path):
    root = str(tmp_path / "run")
    done = cli("fit", "--trainer.max_epochs", "2", "--model.lr", "0.1", "--seed_everything", "7",
               "--trainer.default_root_dir", root)  # fmt: skip
    assert done.subcommand == "fit" and done.trainer.global_step == 8
    assert done.model.hparams.lr == 0.1 and done.datamodule.batch_size == 8
    assert first_weights(done) == pytest.approx(SEVEN, abs=1e-7)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["seed_everything"] == 7 and saved["trainer"]["max_epochs"] == 2
    assert saved["model"] == {"hidden": 4, "lr": 0.1} and saved["data"] == {"batch_size": 8, "n": 32}
    with pytest.raises(ConfigurationError, match=r"config.yaml already exists.*'overwrite': True"):
        cli("fit", "--trainer.max_epochs", "1", "--trainer.default_root_dir", root)


def test_print_config_then_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli("fit", "--trainer.max_epochs", "3", "--model.hidden", "6", "--print_config")
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["model"] == {"hidden": 6, "lr": 0.01}
    (tmp_path / "cfg.yaml").write_text(printed)
    done = cli("fit", "--config", str(tmp_path / "cfg.yaml"), "--seed_everything", "7",
               "--trainer.default_root_dir", str(tmp_path / "run"))  # fmt: skip
    assert done.trainer.global_step == 12
    assert first_weights(done) == pytest.approx(HIDDEN_SIX, abs=1e-7)


def test_run_false_builds_without_a_subcommand():
    built = cli("--model.hidden", "3", "--seed_everything", "false", "--trainer.max_epochs", "1", run=False)
    assert built.subcommand is None and built.model.net[0].out_features == 3 and built.trainer.global_step == 0


def test_refusals_name_the_fix(monkeypatch):
    with pytest.raises(ConfigurationError, match=r"model_class=None\): pass the module's class"):
        LightningCLI(args=["fit"])
    with pytest.raises(ConfigurationError, match="subclass_mode_model/subclass_mode_data=True"):
        cli("fit", subclass_mode_model=True)
    with pytest.raises(SystemExit):  # jsonargparse: 'unrecognized arguments: --optimizer Adam'
        cli("fit", "--optimizer", "Adam")
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # as if it were not installed
    with pytest.raises(ConfigurationError, match=r"'jsonargparse' package, which is not installed: pip install"):
        cli("fit")
