"""Ranks that disagree on what the training loop exchanges, run on 2 processes by
tests/trainer/test_rank_agreement.py (``python rank_disagreement.py MODE``):

- ``items-first``: rank 0 returns ``{"loss", "num_items"}``, rank 1 a plain loss, from the first step;
- ``items-later``: both return ``num_items`` until global step 2, then rank 1 a plain loss;
- ``none``: rank 1's training_step returns None (skips) at its second batch;
- ``nonfinite``: rank 1's loss is inf at its second batch, with ``nonfinite_loss="skip"`` (both ranks skip it);
- ``batches``: rank 0's loader has 4 batches per epoch, rank 1's 3 (a batch sampler of the user's).

Each rank prints ``rank R finished step S skipped K weight W`` when fit returns."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule

MODE = sys.argv[1]


class Model(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        rank, step = self.trainer.global_rank, self.trainer.global_step
        summed = F.mse_loss(self.layer(x), y, reduction="sum")
        if MODE.startswith("items"):
            plain = rank == 1 and (MODE == "items-first" or step >= 2)
            return summed / len(x) if plain else {"loss": summed, "num_items": len(x)}
        if MODE == "none" and rank == 1 and batch_idx == 1:
            return None
        if MODE == "nonfinite" and rank == 1 and batch_idx == 1:
            return summed * float("inf")
        return summed / len(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
x = torch.randn(32, 4, generator=g)
data = TensorDataset(x, x.sum(1, keepdim=True))
trainer = Trainer(
    max_epochs=1,
    strategy="ddp",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    nonfinite_loss="skip" if MODE == "nonfinite" else "raise",
)
if MODE == "batches":  # the user's own batches: rank 0 gets 4, rank 1 gets 3
    count = 4 if int(__import__("os").environ["RANK"]) == 0 else 3
    loader = DataLoader(data, batch_sampler=[list(range(4 * i, 4 * i + 4)) for i in range(count)])
else:
    loader = DataLoader(data, batch_size=4)
model = Model()
trainer.fit(model, loader)
weight = [round(v, 6) for v in model.layer.weight.flatten().tolist()]
print(
    f"rank {trainer.global_rank} finished step {trainer.global_step} skipped "
    f"{trainer.progress.skipped_nonfinite} weight {weight}",
    flush=True,
)
