"""A short DDP fit on gloo for tests/trainer/test_hang_watchdog.py.

    trainforge launch --nproc-per-node 2 hang_run.py KIND ROOT

KIND "hang": rank 1 sleeps forever inside training_step at global step 3 (hang_timeout=1 s: from fit start
to that stall the ranks never go more than a few ms without progress).
KIND "straggler": rank 1 sleeps 50 ms per step; HangWatchdog(straggler_every=5) reports it.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule
from trainforge.callbacks import HangWatchdog


class Net(TrainingModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        rank = self.trainer.global_rank
        if self.kind == "hang" and rank == 1 and self.trainer.global_step == 3:
            while True:  # the deliberate stall
                time.sleep(1)
        if self.kind == "straggler" and rank == 1:
            time.sleep(0.05)
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(kind: str, root: str) -> None:
    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    common = dict(
        strategy="ddp",
        max_steps=20 if kind == "straggler" else 50,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        seed=0,
    )
    if kind == "hang":
        trainer = Trainer(hang_timeout=1, **common)
    else:
        trainer = Trainer(callbacks=[HangWatchdog(60, straggler_every=5)], **common)
    trainer.fit(Net(kind), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
