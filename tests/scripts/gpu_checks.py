"""One GPU check per run, for tests/test_gpu.py: trains a small model on CUDA through the Trainer and
writes what it observed as JSON to --out (rank 0). Run directly, or under `trainforge launch` for the
process-group checks (ddp-nccl, fsdp-bf16, deepspeed-2, deepspeed-3).
"""

import argparse
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Trainer, TrainingModule, seed_everything
from trainforge.callbacks import Callback, MemoryMonitor


def data(n=512, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, x @ torch.randn(dim, 1, generator=g) / dim**0.5)


class Net(TrainingModule):
    """Linear layers of sizes divisible by 16 (fp8-eligible) and an ``lm_head`` (kept out of fp8)."""

    def __init__(self, dim=64, inf_at=None, oom_at=None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.lm_head = nn.Linear(128, 16)
        self.out = nn.Linear(16, 1)
        self.inf_at, self.oom_at = inf_at, oom_at
        self.losses, self.seen = [], {}

    def forward(self, x):
        return self.out(self.lm_head(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.oom_at is not None and self.global_step == self.oom_at:
            torch.empty(1 << 50, dtype=torch.uint8, device=x.device)  # 1 PiB: a real CUDA OOM
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(loss.detach())
        self.log("train/loss", loss)
        if self.inf_at is not None and self.global_step == self.inf_at:
            return loss * float("inf")  # inf gradients: the fp16 scaler must skip this step
        return loss

    def configure_optimizers(self):
        param = next(self.parameters())
        self.seen = {"device": str(self.device), "dtype": str(param.dtype), "param_type": type(param).__name__}
        fused = self.device.type == "cuda" and type(param) is nn.Parameter
        return torch.optim.AdamW(self.parameters(), lr=3e-3, fused=fused or None)


class StepWatch(Callback):
    """Weights before/after the step the module makes non-finite."""

    def __init__(self, step):
        self.step, self.before, self.after = step, None, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.before = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1 and self.after is None:
            self.after = [p.detach().clone() for p in module.parameters()]


def fit(module, steps=40, **kwargs):
    trainer = Trainer(
        max_steps=steps, enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=10, **kwargs
    )
    trainer.fit(module, DataLoader(data(), batch_size=32, shuffle=True))
    return trainer


def summary(trainer, module):
    losses = [float(v) for v in torch.stack(module.losses).float().cpu()]
    finite = [v for v in losses if v == v and abs(v) != float("inf")]
    return {
        "first_loss": sum(finite[:5]) / 5,
        "last_loss": sum(finite[-5:]) / 5,
        "steps": trainer.global_step,
        "device": str(trainer.device),
        "configure_optimizers_saw": module.seen,
        "fused": bool(getattr(trainer.optimizers[0], "defaults", {}).get("fused")),
        "param_dtype": str(next(module.parameters()).dtype),
        "precision": trainer.precision,
    }


def check_fp16(out):
    watch = StepWatch(10)
    module = Net(inf_at=10)
    trainer = fit(module, precision="16-mixed", nonfinite_loss="off", callbacks=[watch])
    res = summary(trainer, module)
    res["skipped_steps"] = trainer.accelerator.precision.skipped_steps
    res["skipped_step_left_weights"] = all(torch.equal(a, b) for a, b in zip(watch.before, watch.after))
    res["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    return res


def check_fp8(out):
    from torchao.float8.float8_linear import Float8Linear

    module = Net(dim=64)
    trainer = fit(module, precision="fp8", steps=60)
    res = summary(trainer, module)
    res["float8"] = sorted(name for name, m in module.named_modules() if isinstance(m, Float8Linear))
    res["plain_linear"] = sorted(name for name, m in module.named_modules() if type(m) is nn.Linear)
    path = trainer.save_checkpoint(os.path.join(os.path.dirname(out), "fp8-ckpt"))
    fresh = Net(dim=64)
    again = Trainer(
        max_steps=trainer.global_step, precision="fp8", enable_progress_bar=False, enable_checkpointing=False
    )
    again.fit(fresh, DataLoader(data(), batch_size=32, shuffle=True), ckpt_path=str(path))
    a, b = module.state_dict(), fresh.state_dict()
    res["roundtrip_equal"] = a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
    return res


def check_memory(out):
    root = os.path.dirname(out)
    monitor = MemoryMonitor(every_n_steps=5, snapshot_dir=os.path.join(root, "snapshots"))
    module = Net(oom_at=12)
    error = None
    try:
        fit(module, precision="bf16-mixed", callbacks=[monitor], default_root_dir=root)
    except torch.OutOfMemoryError as exc:
        error = type(exc).__name__
    return {
        "error": error,
        "metrics": monitor.last_metrics,
        "snapshots": monitor.snapshots,
        "snapshot_sizes": [os.path.getsize(p) for p in monitor.snapshots if os.path.exists(p)],
    }


def check_async_ckpt(out):
    """ModelCheckpoint's default on CUDA: asynchronous saves staged in reused pinned host buffers; the
    checkpoint of the last step resumes to the same weights."""
    from trainforge.callbacks import ModelCheckpoint

    root = os.path.join(os.path.dirname(out), "async")
    module = Net()
    ckpt = ModelCheckpoint(every_n_steps=10, keep_last_k=2)
    trainer = Trainer(
        max_steps=40,
        enable_progress_bar=False,
        log_every_n_steps=10,
        default_root_dir=root,
        precision="bf16-mixed",
        callbacks=[ckpt],
    )
    trainer.fit(module, DataLoader(data(), batch_size=32, shuffle=True))
    saver = trainer.accelerator._async_checkpointer
    staged = list(_tensors(getattr(saver, "_last_staged", None) or []))
    res = summary(trainer, module)
    res["async_used"] = saver is not None
    res["pinned"] = bool(staged) and all(t.is_pinned() for t in staged)
    res["kept"] = sorted(os.listdir(trainer.default_checkpoint_dir))  # the default logger's version folder
    fresh = Net()
    again = Trainer(max_steps=40, enable_progress_bar=False, enable_checkpointing=False, precision="bf16-mixed")
    again.fit(fresh, DataLoader(data(), batch_size=32, shuffle=True), ckpt_path=ckpt.last_path)
    a, b = module.state_dict(), fresh.state_dict()
    res["resumed_equal"] = all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
    return res


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def simple(**kwargs):
    def check(out):
        module = Net()
        trainer = fit(module, **kwargs)
        res = summary(trainer, module)
        if torch.distributed.is_initialized():
            res["backend"] = torch.distributed.get_backend()
            res["world_size"] = torch.distributed.get_world_size()
        strategy = trainer.strategy
        policy = getattr(strategy, "_fully_shard_kwargs", None)
        if policy is not None:
            mp = policy().get("mp_policy")
            res["fsdp_param_dtype"] = str(getattr(mp, "param_dtype", None))
        return res

    return check


def strategy(name, **kwargs):
    import trainforge.strategies as strategies

    return getattr(strategies, name)(**kwargs)


CHECKS = {
    "fp16": check_fp16,
    "bf16-true": simple(precision="bf16-true"),
    "fp8": check_fp8,
    "compile": simple(precision="bf16-mixed", compile=True),
    "memory": check_memory,
    "async-ckpt": check_async_ckpt,
    "ddp-nccl": lambda out: simple(strategy=strategy("DDPStrategy", comm_hook="bf16"), precision="bf16-mixed")(out),
    "fsdp-bf16": simple(strategy="fsdp", precision="bf16-mixed"),
    "deepspeed-2": lambda out: simple(strategy=strategy("DeepSpeedStrategy", stage=2), precision="bf16-mixed")(out),
    "deepspeed-3": lambda out: simple(strategy=strategy("DeepSpeedStrategy", stage=3), precision="bf16-mixed")(out),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("check", choices=sorted(CHECKS))
    p.add_argument("--out", required=True)
    a = p.parse_args()
    seed_everything(0)
    result = CHECKS[a.check](a.out)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.out, "w") as f:
            json.dump(result, f, default=str)


if __name__ == "__main__":
    main()
