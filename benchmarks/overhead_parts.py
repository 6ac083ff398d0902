"""Where the per-step overhead of the Accelerator and the Trainer goes: each piece timed alone.

    python benchmarks/overhead_parts.py

Companion to ``overhead.py`` (which measures whole loops). Each piece of work the Trainer or the
Accelerator adds to a step is timed in isolation with ``timeit``; the minimum over repeats is
reported (µs per step), which a busy machine disturbs least. "delta" rows are the difference to
what a raw loop does instead. The last rows time whole loops with an almost free model, so the
total overhead can be compared with the sum of the pieces (the rest is the loop's own glue:
event dispatch, step bookkeeping, property lookups).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import timeit
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the sibling benchmark: same data and loops
import overhead

from trainforge import Accelerator
from trainforge.callbacks import ProgressBar
from trainforge.strategies.data.loader import prepare_dataloader
from trainforge.trainer.loop.metrics import MetricStore


def best_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def delta_us(fn: Callable[[], object], baseline: Callable[[], object], number: int, repeat: int) -> float:
    """Best time of ``fn`` minus best time of ``baseline``, measured alternately."""
    a, b = float("inf"), float("inf")
    for _ in range(repeat):
        a = min(a, best_us(fn, number, 1))
        b = min(b, best_us(baseline, number, 1))
    return a - b


def per_batch_us(loader_factory: Callable[[], object], batches: int, repeat: int) -> float:
    """Steady-state cost of one ``next()`` (the iterator is created and warmed outside the timing)."""
    best = float("inf")
    for _ in range(repeat):
        it = iter(loader_factory())
        for _ in range(5):
            next(it)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        best = min(best, (time.perf_counter() - t0) / batches * 1e6)
    return best


def pieces(number: int, repeat: int) -> Dict[str, float]:
    acc = Accelerator(accelerator="cpu")
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    model, prepared_opt = acc.prepare(net, opt)
    loss = net(torch.ones(2)).sum()  # a scalar that requires grad, as training_step returns
    out: Dict[str, float] = {}

    out["nonfinite check: bool(torch.isfinite(loss).all())  [Trainer._check_loss]"] = best_us(
        lambda: bool(torch.isfinite(loss).all()), number, repeat
    )
    out["  (alternative: math.isfinite(loss.item()), CPU only)"] = best_us(
        lambda: math.isfinite(loss.item()), number, repeat
    )

    store = MetricStore()
    out["self.log('train/loss', loss): MetricStore.log  [trainer/loop/metrics.py]"] = best_us(
        lambda: store.log(
            "train/loss", loss, on_step=True, on_epoch=False, prog_bar=False, sync_dist=False, batch_size=1
        ),
        number,
        repeat,
    )

    def accumulate() -> None:
        with acc.accumulate(model):
            pass

    out["with accelerator.accumulate(model)  [Accelerator.accumulate]"] = best_us(accumulate, number, repeat)

    def autocast() -> None:
        with acc.autocast():
            pass

    out["with accelerator.autocast() (fp32)  [Precision.autocast]"] = best_us(autocast, number, repeat)

    def raw_step() -> None:
        opt.step()
        opt.zero_grad()

    def prepared_step() -> None:
        prepared_opt.step()
        prepared_opt.zero_grad()

    out["optimizer.step()+zero_grad() via PreparedOptimizer, delta  [trainer/accelerator/wrappers.py]"] = delta_us(
        prepared_step, raw_step, number, repeat
    )

    leaf = torch.ones((), requires_grad=True)

    def raw_backward() -> None:
        (leaf * 1.0).backward()

    def acc_backward() -> None:
        acc.backward(leaf * 1.0)

    out["accelerator.backward(loss), delta  [Accelerator/Strategy/Precision.backward]"] = delta_us(
        acc_backward, raw_backward, number, repeat
    )

    data = overhead.InMemory(64 * 520, 4, 3)
    args = SimpleNamespace(batch_size=64)
    plain = per_batch_us(lambda: overhead.make_loader(data, args), 500, repeat)
    resumable = per_batch_us(
        lambda: prepare_dataloader(overhead.make_loader(data, args), rank=0, world_size=1), 500, repeat
    )
    prepared = per_batch_us(lambda: acc.prepare_data_loader(overhead.make_loader(data, args)), 500, repeat)
    out["next(batch): ResumableDataLoader, delta  [strategies/data/loader.py, data_sampler.py]"] = resumable - plain
    out["next(batch): PreparedDataLoader on top, delta  [trainer/accelerator/wrappers.py, move_to_device]"] = (
        prepared - resumable
    )

    bar = ProgressBar(stream=overhead._TerminalSink())
    fake = SimpleNamespace(
        is_global_zero=True,
        num_training_batches=10**9,
        batch_idx=0,
        current_epoch=0,
        global_step=1,
        log_every_n_steps=50,
        _metrics={"train": MetricStore()},
    )
    bar.on_train_epoch_start(fake, None)
    out["ProgressBar.on_train_batch_end (tqdm on a terminal)  [callbacks/progress.py]"] = best_us(
        lambda: bar.on_train_batch_end(fake, None, loss, None, 0), number, repeat
    )
    bar._close()
    return out


def whole_loops(repeat: int) -> Dict[str, float]:
    """Per-step time of each loop with an almost free model (4-4-4-3 MLP) and batches of 64 (the
    data loader's cost grows with the batch size, the rest does not): the overhead."""
    args = overhead.parse_args(
        ["--d-in", "4", "--hidden", "4", "--classes", "3", "--batch-size", "64", "--steps", "300"]
    )
    args.runs, args.root = 0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".overhead_parts_runs")
    data = overhead.InMemory((args.warmup + args.steps + 2) * args.batch_size, args.d_in, args.classes)
    best: Dict[str, float] = {name: float("inf") for name in overhead.LOOPS}
    try:
        for _ in range(repeat):
            for name, loop in overhead.LOOPS.items():
                best[name] = min(best[name], loop(args, data)[1])  # CPU time
    finally:
        import shutil

        shutil.rmtree(args.root, ignore_errors=True)
    return {f"{name} loop, tiny model, batch 64 (CPU time, best of {repeat})": t * 1e6 for name, t in best.items()}


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = pieces(args.number, args.repeat)
    loops = whole_loops(args.repeat)
    print(f"\n{'us/step':>9}  piece (best of {args.repeat} x {args.number}; torch {torch.__version__})")
    for name, us in parts.items():
        print(f"{us:>9.2f}  {name}")
    print()
    for name, us in loops.items():
        print(f"{us:>9.1f}  {name}")
    raw = loops[next(k for k in loops if k.startswith("raw"))]
    for name, us in loops.items():
        if not name.startswith("raw"):
            print(f"{us - raw:>9.1f}  = {name.split(' loop')[0]} overhead per step")


if __name__ == "__main__":
    main()
