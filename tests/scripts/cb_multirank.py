"""The callbacks' multi-rank scenarios, each a real ``Trainer.fit`` (strategy="ddp", gloo, 2 ranks).

Run by ``tests/scripts/cb_launch.py`` under torchrun; one launch serves every callback test file
(torch + trainer import costs seconds per process). Each scenario writes ``<scenario>_rank<r>.json``
to ``$CB_OUT``; an exception in one is recorded there and the next scenario still runs.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from trainforge import Trainer, TrainingModule
from trainforge.callbacks.base import Callback
from trainforge.callbacks.early_stopping import EarlyStopping
from trainforge.callbacks.grad_norm import GradientNormMonitor
from trainforge.callbacks.lr_monitor import LearningRateMonitor
from trainforge.callbacks.memory import MemoryMonitor
from trainforge.callbacks.rng_sync import RNGSync
from trainforge.callbacks.throughput import ThroughputMonitor
from trainforge.callbacks.timer import Timer

OUT = os.environ["CB_OUT"]
MB_FLOATS = 262144
SLEEP, BATCH = 0.02, 4


class Net(TrainingModule):
    def __init__(self, sleep: float = 0.0, extra_mb: int = 0, val_value=None, step_size: int = 0) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.sleep, self.val_value, self.step_size = sleep, val_value, step_size
        self.hold = torch.ones(extra_mb * MB_FLOATS) if extra_mb else None  # plain attribute: RSS only
        self.seen = []

    def training_step(self, batch, batch_idx):
        if self.sleep:
            time.sleep(self.sleep)
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        self.seen.append((self.current_epoch, x[:, 0].tolist()))
        loss = self.net(x.expand(-1, 4) if x.shape[1] == 1 else x).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.val_value(self.current_epoch))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.step_size:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=self.step_size, gamma=0.5),
                "interval": "step",
            },
        }


class Recorder(Callback):
    """LOG events by step, and clip_grad_norm_ on copies of the gradients the optimizer is about to see."""

    def __init__(self) -> None:
        self.logged, self.clip_norms, self.draws = {}, {}, {}

    def on_log(self, trainer, module, metrics, step):
        self.logged.setdefault(step, {}).update(metrics)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        copies = [
            nn.Parameter(p.detach().clone()) for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        for c, p in zip(copies, [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]):
            c.grad = p.grad.detach().clone()
        self.clip_norms[trainer.global_step + 1] = float(torch.nn.utils.clip_grad_norm_(copies, max_norm=1e9))

    def on_train_epoch_start(self, trainer, module):  # runs after RNGSync (later in the callback list)
        self.draws[trainer.current_epoch] = [torch.rand(1).item(), random.random(), float(np.random.rand())]


def trainer(name: str, callbacks, **kwargs) -> Trainer:
    return Trainer(
        strategy="ddp",
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=callbacks,
        default_root_dir=os.path.join(OUT, "root", name),
        **kwargs,
    )


def loader(n: int, batch: int = BATCH, shuffle: bool = False, dim: int = 4) -> DataLoader:
    data = torch.arange(n * dim, dtype=torch.float32).reshape(n, dim) / (n * dim)
    return DataLoader(TensorDataset(data), batch_size=batch, shuffle=shuffle)


def scenario_monitors(rank: int) -> dict:
    rec = Recorder()
    mem, tput = MemoryMonitor(every_n_steps=4, leak_intervals=50), ThroughputMonitor(window=8)
    t = trainer(
        "monitors", [mem, tput, LearningRateMonitor(), GradientNormMonitor(), rec], max_steps=12, log_every_n_steps=4
    )
    t.fit(Net(sleep=SLEEP, extra_mb=64 if rank == 1 else 0, step_size=5), loader(2 * 12 * BATCH))
    return {
        "logged": rec.logged,
        "clip_norms": rec.clip_norms,
        "ideal_per_device": BATCH / SLEEP,
        "peaks": {str(r): v for r, v in mem.peaks.items()},
    }


class Index(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def scenario_rng(rank: int) -> dict:
    out = {}
    for sync in (False, True):
        rec = Recorder()
        net = Net()
        t = trainer(f"rng{sync}", ([RNGSync()] if sync else []) + [rec], max_epochs=2, seed=100 + 7 * rank)
        t.fit(net, DataLoader(Index(), batch_size=2, shuffle=True))
        out["sync" if sync else "nosync"] = {"seen": net.seen, "draws": rec.draws}
    return out


def scenario_early_stopping(rank: int) -> dict:
    es = EarlyStopping("val/loss", patience=2, verbose=True)
    # rank 0 improves every epoch; rank 1 never does (the value is not synced across ranks)
    net = Net(val_value=(lambda epoch: 1.0 / (epoch + 1)) if rank == 0 else (lambda epoch: 1.0))
    t = trainer("es", [es], max_epochs=20)
    t.fit(net, loader(16), loader(8))
    return {
        "should_stop": t.should_stop,
        "global_step": t.global_step,
        "epoch": t.current_epoch,
        "batches_per_epoch": t.num_training_batches,
        "wait_count": es.wait_count,
        "patience": es.patience,
        "stopped_epoch": es.stopped_epoch,
    }


def scenario_timer(rank: int) -> dict:
    first = Timer(duration=dict(seconds=1))
    if rank == 1:  # rank 1 alone would stop at once: only rank 0's broadcast decision may count
        first.load_state_dict({"time_elapsed": {"fit": 1e6}})
    t1 = trainer("timer1", [first], max_steps=500)
    t1.fit(Net(sleep=0.05), loader(2 * 500 * BATCH))
    state = t1.strategy.broadcast(first.state_dict() if rank == 0 else None, src=0)
    resumed = Timer(duration=dict(seconds=1))
    resumed.load_state_dict(state)  # as a checkpoint restore does, before on_fit_start
    t2 = trainer("timer2", [resumed], max_steps=500)
    t2.fit(Net(sleep=0.05), loader(2 * 500 * BATCH))
    return {
        "steps1": t1.global_step,
        "elapsed1": first.time_elapsed("fit") if rank == 0 else None,
        "saved": state["time_elapsed"]["fit"],
        "steps2": t2.global_step,
        "elapsed2": resumed.time_elapsed("fit"),
    }


def scenario_dtensor_grad_norm(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)  # the same full tensors on both ranks
    full = {"w": torch.randn(8, 3, generator=gen), "b": torch.randn(8, generator=gen)}
    grads = {"w": torch.randn(8, 3, generator=gen), "b": torch.randn(8, generator=gen)}
    module = nn.Module()
    for name in full:
        param = nn.Parameter(distribute_tensor(full[name], mesh, [Shard(0)]))
        param.grad = distribute_tensor(grads[name], mesh, [Shard(0)])
        module.register_parameter(name, param)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    out = {}
    for norm_type in (2.0, 1.0, float("inf")):
        computed = GradientNormMonitor(norm_type=norm_type, per_layer=True).compute(module, opt)
        plain = [nn.Parameter(full[n].clone()) for n in ("w", "b")]
        for p, n in zip(plain, ("w", "b")):
            p.grad = grads[n].clone()
        local = torch.linalg.vector_norm(
            torch.cat([module.w.grad.to_local().flatten(), module.b.grad.to_local().flatten()]), norm_type
        )
        out[str(norm_type)] = {
            "computed": computed,
            "local_shard_norm": float(local),
            "expected": float(torch.nn.utils.clip_grad_norm_(plain, 1e9, norm_type=norm_type)),
            "expected_w": float(torch.linalg.vector_norm(grads["w"], norm_type)),
        }
    return out


def scenario_profiler(rank: int) -> dict:
    """Both ranks write into one directory: each its own trace, with the loop's phases in it."""
    from trainforge.callbacks.profiler import PyTorchProfiler

    profiler = PyTorchProfiler(dirpath=os.path.join(OUT, "root", "profiler", "traces"), row_limit=0)
    trainer("profiler", [profiler], max_steps=2).fit(Net(), loader(2 * 2 * BATCH))
    dist.barrier()
    (mine,) = profiler.trace_files
    with open(mine) as fh:
        names = {event.get("name", "") for event in json.load(fh)["traceEvents"]}
    return {
        "files": sorted(os.listdir(os.path.dirname(mine))),
        "mine": os.path.basename(mine),
        "phases": sorted(n for n in names if n.startswith("[loop]")),
    }


SCENARIOS = {
    "monitors": scenario_monitors,
    "rng": scenario_rng,
    "early_stopping": scenario_early_stopping,
    "timer": scenario_timer,
    "dtensor_grad_norm": scenario_dtensor_grad_norm,
    "profiler": scenario_profiler,
}


def main() -> None:
    # The process group is ours; every Trainer's DDP strategy reuses it (and leaves it up).
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    names = sys.argv[1:] or list(SCENARIOS)
    for name in names:
        start = time.perf_counter()
        try:
            result = SCENARIOS[name](rank)
        except Exception:
            result = {"error": traceback.format_exc()}
        if rank == 0:
            print(f"cb_multirank: {name} took {time.perf_counter() - start:.1f}s", flush=True)
        with open(os.path.join(OUT, f"{name}_rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
