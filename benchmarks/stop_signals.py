"""What catching stop signals costs per step (trainer/cluster/stop_signals.py): the Trainer with
``stop_signals=()`` (nothing caught, no exchange) against its default (SIGTERM, SIGINT, SIGUSR1: one
4-byte MAX all-reduce per optimizer step, started with ``async_op=True`` and read a step later).

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/stop_signals.py
    python benchmarks/stop_signals.py                 # one process: no exchange, the handlers only

A small MLP (64-128-128-10, batch 64, AdamW, fp32; a step of 1-2 ms on one CPU thread, so the
exchange is as visible as it gets), the data in memory, ``num_workers=0``, no progress bar, tracker
or checkpoint. The variants alternate (the order rotates), each fit times ``--steps`` steps after
``--warmup``; medians per variant and the median of per-repeat ratios are printed on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from trainforge import Trainer, TrainingModule
from trainforge.callbacks import Callback


class MLP(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Clock(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end = warmup, 0.0, 0.0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def one_fit(stop_signals, steps: int, warmup: int, root: str) -> float:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64 * 64, 64), torch.randint(0, 10, (64 * 64,)))
    clock = Clock(warmup)
    trainer = Trainer(
        max_steps=warmup + steps,
        callbacks=[clock],
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=root,
        stop_signals=stop_signals,
        log_every_n_steps=10**6,
        num_sanity_val_steps=0,
    )
    trainer.fit(MLP(), torch.utils.data.DataLoader(data, batch_size=64, shuffle=True))
    return (clock.end - clock.start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default="/tmp/trainforge-bench-stop-signals")
    args = parser.parse_args()
    variants = {"off": (), "default": ("SIGTERM", "SIGINT", "SIGUSR1")}
    times: dict = {name: [] for name in variants}
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(one_fit(variants[name], args.steps, args.warmup, args.root))
    if int(os.environ.get("RANK", "0")) == 0:
        world = os.environ.get("WORLD_SIZE", "1")
        for name, values in times.items():
            print(f"{name:8s} {statistics.median(values):7.3f} ms/step  (processes: {world})")
        ratios = [d / o for d, o in zip(times["default"], times["off"])]
        print(f"default/off: {statistics.median(ratios):.3f} (median of {len(ratios)} per-repeat ratios)")


if __name__ == "__main__":
    main()
