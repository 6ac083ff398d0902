"""What EMAWeightAveraging costs per step (callbacks/weight_averaging.py): the same Trainer fit without
the callback, with ``EMAWeightAveraging(decay=0.999)`` (one foreach ``lerp`` over the weights after
every optimizer step) and, for the per-tensor formula Lightning 2.6 uses, with
``WeightAveraging(avg_fn=get_ema_avg_fn(0.999))``.

    python benchmarks/weight_averaging.py
    python benchmarks/weight_averaging.py --hidden 1024      # a bigger model: the lerp is memory-bound

A small MLP (64-H-H-10, H=128 by default, batch 64, AdamW, fp32, one CPU thread; a step of 1-2 ms, so
the update is as visible as it gets), the data in memory, ``num_workers=0``, no progress bar, tracker,
checkpoint or validation. The variants alternate (the order rotates), each fit times ``--steps`` steps
after ``--warmup`` (wall and process CPU time); medians per variant and the median of per-repeat ratios
against "off" are printed.
Without the callback there is nothing to pay: no hook of it is registered. Timings are never asserted.

Measured (2-core machine shared with other jobs, torch 2.13 CPU, one thread, 9 repeats): H=128, a step of
1.7 ms: ema/off 1.05 (CPU time) / 1.09 (wall), ema_per_tensor/off 1.16 / 1.24; H=512: ema/off 1.10. Of
the callback's ~40 us per step on H=128, ~35 us are the lerp itself (a pass over two copies of the
weights; AdamW's step makes several) and ~4 us the hooks, so the 2 % goal is out of reach for models
this small on CPU; ``update_every_n_steps=N`` divides the cost by N.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_avg_fn

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
    "ema": lambda: [EMAWeightAveraging(decay=0.999)],
    "ema_per_tensor": lambda: [WeightAveraging(avg_fn=get_ema_avg_fn(0.999))],
}


def one_fit(variant: str, args: argparse.Namespace) -> "tuple[float, float]":
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
    parser.add_argument("--repeats", type=int, default=7)
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
            ratio = statistics.median(v / o for v, o in zip(mine, off))
            print(
                f"  {name:15s} {statistics.median(mine):7.3f} ms/step  {name}/off: {ratio:.3f} (median of per-repeat ratios)"
            )


if __name__ == "__main__":
    main()
