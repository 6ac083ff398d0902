"""Save checkpoints in a loop until killed (for tests/strategies/test_checkpoint_crash.py).

    python tests/scripts/ckpt_save_loop.py ROOT [--mb 3] [--mode unique|overwrite]   # one loop
    python tests/scripts/ckpt_save_loop.py --serve                                   # fork server

One loop: for N = 1, 2, ...: write checkpoint ``step-N`` (mode ``unique``, pruned to the newest 3)
or overwrite ``last`` (mode ``overwrite``), then print ``saved N`` (flushed) once ``finalize``
returned. Bounded: stops after 5000 saves or 60 s. The content is a function of N, so a reader
can check that what it loaded belongs to the step in metadata.json.

``--serve`` pays the torch import once: for each stdin line ``ROOT MB MODE LOGFILE`` it forks a
child that runs one loop with stdout and stderr going to LOGFILE and answers ``pid P``; the line
``reap P`` waits for that child and answers ``status S`` (the raw wait status). The server itself
runs no torch op before forking, so the fork is safe; it exits at end of input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from trainforge.strategies.checkpoint.io import CheckpointWriter, delete_checkpoint, list_checkpoints


def save_loop(root: Path, mb: float, mode: str) -> None:
    n = max(1, int(mb * 2**20 / 4 / 2))  # two float32 tensors of n elements
    deadline = time.monotonic() + 60
    for step in range(1, 5001):
        if time.monotonic() > deadline:
            break
        name = f"step-{step:06d}" if mode == "unique" else "last"
        w = CheckpointWriter(root / name)
        weight = torch.arange(n, dtype=torch.float32) + step
        w.save_tensors("model", {"weight": weight, "tied": weight, "bias": torch.full((n,), float(step))})
        w.save_object("optimizer", {"step": step, "exp_avg": torch.full((n // 4,), float(step))})
        w.save_object("rng/rank-00000", {"torch": torch.get_rng_state(), "step": step})
        w.finalize({"step": step, "epoch": 0, "strategy": "single", "precision": "32"})
        print(f"saved {step}", flush=True)
        if mode == "unique":
            for old in list_checkpoints(root)[:-3]:
                delete_checkpoint(old)


def serve() -> None:
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["reap"]:
            _, status = os.waitpid(int(words[1]), 0)
            print(f"status {status}", flush=True)
            continue
        root, mb, mode, log = words
        pid = os.fork()
        if pid == 0:  # child: one loop, output to its log file, never returns into the server
            code = 0
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdin.close()
                save_loop(Path(root), float(mb), mode)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(f"pid {pid}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path)
    parser.add_argument("--mb", type=float, default=3.0)
    parser.add_argument("--mode", choices=("unique", "overwrite"), default="unique")
    parser.add_argument("--serve", action="store_true")
    args = parser.parse_args()
    if args.serve:
        print("ready", flush=True)
        serve()
    elif args.root is None:
        parser.error("give ROOT or --serve")
    else:
        save_loop(args.root, args.mb, args.mode)


if __name__ == "__main__":
    main()
