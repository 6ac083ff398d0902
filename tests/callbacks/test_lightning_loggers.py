"""Loggers as Lightning writes them (issue 38 item 3): ``CSVLogger``/``TensorBoardLogger`` with Lightning 2.6's
arguments and ``<save_dir>/<name>/version_<N>`` folders, ``metrics.csv`` with Lightning's columns, rows and
steps, Lightning's default logger, checkpoints in ``<log_dir>/checkpoints``, the progress bar's postfix.

The Lightning outputs below were produced with Lightning 2.6.6 (torch 2.13, CPU) by ``PROGRAM`` run with
``import lightning.pytorch as L`` / ``from lightning.pytorch.loggers import CSVLogger`` instead of the
trainforge imports, ``Trainer(max_epochs=3, log_every_n_steps=2, num_sanity_val_steps=0, ...)`` as in ``run``
(``logger=CSVLogger(root)``): the file ``<root>/lightning_logs/version_0/metrics.csv``, byte for byte; a second run
wrote ``version_1`` with the same bytes. With no logger (Lightning's default, tensorboard installed) the tree was
``lightning_logs/version_0/{events.out.tfevents.*, hparams.yaml, checkpoints/epoch=2-step=15.ckpt}``.
"""

from __future__ import annotations

import csv
import io
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainforge.lightning as L
from trainforge import ConfigurationError
from trainforge.lightning.loggers import CSVLogger, TensorBoardLogger

LIGHTNING_METRICS_CSV = """\
epoch,plain,step,train_loss_epoch,train_loss_step,val_loss
0,2.4376158714294434,1,,1.2188079357147217,
0,0.37379470467567444,3,,0.18689735233783722,
0,,4,,,0.15728113055229187
0,,4,0.6678283214569092,,
1,0.254358172416687,5,,0.1271790862083435,
1,0.20541983842849731,7,,0.10270991921424866,
1,0.08852926641702652,9,,0.04426463320851326,
1,,9,,,0.04775961488485336
1,,9,0.13306577503681183,,
2,0.20247137546539307,11,,0.10123568773269653,
2,0.04585655778646469,13,,0.022928278893232346,
2,,14,,,0.01529355812817812
2,,14,0.03979285806417465,,
"""
LIGHTNING_HPARAMS_YAML = "hidden: 4\nlr: 0.1\n"
# ``HookLogs`` below through Lightning 2.6.6 as ``Boring`` (max_epochs=2, then trainer.validate): what the epoch-end
# hooks log shares the row of the loop's epoch values; validate() after fit logs at step global_step (10).
LIGHTNING_HOOK_ROWS_CSV = """\
epoch,hook_value,step,train_loss,val_hook,val_loss
0,,4,,1.25,0.15728113055229187
0,0.5,4,0.6678283214569092,,
1,,9,,1.25,0.04775961488485336
1,1.5,9,0.13306577503681183,,
2,,10,,1.25,0.04775961488485336
"""


class Boring(L.LightningModule):
    def __init__(self, lr: float = 0.1, hidden: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("plain", loss * 2)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) * 0.5)


def run(root, max_epochs: int = 3, module=None, ckpt_path=None, **kwargs) -> L.Trainer:
    torch.manual_seed(0)
    module = module or Boring()
    kwargs.setdefault("enable_progress_bar", False)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        default_root_dir=str(root),
        log_every_n_steps=2,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
    trainer.fit(
        module, DataLoader(data(20, 1), batch_size=4), DataLoader(data(8, 2), batch_size=4), ckpt_path=ckpt_path
    )
    return trainer


def rows(text: str):
    return list(csv.reader(io.StringIO(text)))


def assert_same_metrics(written: str, expected: str) -> None:
    """Header, epochs and steps exactly; values to 1e-6 (on this machine they are byte-equal, the epoch means
    divided in float32 as Lightning's; another BLAS may round a loss differently)."""
    got, want = rows(written), rows(expected)
    assert got[0] == want[0] and len(got) == len(want)
    for mine, theirs in zip(got[1:], want[1:]):
        for column, a, b in zip(want[0], mine, theirs):
            if column in ("epoch", "step") or not b:
                assert a == b, (column, mine, theirs)
            else:
                assert float(a) == pytest.approx(float(b), rel=1e-6, abs=1e-9), (column, mine, theirs)


def test_csv_logger_writes_lightnings_metrics_and_hparams(tmp_path):
    trainer = run(tmp_path, logger=CSVLogger(tmp_path))
    logger = trainer.logger
    version_0 = tmp_path / "lightning_logs" / "version_0"
    assert (logger.name, logger.version, logger.save_dir) == ("lightning_logs", 0, str(tmp_path))
    assert logger.root_dir == str(tmp_path / "lightning_logs") and logger.log_dir == str(version_0)
    assert_same_metrics((version_0 / "metrics.csv").read_text(), LIGHTNING_METRICS_CSV)
    # the epoch means exactly: a float32 division of the float32 sum, as Lightning's
    assert rows((version_0 / "metrics.csv").read_text())[-1][3] == "0.03979285806417465"
    assert (version_0 / "hparams.yaml").read_text() == LIGHTNING_HPARAMS_YAML
    # the steps are Lightning's: the last of 15 optimizer steps is logged at step 14
    assert trainer.global_step == 15 and rows((version_0 / "metrics.csv").read_text())[-1][2] == "14"
    # checkpoints without a dirpath go to the logger's version folder, as Lightning
    assert trainer.checkpoint_callback.best_model_path == str(version_0 / "checkpoints" / "epoch=2-step=15")


class HookLogs(L.LightningModule):
    """No hyperparameters; values logged on_epoch in the steps and in the epoch-end hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.log("hook_value", float(self.current_epoch) + 0.5)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_validation_epoch_end(self):
        self.log("val_hook", 1.25)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_epoch_end_hook_values_share_the_epochs_row_and_no_hparams_no_file(tmp_path):
    torch.manual_seed(0)  # the module's initial weights, as in the Lightning run
    module = HookLogs()
    trainer = run(tmp_path, max_epochs=2, module=module, logger=CSVLogger(tmp_path), enable_checkpointing=False)
    trainer.validate(trainer.module, DataLoader(data(8, 2), batch_size=4))
    version_0 = tmp_path / "lightning_logs" / "version_0"
    assert_same_metrics((version_0 / "metrics.csv").read_text(), LIGHTNING_HOOK_ROWS_CSV)
    assert not (version_0 / "hparams.yaml").exists()  # Lightning's CSVLogger writes none without hyperparameters


def test_a_second_run_gets_the_next_version_and_leaves_the_first_alone(tmp_path):
    run(tmp_path, logger=CSVLogger(tmp_path))
    first = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_bytes()
    second = run(tmp_path, logger=CSVLogger(tmp_path))
    assert second.logger.version == 1 and second.logger.log_dir == str(tmp_path / "lightning_logs" / "version_1")
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_bytes() == first
    assert (tmp_path / "lightning_logs" / "version_1" / "metrics.csv").read_bytes() == first  # the same run again
    assert not list(tmp_path.rglob("metrics.1.csv"))


def test_two_trainers_in_one_script_never_share_a_checkpoint_folder(tmp_path):
    a, b = run(tmp_path, max_epochs=1), run(tmp_path, max_epochs=1)
    dirs = [str(t.checkpoint_callback.directory(t)) for t in (a, b)]
    assert dirs == [str(tmp_path / "lightning_logs" / f"version_{n}" / "checkpoints") for n in (0, 1)]
    assert [t.default_checkpoint_dir for t in (a, b)] == dirs
    assert not (tmp_path / "checkpoints").exists()


def test_default_logger_is_tensorboard_under_lightning_logs(tmp_path):
    pytest.importorskip("tensorboard")
    seen = []

    class Images(Boring):
        def on_train_epoch_end(self):  # the GAN example's use of the default logger
            self.logger.experiment.add_image("sample", torch.zeros(1, 4, 4), self.current_epoch)
            seen.append(type(self.logger.experiment).__name__)

    trainer = run(tmp_path, module=Images())
    version_0 = tmp_path / "lightning_logs" / "version_0"
    assert isinstance(trainer.logger, TensorBoardLogger) and trainer.loggers == [trainer.logger]
    assert trainer.logger.log_dir == str(version_0) and seen == ["SummaryWriter"] * 3
    names = sorted(p.name for p in version_0.iterdir() if not p.name.startswith("."))  # .trainforge-owned.json
    assert names[0] == "checkpoints" and names[1].startswith("events.out.tfevents.") and names[2:] == ["hparams.yaml"]
    assert (version_0 / "hparams.yaml").read_text() == LIGHTNING_HPARAMS_YAML
    assert (version_0 / "checkpoints" / "epoch=2-step=15").is_dir()


def test_tensorboard_leaves_a_users_hparams_yaml_alone(tmp_path):
    pytest.importorskip("tensorboard")
    mine = tmp_path / "lightning_logs" / "version_0"
    mine.mkdir(parents=True)
    (mine / "hparams.yaml").write_text("lr: 0.3  # my notes\n")
    run(tmp_path, max_epochs=1, logger=TensorBoardLogger(tmp_path, version=0), enable_checkpointing=False)
    assert (mine / "hparams.yaml").read_text() == "lr: 0.3  # my notes\n"
    assert list(mine.glob("events.out.tfevents.*"))


def test_resuming_last_goes_on_in_the_newest_version(tmp_path):
    run(tmp_path, max_epochs=2, logger=CSVLogger(tmp_path))
    resumed = run(tmp_path, max_epochs=3, logger=CSVLogger(tmp_path), ckpt_path="last")
    assert resumed.logger.version == 0 and not (tmp_path / "lightning_logs" / "version_1").exists()
    assert_same_metrics((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text(), LIGHTNING_METRICS_CSV)


def test_progress_bar_shows_v_num_and_the_prog_bar_metrics(tmp_path):
    from trainforge.callbacks import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    trainer = run(tmp_path, max_epochs=1, callbacks=[ProgressBar(stream=stream)], enable_progress_bar=True)
    last = stream.getvalue().rstrip().splitlines()[-1]
    # Lightning 2.6 ends epoch 0 of this program with: v_num=0, train_loss_step=0.173, val_loss=0.157,
    # train_loss_epoch=0.668 (the epoch's mean, not a batch's value)
    assert "Epoch 0: 100%" in last and "v_num=0, train_loss_step=0.173" in last
    assert "train_loss_epoch=0.668" in last and "val_loss=0.157" in last
    assert {k: round(float(v), 3) for k, v in trainer.progress_bar_metrics.items()} == {
        "train_loss_step": 0.173,
        "train_loss_epoch": 0.668,
        "val_loss": 0.157,
    }


def test_lightning_arguments(tmp_path):
    logger = CSVLogger(tmp_path, name=None, version="baseline", prefix="exp", flush_logs_every_n_steps=1)
    assert logger.log_dir == str(tmp_path / "baseline") and logger.root_dir == str(tmp_path)
    run(tmp_path, max_epochs=1, logger=logger, enable_checkpointing=False)
    header = rows((tmp_path / "baseline" / "metrics.csv").read_text())[0]
    assert header == ["exp-epoch", "exp-plain", "exp-train_loss_epoch", "exp-train_loss_step", "exp-val_loss", "step"]
    pytest.importorskip("tensorboard")
    tb = TensorBoardLogger(tmp_path, name="tb", version=3, sub_dir="sub", default_hp_metric=False, flush_secs=5)
    assert tb.log_dir == str(tmp_path / "tb" / "version_3" / "sub") and tb.version == 3 and tb.name == "tb"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: CSVLogger(p, version=-1), r"CSVLogger\(version=-1\): version must be None .* an int N >= 0"),
        (lambda p: CSVLogger(p, version=1.5), r"version=1.5\): version must be None"),
        (lambda p: CSVLogger(p / "file"), r"save_dir=.*file'\) is a file; save_dir is the folder"),
        (lambda p: CSVLogger(p / "m.csv"), r"save_dir is the folder .* pass CSVLogger\(path="),
        (lambda p: CSVLogger(p, name="/abs"), r"name='/abs'\): name must be a folder name"),
        (lambda p: CSVLogger(p, prefix=3), r"prefix=3\): prefix must be a string"),
        (lambda p: CSVLogger(p, flush_logs_every_n_steps=0), r"flush_logs_every_n_steps=0\): .* an int >= 1"),
        (lambda p: CSVLogger(p, path=str(p / "m.csv")), r"pass either path or save_dir/name/version"),
        (lambda p: TensorBoardLogger(p, log_graph="yes"), r"log_graph='yes'\): log_graph must be True or False"),
        (lambda p: TensorBoardLogger(p, flush_sec=5), r"flush_sec=...\): not an argument .* flush_secs"),
    ],
)
def test_bad_arguments_are_named(tmp_path, make, message):
    if "TensorBoard" in message or "flush_sec" in message or "log_graph" in message:
        pytest.importorskip("tensorboard")
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigurationError, match=message):
        make(tmp_path)
    assert (tmp_path / "file").read_text() == "mine"


def test_log_dir_of_a_logger_without_save_dir_before_fit_is_explained():
    with pytest.raises(ConfigurationError, match=r"save_dir=None\) writes under the Trainer's default_root_dir"):
        CSVLogger().log_dir
    assert os.fspath(CSVLogger("logs").log_dir) == os.path.join("logs", "lightning_logs", "version_0")


def test_two_ranks_use_rank_zeros_version_folder(tmp_path):
    """Rank 0 fixed its version before fit; rank 1, listing the folders later, would pick another: the ranks
    agree on rank 0's (one broadcast when the fit starts), so metrics and every rank's checkpoint files meet."""
    import json
    from pathlib import Path

    from tests.helpers import forklaunch

    script = Path(__file__).resolve().parents[1] / "scripts" / "lightning_loggers_ranks.py"
    forklaunch.launch(script, tmp_path, nproc=2, timeout=180)
    version_0 = tmp_path / "lightning_logs" / "version_0"
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert (
        seen[0]
        == seen[1]
        == {
            "log_dir": str(version_0),
            "checkpoints": str(version_0 / "checkpoints"),
            "version": 0,
        }
    )
    assert (version_0 / "metrics.csv").is_file() and (version_0 / "checkpoints" / "epoch=0-step=2").is_dir()
    assert not (tmp_path / "lightning_logs" / "version_3").exists()


def test_trainer_log_dir_and_a_logger_without_save_dir(tmp_path):
    """Lightning's trainer.log_dir: the first file logger's version folder, known from the Trainer's construction
    (a logger without save_dir takes default_root_dir), else default_root_dir."""
    made = L.Trainer(default_root_dir=str(tmp_path), max_epochs=1, logger=CSVLogger(), enable_progress_bar=False)
    assert made.log_dir == made.logger.log_dir == str(tmp_path / "lightning_logs" / "version_0")
    assert L.Trainer(default_root_dir=str(tmp_path), max_epochs=1, logger=False).log_dir == str(tmp_path)
    trainer = run(tmp_path, max_epochs=1, enable_checkpointing=False)  # the default logger
    assert trainer.log_dir == trainer.logger.log_dir == str(tmp_path / "lightning_logs" / "version_0")


def test_log_graph_adds_the_modules_graph(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class WithExample(Boring):
        def __init__(self) -> None:
            super().__init__()
            self.example_input_array = torch.zeros(2, 3)

        def forward(self, x):
            return self.net(x)

    logger = TensorBoardLogger(tmp_path, log_graph=True)
    run(tmp_path, max_epochs=1, module=WithExample(), logger=logger, enable_checkpointing=False)
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert events.Tags()["graph"] is True
