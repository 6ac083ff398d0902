"""Two ranks (DDP on gloo) agree on a logger's version_<N>, for tests/callbacks/test_lightning_loggers.py.

    python tests/scripts/lightning_loggers_ranks.py ROOT     (under the test's launcher, 2 ranks)

Rank 0 reads ``logger.version`` before fit (version_0, the folder is empty), then other runs' folders
``version_1``/``version_2`` appear; only then does rank 1 build its Trainer, whose own listing would pick
version_3. Each rank writes ``ROOT/rank<R>.json``: its logger's ``log_dir`` and the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Trainer, TrainingModule
from trainforge.lightning.loggers import CSVLogger


class Tiny(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(root: str) -> None:
    rank = int(os.environ["RANK"])
    logger = CSVLogger(root)
    ready = os.path.join(root, "others-ready")
    if rank == 0:
        assert logger.version == 0  # read before fit: fixed on this rank
        for n in (1, 2):
            os.makedirs(os.path.join(root, "lightning_logs", f"version_{n}"))
        open(ready, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.02)
    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        max_epochs=1,
        log_every_n_steps=1,
        default_root_dir=root,
        enable_progress_bar=False,
        logger=logger,
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g)
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    seen = {"log_dir": logger.log_dir, "checkpoints": trainer.default_checkpoint_dir, "version": logger.version}
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1])
