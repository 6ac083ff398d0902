"""A Trainer run with ModelCheckpoint(every_n_steps=2), for tests/trainer/test_one_writer.py.

    python tests/scripts/one_writer_run.py ROOT STEPS LR [hold]

One process or several (DDP on gloo, started by the test's launcher); resume="auto". With ``hold``, global
rank 0 writes ``ROOT.at2`` when step 2 ends and waits there until ``ROOT.go`` exists, so that a second run can be
started while this one holds the run. Every rank prints ``refused: <message>`` and exits 3 when the run's
directory is in use by another process; otherwise ``done <step>``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Trainer, TrainingModule
from trainforge.callbacks import Callback, CSVLogger, ModelCheckpoint
from trainforge.strategies.errors import CheckpointError


class Tiny(TrainingModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class HoldAtStep2(Callback):
    def __init__(self, root: str) -> None:
        self.root = root

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step != 2 or not trainer.is_global_zero:
            return
        open(f"{self.root}.at2", "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{self.root}.go") and time.monotonic() < deadline:
            time.sleep(0.05)


def main() -> None:
    root, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    hold = sys.argv[4:] == ["hold"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    callbacks = [ModelCheckpoint(every_n_steps=2)] + ([HoldAtStep2(root)] if hold else [])
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(
        default_root_dir=root,
        max_steps=steps,
        log_every_n_steps=1,
        enable_progress_bar=False,
        callbacks=callbacks,
        logger=CSVLogger(),  # <root>/lightning_logs/version_0: metrics and checkpoints (resume="auto": the newest)
        resume="auto",
        strategy="ddp" if devices > 1 else "auto",
        devices=devices,
        accelerator="cpu",
    )
    try:
        trainer.fit(Tiny(lr), data)
    except CheckpointError as e:
        print(f"refused: {e}", flush=True)
        sys.exit(3)
    print("done", trainer.global_step, flush=True)


if __name__ == "__main__":
    main()
