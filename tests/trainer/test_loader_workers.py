"""A fit that stops mid-epoch stops its DataLoader workers when it returns, keeping the position.

Before, the workers lived until the Trainer was garbage-collected (the Trainer and its Accelerator
refer to each other), and torch's shutdown of a collected iterator then waited about 5 s per worker,
often inside some later, unrelated test."""

from __future__ import annotations

import time

import psutil
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule


class _Reg(TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _workers() -> list:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def test_fit_stopped_mid_epoch_stops_its_workers_and_keeps_the_position(tmp_path):
    before = len(_workers())
    data = TensorDataset(torch.randn(48, 2), torch.randn(48, 1))
    trainer = Trainer(max_steps=3, enable_progress_bar=False, logger=False, default_root_dir=str(tmp_path))
    trainer.fit(_Reg(), DataLoader(data, batch_size=4, num_workers=2, shuffle=True))
    deadline = time.monotonic() + 10
    while len(_workers()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_workers()) == before, "the DataLoader workers outlived fit"
    state = trainer.train_dataloader.loader.state_dict()
    assert (state["epoch"], state["consumed"]) == (0, 12)  # 3 batches of 4: where a resume continues
    path = trainer.save_checkpoint(str(tmp_path / "after_fit"))
    resumed = Trainer(max_steps=4, enable_progress_bar=False, logger=False, default_root_dir=str(tmp_path))
    seen = []

    class _Seen(_Reg):
        def training_step(self, batch, batch_idx):
            seen.append(batch_idx)
            return super().training_step(batch, batch_idx)

    resumed.fit(_Seen(), DataLoader(data, batch_size=4, num_workers=2, shuffle=True), ckpt_path=str(path))
    assert seen == [3]  # the saved position survived the workers' shutdown
