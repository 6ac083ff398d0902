"""The "stall" part of benchmarks/checkpoint.py: how long a checkpoint blocks the training loop.

    python benchmarks/checkpoint.py --stall            # an MLP of --stall-mb MB of weights (+ AdamW: x3 on disk)
    python benchmarks/checkpoint.py --stall --gpt2     # also GPT-2 124M, bf16-mixed, when CUDA is available

Three Trainer runs of the same model, data and seed, each ``--window`` optimizer steps after a warm-up:
no save; one synchronous save a third into the window; one asynchronous save there (the saving runs
also save once during the warm-up and wait for it, so the asynchronous staging buffers exist, as in
a run that saves periodically; that first save's stall is printed too). Printed:
the raw step time (median of the run without saves), the time the loop was blocked by the save
(the ``trainer.save_checkpoint`` call: the whole write when synchronous, the staging when
asynchronous), and the throughput of each window relative to the window without a save. The
asynchronous write overlaps the steps that follow it; ``fit`` waits for it at the end, outside
the window (printed as "tail"). Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainforge import Trainer, TrainingModule
from trainforge.callbacks import Callback

WARMUP = 3


class Clock(Callback):
    """perf_counter at the end of every optimizer step (after a device sync); the save's blocked time."""

    def __init__(self, save_at: Optional[int], async_save: bool, root: str) -> None:
        self.save_at, self.async_save, self.root = save_at, async_save, root
        self.ends: List[float] = []
        self.blocked: Optional[float] = None
        self.first: Optional[float] = None

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        _sync(trainer.device)
        if trainer.global_step == 1 and self.save_at is not None:  # warm-up save: staging buffers allocated here
            start = time.perf_counter()
            trainer.save_checkpoint(f"{self.root}/warm", async_save=self.async_save)
            _sync(trainer.device)
            self.first = time.perf_counter() - start
            trainer.accelerator.wait_for_checkpoint()
        if trainer.global_step == self.save_at:
            start = time.perf_counter()
            trainer.save_checkpoint(f"{self.root}/step-{self.save_at}", async_save=self.async_save)
            _sync(trainer.device)
            self.blocked = time.perf_counter() - start
        self.ends.append(time.perf_counter())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MLP(TrainingModule):
    def __init__(self, weights_mb: float, width: int = 1024) -> None:
        super().__init__()
        layers = max(1, round(weights_mb * 2**20 / 4 / (width * width + width)))
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class GPT2(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config())  # 124M, random weights

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=6e-4, fused=self.device.type == "cuda")


class Random(Dataset):
    def __init__(self, n: int, make: Any) -> None:
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.make(torch.Generator().manual_seed(i))


def one_run(
    build: Any, data: Dataset, batch: int, precision: str, window: int, save: Optional[bool], workdir: str
) -> Dict[str, Any]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="tf-stall-", dir=workdir) as root:
        save_at = WARMUP + window // 3 if save is not None else None
        clock = Clock(save_at, bool(save), root)
        trainer = Trainer(
            max_steps=WARMUP + window,
            precision=precision,
            default_root_dir=root,
            enable_progress_bar=False,
            enable_checkpointing=False,
            log_every_n_steps=10**6,
            callbacks=[clock],
        )
        trainer.fit(build(), DataLoader(data, batch_size=batch, shuffle=False))
        tail = time.perf_counter() - clock.ends[-1]
    steps = [b - a for a, b in zip(clock.ends[WARMUP - 1 :], clock.ends[WARMUP:])]
    return {
        "window": clock.ends[-1] - clock.ends[WARMUP - 1],
        "step": statistics.median(steps),
        "blocked": clock.blocked,
        "first": clock.first,
        "tail": tail,
    }


def report(name: str, build: Any, data: Dataset, batch: int, precision: str, args: argparse.Namespace) -> None:
    probe = build()
    mb = sum(p.numel() * p.element_size() for p in probe.parameters()) / 1e6
    del probe
    print(
        f"\n== stall: {name}, {mb:.0f} MB of weights (+ AdamW state: ~{3 * mb:.0f} MB per checkpoint), "
        f"precision {precision}, window of {args.window} steps, {args.repeats} repeat(s), medians =="
    )
    runs: Dict[str, List[Dict[str, Any]]] = {"none": [], "sync": [], "async": []}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits all three alike
        for kind, save in (("none", None), ("sync", False), ("async", True)):
            runs[kind].append(one_run(build, data, batch, precision, args.window, save, args.dir))

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    step, base = med("none", "step"), med("none", "window")
    sync_blocked, async_blocked = med("sync", "blocked"), med("async", "blocked")
    print(f"raw step time (no save)           {step * 1e3:10.1f} ms")
    print(f"loop blocked by a synchronous save {sync_blocked * 1e3:9.1f} ms  ({sync_blocked / step:6.1f} steps)")
    print(
        f"loop blocked by an async save      {async_blocked * 1e3:9.1f} ms  ({async_blocked / step:6.1f} steps; "
        f"{100 * async_blocked / sync_blocked:5.1f} % of the synchronous save; target <= 10 %)"
    )
    print(f"  (the run's first async save, which allocates the staging buffers: {med('async', 'first') * 1e3:.1f} ms)")
    for kind in ("sync", "async"):
        print(
            f"throughput, window with one {kind:5s} save / without: {base / med(kind, 'window'):5.3f}"
            f"  (target for async >= 0.95; tail after the window: {med(kind, 'tail') * 1e3:.0f} ms)"
        )


def part_stall(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    width = 1024
    report(
        f"MLP on {'cuda' if cuda else 'cpu'}",
        lambda: MLP(args.stall_mb, width),
        Random(16 * (WARMUP + args.window), lambda g: torch.randn(width, generator=g)),
        16,
        "bf16-mixed" if cuda else "32",
        args,
    )
    if args.gpt2:
        if not cuda:
            print("\n== stall: GPT-2 124M skipped: no CUDA device (on a CPU a step takes tens of seconds) ==")
            return
        report(
            "GPT-2 124M on cuda",
            GPT2,
            Random(8 * (WARMUP + args.window), lambda g: torch.randint(0, 50257, (1024,), generator=g)),
            8,
            "bf16-mixed",
            args,
        )
