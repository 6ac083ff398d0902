"""What EMAWeightAveraging costs per step (callbacks/weight_averaging.py): the same Trainer fit without
the callback ("off", run twice per repeat: "off_again" shows the noise floor), with
``EMAWeightAveraging(decay=0.999)`` (one ``torch._foreach_lerp_`` per device/dtype group on detached views
of the weights), with the same EMA through ``WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.999))``
(torch's wrapper: a ``no_grad`` decorator and a dtype check around the same lerp, the path EMA took before)
and, for the per-tensor formula Lightning 2.6 uses, ``WeightAveraging(avg_fn=get_ema_avg_fn(0.999))``.

    python benchmarks/weight_averaging.py                 # ~2 min on 2 busy cores
    python benchmarks/weight_averaging.py --hidden 1024   # a bigger model: the lerp is memory-bound

A small MLP (64-H-H-10, H=128 by default, batch 64, AdamW, fp32, one CPU thread; a step of 1-2 ms, so
the update is as visible as it gets), the data in memory, ``num_workers=0``, no progress bar, tracker,
checkpoint or validation. The variants alternate (the order rotates), each fit times ``--steps`` steps
after ``--warmup`` (wall and process CPU time); medians per variant, the median of per-repeat ratios
against "off" and their range over the repeats, and the ratio of the best (least disturbed) repeats
are printed. Then the callback's per-step work timed
alone (its two per-step hooks on the same model, best of 15 runs of process CPU time), as a share of
the median "off" step: the figure the machine's load disturbs least.
Without the callback there is nothing to pay: no hook of it is registered. Timings are never asserted.
Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_avg_fn, get_ema_multi_avg_fn

from trainforge import Trainer, TrainingModule
from trainforge.callbacks import Callback, EMAWeightAveraging, WeightAveraging


class MLP(TrainingModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Clock(Callback):
    """Last in the list, so a step's time includes the averaging done at its BATCH_END."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end = warmup, (0.0, 0.0), (0.0, 0.0)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        now = (time.perf_counter(), time.process_time())
        if trainer.global_step == self.warmup:
            self.start = now
        self.end = now


VARIANTS = {
    "off": lambda: [],
    "off_again": lambda: [],
    "ema": lambda: [EMAWeightAveraging(decay=0.999)],
    "ema_multi_avg_fn": lambda: [WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.999))],
    "ema_per_tensor": lambda: [WeightAveraging(avg_fn=get_ema_avg_fn(0.999))],
}


def one_fit(variant: str, args: argparse.Namespace) -> tuple[float, float]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64 * 64, 64), torch.randint(0, 10, (64 * 64,)))
    clock = Clock(args.warmup)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=args.warmup + args.steps,
        callbacks=[*VARIANTS[variant](), clock],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=args.root,
        log_every_n_steps=10**6,
        num_sanity_val_steps=0,
    )
    trainer.fit(MLP(args.hidden), torch.utils.data.DataLoader(data, batch_size=64, shuffle=True))
    return tuple((e - s) / args.steps * 1e3 for s, e in zip(clock.start, clock.end))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.root = tempfile.mkdtemp(prefix="tf-bench-ema-")
    names = list(VARIANTS)
    times: dict = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            times[name].append(one_fit(name, args))
    params = sum(p.numel() for p in MLP(args.hidden).parameters())
    print(
        f"EMA overhead: MLP 64-{args.hidden}-{args.hidden}-10 ({params} parameters), batch 64, {args.threads} thread(s)"
    )
    for clock, label in ((0, "wall time"), (1, "CPU time of the process (less sensitive to a busy machine)")):
        print(label)
        off = [t[clock] for t in times["off"]]
        for name, values in times.items():
            mine = [t[clock] for t in values]
            ratios = sorted(v / o for v, o in zip(mine, off))
            print(
                f"  {name:17s} {statistics.median(mine):7.3f} ms/step  {name}/off: {statistics.median(ratios):.3f} "
                f"(median of per-repeat ratios; range {ratios[0]:.3f}-{ratios[-1]:.3f}; best/best "
                f"{min(mine) / min(off):.3f})"
            )
    step_us = statistics.median(t[1] for t in times["off"]) * 1e3
    print(f"the callback's per-step hooks timed alone (best of 15, CPU time), against the {step_us:.0f} us 'off' step:")
    for name in ("ema", "ema_multi_avg_fn", "ema_per_tensor"):
        cost = hooks_alone(name, args.hidden)
        print(f"  {name:17s} {cost:7.2f} us/step = {100 * cost / step_us:.2f} % of a step")


def hooks_alone(variant: str, hidden: int, calls: int = 2000) -> float:
    """Microseconds of the callback's per-step work (on_train_batch_start + on_train_batch_end after a step)."""
    module = MLP(hidden)
    callback = VARIANTS[variant]()[0]
    trainer = SimpleNamespace(stage="fit", global_step=0)
    callback.on_setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)

    def step() -> None:
        trainer.global_step += 1
        callback.on_train_batch_start(trainer, module, None, 0)
        callback.on_train_batch_end(trainer, module, None, None, 0)

    for _ in range(200):
        step()
    best = float("inf")
    for _ in range(15):
        start = time.process_time()
        for _ in range(calls):
            step()
        best = min(best, (time.process_time() - start) / calls * 1e6)
    return best


if __name__ == "__main__":
    main()
