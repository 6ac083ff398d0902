"""activation_checkpointing modes vs none: bytes kept for backward and step time, one GPT, one run.

    python benchmarks/activation_memory.py                      # CPU, ~2 min on 2 cores
    python benchmarks/activation_memory.py --device cuda        # a GPU: device bytes fall for offload too

Each mode is applied the way the strategies apply it (``SingleDeviceStrategy(activation_checkpointing=...)
.setup_module``) to copies of one ``PlainGPT`` (benchmarks/plain_gpt.py). Bytes: storage bytes saved for
backward by one forward (``trainforge.strategies.activation_memory.measure_saved_bytes``: autograd's
saved-tensor hooks, plus the outputs the op-level mode caches, plus checkpointed blocks' inputs;
parameters not counted, a storage shared by several views once), split into those left in the
compute device's memory and those moved to host memory. Time: forward + backward + AdamW step,
repeats interleaved with the order of the modes rotating, medians of per-repeat ratios to "none"
(CPU time of the process, which other processes on a shared machine inflate less than wall time).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_gpt import PlainGPT

from trainforge.strategies import SingleDeviceStrategy
from trainforge.strategies.activation_memory import measure_saved_bytes

MODES = ("none", "full", "selective:2", "op", "offload")


def build(base: torch.nn.Module, mode: str, device: str) -> torch.nn.Module:
    strategy = SingleDeviceStrategy(device, activation_checkpointing=None if mode == "none" else mode)
    strategy.setup_environment()
    return strategy.setup_module(copy.deepcopy(base))


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> Dict[str, int]:
    with measure_saved_bytes() as saved:
        loss = model(ids, ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {"device": saved.device, "host": saved.host}


def step_times(model: torch.nn.Module, ids: torch.Tensor, steps: int, device: str) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    model(ids, ids).loss.backward()  # warm-up
    opt.zero_grad(set_to_none=True)
    sync()
    start = clock()
    for _ in range(steps):
        model(ids, ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return (clock() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: no spinning threads in CPU time)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = PlainGPT(args.vocab, args.layers, args.dim, args.heads, args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    models = {mode: build(base, mode, args.device) for mode in MODES}
    memory = {mode: saved_bytes(models[mode], ids) for mode in MODES}
    times: Dict[str, List[float]] = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for mode in order:
            times[mode].append(step_times(models[mode], ids, args.steps, args.device))
    ratios = {m: statistics.median(t / n for t, n in zip(times[m], times["none"])) for m in MODES}
    clock = "wall" if args.device.startswith("cuda") else "CPU"
    print(
        f"PlainGPT layers={args.layers} dim={args.dim} heads={args.heads} seq={args.seq} batch={args.batch} "
        f"on {args.device}, torch {torch.__version__}, {args.threads} thread(s); {args.repeats} repeats x "
        f"{args.steps} steps"
    )
    print(f"{'mode':<12} {'device MiB':>11} {'x none':>7} {'host MiB':>9} {clock + ' ms/step':>12} {'x none':>7}")
    none = memory["none"]["device"]
    for mode in MODES:
        m = memory[mode]
        print(
            f"{mode:<12} {m['device'] / 2**20:>11.1f} {m['device'] / none:>7.2f} {m['host'] / 2**20:>9.1f} "
            f"{1000 * statistics.median(times[mode]):>12.1f} {ratios[mode]:>7.2f}"
        )


if __name__ == "__main__":
    main()
