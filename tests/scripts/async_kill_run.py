"""Trainer runs with an asynchronous save after every step, for tests/trainer/test_async_checkpoint.py.

    python tests/scripts/async_kill_run.py

A fork server (it pays the torch/trainforge import once, and runs no torch op before forking).
Stdin lines:
    run ROOT LOG RESUME     fork a child: one fit (RESUME=1: Trainer(resume="auto")); answers ``pid P``
    reap P                  wait for child P; answers ``status S`` (the raw wait status)
The child's output goes to LOG: ``started`` when the loop starts, ``committed N`` whenever
``latest`` names a newer step (seen at the end of a step), ``done`` at the end; the final weights go
to ROOT/final.safetensors. A few MB of weights and AdamW state, dropout on, 12 steps,
ModelCheckpoint(every_n_steps=1, keep_last_k=2, async_save=True).
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path

import torch

# imported by the first optimizer: paid once here, not in every child
import torch._dynamo
import torch.distributed.checkpoint.staging
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Trainer, TrainingModule, seed_everything
from trainforge.callbacks import Callback, ModelCheckpoint
from trainforge.strategies.checkpoint.io import read_latest_pointer

DIM = 384


class Model(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.Tanh(), nn.Dropout(0.1), nn.Linear(4 * DIM, DIM))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ReportCommits(Callback):
    def __init__(self, root: Path) -> None:
        self.root, self.seen = root, -1

    def on_fit_start(self, trainer, module):
        print("started", flush=True)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        name = read_latest_pointer(self.root)
        step = int(re.search(r"step=(\d+)", name).group(1)) if name else -1
        if step > self.seen:
            self.seen = step
            print(f"committed {step}", flush=True)


def run(root: Path, resume: bool) -> None:
    torch.set_num_threads(1)
    seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, DIM, generator=g), torch.randn(64, DIM, generator=g))
    model = Model()
    ckpts = root / "checkpoints"
    trainer = Trainer(
        max_steps=12,
        default_root_dir=str(root),
        enable_progress_bar=False,
        log_every_n_steps=1,
        resume="auto" if resume else None,
        callbacks=[
            ModelCheckpoint(dirpath=str(ckpts), every_n_steps=1, keep_last_k=2, async_save=True),
            ReportCommits(ckpts),
        ],
    )
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "final.safetensors"))
    print("done", flush=True)


def serve() -> None:
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["reap"]:
            _, status = os.waitpid(int(words[1]), 0)
            print(f"status {status}", flush=True)
            continue
        _, root, log, resume = words
        pid = os.fork()
        if pid == 0:  # child: one fit, output to its log file, never returns into the server
            code = 0
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdin.close()
                run(Path(root), resume == "1")
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(f"pid {pid}", flush=True)


if __name__ == "__main__":
    print("ready", flush=True)
    serve()
