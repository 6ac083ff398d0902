"""Per-step cost of ``Trainer(profiler="simple")`` (the per-hook timer) against the same Trainer without it.

    python benchmarks/profiler_overhead.py            # CPU, 1 process, ~1 min

The loop, model and data are ``overhead.py``'s ``trainer`` loop (defaults on: progress bar, CSV tracker,
end-of-fit checkpoint, ``self.log`` every step; an MLP step of about 1-2 ms on one thread). Two variants,
interleaved (the order rotates), medians and the median of per-repeat ratios reported:

  trainer        profiler=None: hooks are the callbacks' own methods (nothing wrapped, nothing added)
  trainer+timer  profiler="simple": every module/callback hook wrapped in two perf_counter calls

Target: trainer+timer / trainer <= 1.02. Wall time and the process's CPU time are both reported (on a
loaded machine the CPU time is the steadier one). Timings are printed, never asserted.
"""

from __future__ import annotations

import gc
import io
import os
import shutil
import statistics
import sys
import tempfile
import timeit
from contextlib import redirect_stdout
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the sibling benchmark: same data and loops
import overhead

from trainforge import Trainer
from trainforge.callbacks import ProgressBar, SimpleProfiler

TARGET = 1.02


class TerminalSink(io.StringIO):
    """Says it is a terminal (so the tqdm bar runs, as at a console); keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def isatty(self) -> bool:
        return True


def run(args, data, profiler: Optional[str]) -> Tuple[float, float]:
    clock = overhead.StepClock(args.warmup, args.steps)
    args.runs += 1
    root = os.path.join(args.root, f"run{args.runs}")
    trainer = Trainer(
        accelerator="cpu",
        max_steps=args.warmup + args.steps + 1,
        default_root_dir=root,
        callbacks=[ProgressBar(stream=TerminalSink())],
        profiler=profiler,
    )
    with redirect_stdout(io.StringIO()) as report:  # the timer's table, printed at fit end
        trainer.fit(overhead.Classifier(overhead.make_model(args), clock), overhead.make_loader(data, args))
    if profiler is not None:  # the timer's table (a run without it prints only the model summary)
        args.last_report = report.getvalue() or args.last_report
    if isinstance(trainer.callbacks[0], SimpleProfiler):  # hook calls per step, the fit's start and end aside
        steps = max(trainer.global_step, 1)
        args.calls_per_step = sum(n for n in (c for _, c in trainer.callbacks[0].totals.values()) if n >= steps) / steps
    shutil.rmtree(root, ignore_errors=True)
    return clock.per_step


def main(argv: Optional[List[str]] = None) -> None:
    args = overhead.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.runs, args.root, args.last_report = 0, tempfile.mkdtemp(prefix="tf-profiler-overhead-"), ""
    args.calls_per_step = 0.0
    variants = {"trainer": None, "trainer+timer": "simple"}
    data = overhead.InMemory((args.warmup + args.steps + 2) * args.batch_size, args.d_in, args.classes)
    times: Dict[str, Dict[str, List[float]]] = {c: {name: [] for name in variants} for c in ("wall", "cpu")}
    try:
        for r in range(args.warmup_repeats + args.repeats):
            names = list(variants)
            for name in names[r % 2 :] + names[: r % 2]:
                gc.collect()
                wall, cpu = run(args, data, variants[name])
                if r >= args.warmup_repeats:
                    times["wall"][name].append(wall)
                    times["cpu"][name].append(cpu)
    finally:
        shutil.rmtree(args.root, ignore_errors=True)
    print(
        f"\nprofiler='simple' overhead (1 process, {torch.get_num_threads()} thread(s)): {args.repeats} interleaved "
        f"repeats x {args.steps} steps, torch {torch.__version__}"
    )
    for clock, label in (("wall", "wall time (perf_counter)"), ("cpu", "CPU time of the process (process_time)")):
        base = times[clock]["trainer"]
        print(f"\n{label}\n{'variant':<15}{'median ms/step':>15}{'+us/step':>10}{'ratio (paired)':>16}  target")
        for name, values in times[clock].items():
            med = statistics.median(values)
            paired = statistics.median(v / b for v, b in zip(values, base))
            verdict = "" if name == "trainer" else f"<= {TARGET:.2f} {'ok' if paired <= TARGET else 'MISSED'}"
            extra = (med - statistics.median(base)) * 1e6
            print(f"{name:<15}{med * 1e3:>15.4f}{extra:>10.1f}{paired:>16.4f}  {verdict}")
    print("\nthe timer's own report of the last run:\n" + args.last_report)
    # The same cost computed, free of the machine's load: one wrapped call's extra time x calls per step.
    per_call, calls = wrapper_cost(), args.calls_per_step
    step = statistics.median(times["cpu"]["trainer"])
    print(
        f"computed: {per_call * 1e9:.0f} ns per wrapped hook call x {calls:.2f} hook calls per step = "
        f"{per_call * calls * 1e6:.2f} us/step = {100 * per_call * calls / step:.3f} % of a {step * 1e3:.3f} ms step"
    )


def wrapper_cost() -> float:
    """Seconds a SimpleProfiler wrapper adds to one hook call (timeit, best of 5)."""

    def hook(*args: object) -> None:
        pass

    wrapped, n = SimpleProfiler().wrap("hook", hook), 200_000
    plain = min(timeit.repeat(lambda: hook(1, 2, 3), number=n, repeat=5)) / n
    return min(timeit.repeat(lambda: wrapped(1, 2, 3), number=n, repeat=5)) / n - plain


if __name__ == "__main__":
    main()
