"""A Lightning-style program run as `python lightning_devices.py OUT [fail]`: Trainer(devices=2) makes
this process rank 0 and starts rank 1 (trainer/cluster/script_launcher.py); each rank writes what it saw.
`fail`: rank 1 raises in its first step; `early`: the copy for rank 1 raises before its Trainer."""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule

if len(sys.argv) > 2 and sys.argv[2] == "early" and os.environ.get("RANK") == "1":
    # the copy started for rank 1 fails before it reaches Trainer(devices=2): rank 0 waits in native code
    raise RuntimeError("rank 1 fails before its Trainer")


class Boring(TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if len(sys.argv) > 2 and sys.argv[2] == "fail" and self.trainer.global_rank == 1:
            raise ValueError("rank 1 breaks on purpose")
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
model = Boring()
trainer = Trainer(
    devices=2,
    accelerator="cpu",
    max_epochs=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=sys.argv[1],
)
trainer.fit(model, DataLoader(data, batch_size=4))
out = {
    "rank": trainer.global_rank,
    "world_size": trainer.world_size,
    "strategy": trainer.strategy.name,
    "step": trainer.global_step,
    "weight": model.layer.weight.detach().flatten().tolist(),
    "pid": os.getpid(),
}
with open(os.path.join(sys.argv[1], f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(out, f)
