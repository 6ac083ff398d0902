"""One training run for the resume tests; every rank records the sample ids of each global step.

  --kill-at S        SIGKILL this process (rank --kill-rank) right after the checkpoint of step S
  --kill-marker F    ... only if F does not exist yet (created first): for elastic restarts
  --resume           Trainer(resume="auto"): continue from the newest valid checkpoint
  --strategy S       Trainer(strategy=S), e.g. ddp or fsdp (default: auto)
  --async-save       ModelCheckpoint(async_save=True): a kill may land while a save is being written
  --step-sleep S     sleep S seconds after each step (a test signals the run between two steps)
  --pid-file F       every rank writes its pid to F.rank<R> at fit start (a test signals one rank)
  --stop-signals L   Trainer(stop_signals=L.split(",")); a stopped run exits with TrainingStopped's code
The per-process batch is --global-batch // world size, so the global batch is preserved on any
number of processes. Rank 0 writes the final weights to ROOT/final.safetensors.
"""

import argparse
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers.models import make_net
from trainforge import Trainer, TrainingModule, seed_everything
from trainforge.callbacks import Callback, ModelCheckpoint


class Indexed(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        # random augmentation in the DataLoader workers (torch, python, numpy): a resumed worker must
        # continue its random streams where its last batch before the checkpoint left them
        noise = 0.1 * (torch.rand(8) + random.random() + float(np.random.rand()))
        return torch.tensor(i), self.x[i] + noise, self.y[i]


class Model(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = make_net(dropout=0.2)  # dropout: the RNG stream must resume exactly too

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        self.trainer._ids = idx.tolist()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return opt, {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 4, 0.7), "interval": "step"}


class Record(Callback):
    """Appends {step, ids, loss} per optimizer step to a per-rank JSON-lines file (flushed)."""

    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open(f"{self.path}.rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "ids": trainer._ids, "loss": float(outputs)}) + "\n")


class Pace(Callback):
    """--step-sleep / --pid-file: a run slow enough, and findable enough, to be signalled mid-way."""

    def __init__(self, sleep, pid_file):
        self.sleep, self.pid_file = sleep, pid_file

    def on_train_start(self, trainer, module):
        if self.pid_file:
            with open(f"{self.pid_file}.rank{trainer.global_rank}", "w") as f:
                f.write(str(os.getpid()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        time.sleep(self.sleep)


class KillSwitch(Callback):
    def __init__(self, step, rank, marker):
        self.step, self.rank, self.marker = step, rank, marker

    # At the next batch's start: at a batch's end the checkpointing callbacks run last, so a kill there
    # would come before step S's checkpoint is written (and a resume would start over, proving nothing).
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            if self.marker:
                if os.path.exists(self.marker):
                    return
                open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--max-epochs", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--kill-marker", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--precision", default=None)
    p.add_argument("--print-device", action="store_true")
    p.add_argument("--strategy", default=None)
    p.add_argument("--async-save", action="store_true", help="ModelCheckpoint(async_save=True)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pid-file", default=None)
    p.add_argument("--stop-signals", default=None, help="comma-separated; default: the Trainer's")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    seed_everything(0)
    model = Model()
    callbacks = [ModelCheckpoint(every_n_steps=a.ckpt_every, async_save=a.async_save or None), Record(a.record)]
    if a.kill_at is not None:
        callbacks.append(KillSwitch(a.kill_at, a.kill_rank, a.kill_marker))
    if a.step_sleep or a.pid_file:
        callbacks.append(Pace(a.step_sleep, a.pid_file))
    stops = {} if a.stop_signals is None else {"stop_signals": a.stop_signals.split(",")}
    trainer = Trainer(
        max_steps=a.max_steps,
        max_epochs=a.max_epochs,
        log_every_n_steps=1,
        callbacks=callbacks,
        default_root_dir=a.root,
        enable_progress_bar=False,
        logger=False,  # checkpoints in ROOT/checkpoints (a logger's would be in its version folder)
        resume="auto" if a.resume else None,
        precision=a.precision,
        strategy=a.strategy,
        **stops,
    )
    if a.print_device:
        print(f"device: {trainer.device}")
    loader = DataLoader(Indexed(a.n), batch_size=a.global_batch // world, shuffle=True, num_workers=a.workers)
    trainer.fit(model, loader)
    # every rank calls it (FSDP gathers the shards); for the other strategies it is model.state_dict()
    state = trainer.strategy.module_state_dict(trainer.model)
    if trainer.is_global_zero:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(a.root, "final.safetensors"))


if __name__ == "__main__":
    main()
