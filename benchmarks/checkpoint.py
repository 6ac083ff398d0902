"""Checkpoint benchmarks: measured side by side in one run and printed, never asserted.

    python benchmarks/checkpoint.py                       # every part, ~500 MB state
    python benchmarks/checkpoint.py --size-mb 50 --repeats 3 --parts save_load

Parts (each a function ``part(args) -> None`` registered in ``PARTS``; add new ones there):
  save_load  a model + Adam-like optimizer state (1/3 weights, 2/3 moments, float32) written and
             read with trainforge's CheckpointWriter / load_tensors / load_object against plain
             ``torch.save`` / ``torch.load(weights_only=True)`` of the same state. Ours fsyncs every
             file and checksums it, so ``torch.save`` is also timed followed by an fsync. Loads
             read files the save just wrote (page cache warm): they measure decoding and copying,
             not the disk. Repeats are interleaved (method order rotates) and medians reported.
  resume     time to the first batch after loading a loader position.
  stall      (``--stall``, ``--gpt2``) how long a save blocks the Trainer's loop, synchronous vs
             asynchronous, next to the raw step time and the throughput of a window with one save
             (benchmarks/checkpoint_stall.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
from checkpoint_stall import part_stall  # beside this script

from trainforge.strategies.checkpoint.io import CheckpointWriter, load_object, load_tensors, verify_checkpoint


def make_state(size_mb: float) -> Tuple[Dict[str, torch.Tensor], Dict[str, object]]:
    """(model state dict, optimizer-like state dict) of about ``size_mb`` MiB in total, float32,
    in tensors of up to 4 MiB (a mid-sized transformer's matrices)."""
    params_bytes = size_mb * 2**20 / 3
    tensor_mb = min(4.0, size_mb / 30)
    numel = max(1, int(tensor_mb * 2**20 / 4))
    count = max(1, round(params_bytes / (numel * 4)))
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(numel, generator=gen) for i in range(count)}
    optim = {
        "state": {
            i: {
                "step": torch.tensor(10.0),
                "exp_avg": torch.randn(numel, generator=gen),
                "exp_avg_sq": torch.rand(numel, generator=gen),
            }
            for i in range(count)
        },
        "param_groups": [
            {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(range(count))}
        ],
    }
    return model, optim


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def part_save_load(args: argparse.Namespace) -> None:
    model, optim = make_state(args.size_mb)
    total = sum(t.numel() * t.element_size() for t in model.values()) * 3
    print(
        f"\n== save/load: {len(model)} weight tensors + Adam moments = {total / 2**20:.0f} MiB, "
        f"{args.repeats} interleaved repeats =="
    )
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    plain, ours = work / "plain.pt", work / "ours"
    # Every save writes a fresh name; the previous output is deleted outside the timed region, so
    # neither side pays for freeing the blocks of what it replaces.

    def torch_save() -> None:
        torch.save({"model": model, "optimizer": optim}, plain)

    def torch_save_fsync() -> None:
        torch_save()
        _fsync_file(plain)

    def ours_save() -> None:
        w = CheckpointWriter(ours / "step-1")
        w.save_tensors("model", model)
        w.save_object("optimizer", optim)
        w.finalize({"step": 1})

    def torch_load() -> None:
        torch.load(plain, map_location="cpu", weights_only=True)

    def ours_load() -> None:
        load_tensors(ours / "step-1", "model")
        load_object(ours / "step-1", "optimizer")

    def ours_verify_load() -> None:
        verify_checkpoint(ours / "step-1")
        ours_load()

    saves = {"torch.save": torch_save, "torch.save+fsync": torch_save_fsync, "trainforge save": ours_save}
    loads = {
        "torch.load(weights_only)": torch_load,
        "trainforge load": ours_load,
        "trainforge verify+load": ours_verify_load,
    }
    times: Dict[str, List[float]] = {name: [] for name in (*saves, *loads)}
    try:
        for r in range(args.repeats):
            order = list(saves)[r % 3 :] + list(saves)[: r % 3]
            for name in order:
                plain.unlink(missing_ok=True)
                shutil.rmtree(ours, ignore_errors=True)
                times[name].append(_time(saves[name]))
            torch_save()  # both files exist for the loads
            ours_save()
            order = list(loads)[r % 3 :] + list(loads)[: r % 3]
            for name in order:
                times[name].append(_time(loads[name]))
        disk = sum(p.stat().st_size for p in (ours / "step-1").rglob("*") if p.is_file())
        print(f"on disk: torch.save {plain.stat().st_size / 2**20:.1f} MiB, trainforge {disk / 2**20:.1f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, value in med.items():
        runs = ", ".join(f"{t:.3f}" for t in times[name])
        print(f"  {name:26s} median {value:7.3f} s  {total / 2**30 / value:6.2f} GiB/s   runs: {runs}")
    print(f"  ratio save  trainforge / torch.save        = {med['trainforge save'] / med['torch.save']:.2f}")
    print(f"  ratio save  trainforge / torch.save+fsync  = {med['trainforge save'] / med['torch.save+fsync']:.2f}")
    print(
        f"  ratio load  trainforge / torch.load        = {med['trainforge load'] / med['torch.load(weights_only)']:.2f}"
    )
    print(
        f"  ratio load  trainforge verify+load / torch.load = "
        f"{med['trainforge verify+load'] / med['torch.load(weights_only)']:.2f}"
    )


class _CountingDataset(torch.utils.data.Dataset):
    """A large map-style dataset whose items cost nothing to make; counts the items loaded."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded += 1
        return torch.full((16,), float(i))


def _prepared_loader(n: int, workers: int):
    from torch.utils.data import DataLoader

    from trainforge import Accelerator

    dataset = _CountingDataset(n)
    loader = Accelerator().prepare(DataLoader(dataset, batch_size=8, shuffle=True, num_workers=workers))
    return dataset, loader


def part_resume(args: argparse.Namespace) -> None:
    """Time from 'load the saved position' to 'first batch in hand' at batch 10 and batch 10,000 of
    a 1M-sample dataset, next to the naive resume that iterates past the batches already seen."""
    n = 1_000_000
    print(f"\n== resume: time to the first batch after loading the position ({n:,} samples, batch 8) ==")
    for workers in (0, 2):
        results = {}
        for position in (10, 10_000):
            _, loader = _prepared_loader(n, workers)
            it = iter(loader)
            for _ in range(position):
                next(it)
            state = loader.state_dict()
            expected = next(it)
            times, naive, loaded = [], [], 0
            for _ in range(args.repeats):
                dataset, fresh = _prepared_loader(n, workers)
                t0 = time.perf_counter()
                fresh.load_state_dict(state, world_size=1, rank=0)
                got = next(iter(fresh))
                times.append(time.perf_counter() - t0)
                assert torch.equal(got, expected), "resumed at the wrong batch"
                loaded = dataset.loaded if workers == 0 else -1
                _, skip = _prepared_loader(n, workers)
                t0 = time.perf_counter()
                skip_it = iter(skip)
                for _ in range(position + 1):
                    got = next(skip_it)
                naive.append(time.perf_counter() - t0)
            results[position] = (statistics.median(times), statistics.median(naive), loaded)
        (t10, n10, l10), (t10k, n10k, l10k) = results[10], results[10_000]
        print(
            f"num_workers={workers}: ours {t10 * 1e3:8.2f} ms at batch 10, {t10k * 1e3:8.2f} ms at batch 10,000"
            f" (ratio {t10k / t10:5.2f}); iterating past the seen batches: {n10 * 1e3:8.2f} ms vs"
            f" {n10k * 1e3:9.2f} ms (ratio {n10k / n10:6.1f})"
            + (f"; items loaded on resume: {l10} vs {l10k}" if workers == 0 else "")
        )


PARTS: Dict[str, Callable[[argparse.Namespace], None]] = {
    "save_load": part_save_load,
    "resume": part_resume,
    "stall": part_stall,
}
DEFAULT_PARTS = ["save_load", "resume"]  # "stall" trains a model: asked for with --stall


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="trainforge checkpoint benchmarks (timings printed, not asserted)")
    parser.add_argument("--size-mb", type=float, default=500.0, help="total state size for save_load (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per method (median reported)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=DEFAULT_PARTS, help="which parts to run")
    parser.add_argument("--stall", action="store_true", help="run only the stall part (sync vs async saves)")
    parser.add_argument("--gpt2", action="store_true", help="stall: also GPT-2 124M (needs CUDA)")
    parser.add_argument("--stall-mb", type=float, default=100.0, help="stall: MB of MLP weights (x3 with AdamW)")
    parser.add_argument("--window", type=int, default=30, help="stall: measured optimizer steps per run")
    args = parser.parse_args(argv)
    if args.size_mb <= 0 or args.repeats < 1 or args.stall_mb <= 0 or args.window < 3:
        parser.error(
            f"--size-mb={args.size_mb} and --stall-mb={args.stall_mb} must be > 0, --repeats={args.repeats}"
            f" >= 1 and --window={args.window} >= 3"
        )
    if args.stall:
        args.parts = ["stall"]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, writing under {args.dir or tempfile.gettempdir()}")
    for name in args.parts:
        PARTS[name](args)


if __name__ == "__main__":
    main()
