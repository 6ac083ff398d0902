"""Per-step overhead of the Accelerator and the Trainer over a raw PyTorch loop, measured side by side.

    python benchmarks/overhead.py                        # CPU, one process
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/overhead.py --ddp
    python benchmarks/overhead.py --profile trainer      # where the Trainer's time goes (cProfile)

One small MLP (64-128-128-10, batch 64: a raw step of about 1-2 ms on one CPU thread), the same
in-memory data (the dataset returns whole batches through ``__getitems__``, ``num_workers=0``),
AdamW, fp32. Three loops:

  raw          plain PyTorch (DistributedDataParallel + DistributedSampler with ``--ddp``)
  accelerator  the same loop after the five-line conversion (prepare / accumulate / backward)
  trainer      a TrainingModule under ``Trainer`` with its defaults on: progress bar (a tqdm bar
               on a terminal-like stream that writes to /dev/null), CSV tracker, end-of-fit
               checkpoint, ``self.log`` of the loss every step

Each loop timestamps the start of step ``warmup`` and of step ``warmup + steps`` with
``time.perf_counter`` (wall) and ``time.process_time`` (CPU time of the process, all threads), so
a step time covers everything between two steps (data, loop, hooks).
Repeats are interleaved (the order rotates) and medians reported; the ratio to raw is also the
median of per-repeat ratios, which is robust to the machine's load drifting between repeats.
Targets: trainer/raw <= 1.03, accelerator/raw <= 1.01. Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainforge import Accelerator, Trainer, TrainingModule
from trainforge.callbacks import ProgressBar

TARGETS = {"accelerator": 1.01, "trainer": 1.03}


class InMemory(Dataset):
    """Features and labels in memory; ``__getitems__`` hands the DataLoader a whole batch at once."""

    def __init__(self, n: int, d_in: int, n_classes: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, d_in, generator=gen)
        self.y = torch.randint(0, n_classes, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def __getitems__(self, indices: List[int]):
        idx = torch.as_tensor(indices)
        return self.x[idx], self.y[idx]


def keep_batch(batch):
    """collate_fn: ``__getitems__`` already returned the batch."""
    return batch


class StepClock:
    """Timestamps the start of step ``warmup`` and of step ``warmup + steps``: wall time
    (``perf_counter``) and the CPU time of the whole process, all threads (``process_time``), which
    other processes competing for the cores inflate far less than wall time."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.first, self.last = warmup, warmup + steps
        self.t0 = self.t1 = self.c0 = self.c1 = 0.0

    def tick(self, i: int) -> bool:
        """Call at the start of step ``i``; True once the measured window is complete."""
        if i == self.first:
            self.t0, self.c0 = time.perf_counter(), time.process_time()
        elif i == self.last:
            self.t1, self.c1 = time.perf_counter(), time.process_time()
            return True
        return False

    @property
    def per_step(self) -> Tuple[float, float]:
        """(wall seconds, CPU seconds) per step."""
        if not self.t1:
            raise RuntimeError("the loop ended before the measured window did; give the dataset more samples")
        n = self.last - self.first
        return (self.t1 - self.t0) / n, (self.c1 - self.c0) / n


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    h = args.hidden
    return nn.Sequential(nn.Linear(args.d_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, args.classes))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_loader(data: Dataset, args: argparse.Namespace, sampler=None) -> DataLoader:
    return DataLoader(
        data, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler, collate_fn=keep_batch, num_workers=0
    )


# ---- the three loops -----------------------------------------------------------------------------
def run_raw(args: argparse.Namespace, data: Dataset) -> Tuple[float, float]:
    model, sampler = make_model(args), None
    if args.ddp:
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data.distributed import DistributedSampler

        model = DistributedDataParallel(model)
        sampler = DistributedSampler(data, shuffle=True)
    optimizer, loader = make_optimizer(model), make_loader(data, args, sampler)
    clock = StepClock(args.warmup, args.steps)
    model.train()
    for i, (x, y) in enumerate(loader):
        if clock.tick(i):
            break
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return clock.per_step


def run_accelerator(args: argparse.Namespace, data: Dataset) -> Tuple[float, float]:
    accelerator = Accelerator(strategy="ddp" if args.ddp else None, accelerator="cpu")  # line 1
    model = make_model(args)
    optimizer = make_optimizer(model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(data, args))  # line 2
    clock = StepClock(args.warmup, args.steps)
    model.train()
    for i, (x, y) in enumerate(loader):
        if clock.tick(i):
            break
        with accelerator.accumulate(model):  # line 3
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)  # line 4
            optimizer.step()
            optimizer.zero_grad()
    return clock.per_step


class Classifier(TrainingModule):
    def __init__(self, net: nn.Module, clock: StepClock) -> None:
        super().__init__()
        self.net, self.clock = net, clock

    def training_step(self, batch, batch_idx):
        self.clock.tick(batch_idx)
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self)


class _TerminalSink:
    """A stream that says it is a terminal (so the tqdm bar runs, as at a console) and discards."""

    def __init__(self) -> None:
        # open for the sink's life, as a terminal is
        self._null = open(os.devnull, "w")  # noqa: SIM115

    def write(self, text: str) -> int:
        return self._null.write(text)

    def flush(self) -> None:
        self._null.flush()

    def isatty(self) -> bool:
        return True


def run_trainer(args: argparse.Namespace, data: Dataset) -> Tuple[float, float]:
    clock = StepClock(args.warmup, args.steps)
    args.runs += 1
    root = os.path.join(args.root, f"run{args.runs}")  # the same directory on every rank
    trainer = Trainer(
        accelerator="cpu",
        strategy="ddp" if args.ddp else None,
        max_steps=args.warmup + args.steps + 1,
        default_root_dir=root,
        callbacks=[ProgressBar(stream=_TerminalSink())],
    )
    trainer.fit(Classifier(make_model(args), clock), make_loader(data, args))
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        shutil.rmtree(root, ignore_errors=True)
    return clock.per_step


LOOPS: Dict[str, Callable[[argparse.Namespace, Dataset], Tuple[float, float]]] = {
    "raw": run_raw,
    "accelerator": run_accelerator,
    "trainer": run_trainer,
}


# ---- driver --------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> Dict[str, Dict[str, List[float]]]:
    """{"wall"|"cpu": {loop: [seconds per step, one per repeat]}}"""
    world = dist.get_world_size() if args.ddp else 1
    data = InMemory((args.warmup + args.steps + 2) * args.batch_size * world, args.d_in, args.classes)
    names = list(LOOPS)
    times: Dict[str, Dict[str, List[float]]] = {"wall": {n: [] for n in names}, "cpu": {n: [] for n in names}}
    for r in range(args.warmup_repeats + args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no loop always runs first
        for name in order:
            gc.collect()
            wall, cpu = LOOPS[name](args, data)
            if args.ddp:  # the slowest rank's times (the ranks run in lockstep anyway)
                t = torch.tensor([wall, cpu], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                wall, cpu = t.tolist()
            if r >= args.warmup_repeats:
                times["wall"][name].append(wall)
                times["cpu"][name].append(cpu)
    return times


def report(times: Dict[str, Dict[str, List[float]]], args: argparse.Namespace) -> None:
    mode = "DDP, 2 processes, gloo" if args.ddp else f"1 process, {torch.get_num_threads()} thread(s)"
    print(
        f"\noverhead benchmark ({mode}): {args.repeats} interleaved repeats x {args.steps} steps "
        f"(after {args.warmup} warmup steps), batch {args.batch_size}, MLP {args.d_in}-{args.hidden}-"
        f"{args.hidden}-{args.classes}, torch {torch.__version__}"
    )
    for clock, label in (("wall", "wall time (perf_counter)"), ("cpu", "CPU time of the process (process_time)")):
        raw = times[clock]["raw"]
        print(f"\n{label}")
        print(
            f"{'loop':<13}{'median ms/step':>15}{'min':>9}{'max':>9}{'+us/step':>10}{'ratio (medians)':>17}"
            f"{'ratio (paired)':>16}  target"
        )
        for name, values in times[clock].items():
            med = statistics.median(values)
            ratio = med / statistics.median(raw)
            paired = statistics.median(v / r for v, r in zip(values, raw))
            target = TARGETS.get(name)
            verdict = "" if target is None else f"<= {target:.2f} {'ok' if paired <= target else 'MISSED'}"
            print(
                f"{name:<13}{med * 1e3:>15.4f}{min(values) * 1e3:>9.4f}{max(values) * 1e3:>9.4f}"
                f"{(med - statistics.median(raw)) * 1e6:>10.1f}{ratio:>17.4f}{paired:>16.4f}  {verdict}"
            )


def profile(args: argparse.Namespace, which: str) -> None:
    """cProfile ``which`` and the raw loop; print the functions whose own time per step grew most."""
    import cProfile
    import pstats

    data = InMemory((args.warmup + args.steps + 2) * args.batch_size, args.d_in, args.classes)
    total_steps = args.warmup + args.steps + 1
    per_step: Dict[str, Dict[str, Tuple[float, float, float]]] = {}
    for name in ("raw", which):
        LOOPS[name](args, data)  # warm
        prof = cProfile.Profile()
        prof.enable()
        LOOPS[name](args, data)
        prof.disable()
        per_step[name] = {
            f"{_short(f)}:{line}({func})": (tt / total_steps * 1e6, ct / total_steps * 1e6, nc / total_steps)
            for (f, line, func), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()
        }  # type: ignore
    base, prof_rows = per_step["raw"], per_step[which]
    rows = sorted(
        ((own - base.get(k, (0.0,))[0], own, cum, calls, k) for k, (own, cum, calls) in prof_rows.items()), reverse=True
    )
    print(
        f"\ncProfile of '{which}' vs 'raw' ({total_steps} steps each; cProfile inflates small Python "
        "functions, so read the list as where, not how much)"
    )
    print(f"{'+own us/step':>13}{'own':>9}{'cum':>9}{'calls/step':>11}  function")
    for delta, own, cum, calls, name in rows[: args.profile_top]:
        print(f"{delta:>13.1f}{own:>9.1f}{cum:>9.1f}{calls:>11.2f}  {name}")


def _short(path: str) -> str:
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="raw loop vs Accelerator vs Trainer: per-step overhead")
    p.add_argument("--ddp", action="store_true", help="run under torch.distributed.run with 2 processes")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup-repeats", type=int, default=1, help="untimed rounds first (imports, allocator)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=30, help="untimed steps before the timed ones")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--d-in", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on a busy machine)")
    p.add_argument(
        "--profile",
        choices=("accelerator", "trainer"),
        default=None,
        help="cProfile this loop and the raw one instead, and list where the time differs",
    )
    p.add_argument("--profile-top", type=int, default=35)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.ddp:
        if "RANK" not in os.environ:
            sys.exit(
                "--ddp: start with python -m torch.distributed.run --standalone --nproc-per-node 2 "
                "benchmarks/overhead.py --ddp"
            )
        dist.init_process_group("gloo")
    args.runs, root = 0, [tempfile.mkdtemp(prefix="tf-overhead-") if not args.ddp or dist.get_rank() == 0 else None]
    if args.ddp:
        dist.broadcast_object_list(root, src=0)  # one directory for the Trainer's checkpoints, seen by all ranks
    args.root = root[0]
    try:
        if args.profile:
            profile(args, args.profile)
            return
        times = measure(args)
        if not args.ddp or dist.get_rank() == 0:
            report(times, args)
    finally:
        if not args.ddp or dist.get_rank() == 0:
            shutil.rmtree(args.root, ignore_errors=True)
        if args.ddp:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
