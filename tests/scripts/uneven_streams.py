"""2 processes, an IterableDataset whose ranks do not get the same number of batches ("longer": a
stream longer on rank 1 with the same first sample; "empty": a self-sharded stream empty on rank 1).
Must stop with trainforge's error on every rank instead of hanging until the process-group timeout.

    torchrun --nproc-per-node 2 uneven_streams.py longer|empty ROOT
"""

import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from trainforge import Trainer, TrainingModule

RANK = int(os.environ["RANK"])


class Longer(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(8 if RANK == 0 else 40):
            x = torch.randn(4, generator=g)
            yield x, x.sum(0, keepdim=True)


class EmptyOnRank1(IterableDataset):
    shards_by_rank = True

    def __iter__(self):
        for i in range(0 if RANK == 1 else 8):
            x = torch.full((4,), float(i))
            yield x, x.sum(0, keepdim=True)


class Reg(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


data = {"longer": Longer, "empty": EmptyOnRank1}[sys.argv[1]]()
trainer = Trainer(
    strategy="ddp", max_epochs=1, default_root_dir=sys.argv[2], enable_progress_bar=False, enable_checkpointing=False
)
trainer.fit(Reg(), DataLoader(data, batch_size=2))
print("RANK", RANK, "finished", trainer.global_step, flush=True)
