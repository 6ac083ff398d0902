"""A job SLURM started again resumes its own run (trainer/cluster/slurm_requeue.py): checkpoints record the SLURM
job that wrote them, and a restarted job resumes the newest one it wrote, never another run's newer one in the
same directory, and says which it resumed and which it left alone."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule
from trainforge.callbacks import Callback, ModelCheckpoint
from trainforge.strategies.checkpoint.io import read_metadata


class Tiny(TrainingModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class FirstStep(Callback):
    """The global step the fit started from."""

    def __init__(self) -> None:
        self.first = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.first is None:
            self.first = trainer.global_step


def fit(root, max_steps: int, lr: float = 0.1) -> FirstStep:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    first = FirstStep()
    trainer = Trainer(
        default_root_dir=str(root),
        max_steps=max_steps,
        enable_progress_bar=False,
        logger=False,
        callbacks=[ModelCheckpoint(every_n_steps=2), first],
    )
    trainer.fit(Tiny(lr), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    return first


def in_job(monkeypatch, job: str | None, restarts: int = 0) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_JOB_NAME", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    if job is not None:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))


def test_a_restarted_job_resumes_its_own_checkpoint_not_a_newer_one_of_another_run(tmp_path, monkeypatch, caplog):
    in_job(monkeypatch, "999")
    fit(tmp_path, 4)
    own = tmp_path / "checkpoints" / "epoch=0-step=4"
    assert read_metadata(own)["slurm_job"] == "999"
    # another run in the same folder, outside SLURM, writes newer checkpoints beside
    in_job(monkeypatch, None)
    fit(tmp_path, 6, lr=0.5)
    newest = max((p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("epoch")), key=read_step)
    assert read_metadata(newest)["slurm_job"] is None and read_step(newest) == 6
    in_job(monkeypatch, "999", restarts=1)
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        first = fit(tmp_path, 8)
    assert first.first == 4
    assert f"SLURM job 999 was started again (SLURM_RESTART_COUNT=1): it resumes from {own}" in caplog.text
    assert f"the newest checkpoint there, {newest}, was written by a run outside SLURM" in caplog.text


def test_a_restarted_job_that_wrote_nothing_starts_fresh_and_names_the_other_run(tmp_path, monkeypatch, caplog):
    in_job(monkeypatch, "41")
    fit(tmp_path, 4)
    in_job(monkeypatch, "999", restarts=2)
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        first = fit(tmp_path, 2)
    assert first.first == 0
    assert "SLURM job 999 was started again (SLURM_RESTART_COUNT=2): it resumes from scratch" in caplog.text
    assert "epoch=0-step=4, was written by SLURM job 41 and is not this job's" in caplog.text


def read_step(path) -> int:
    return int(read_metadata(path)["step"])
