"""HF Accelerate's and Lightning's loops for throughput.py, the same model, data and optimizer,
each written as its own documentation shows; ``loops(bench)`` returns those whose library is
installed, ``bench`` being the throughput module (its model, loader, optimizer and clock)."""

from __future__ import annotations

import argparse
import functools
import importlib
import tempfile
from typing import Any, Callable, Dict

import torch
from torch.utils.data import Dataset

_ACCELERATE_PRECISION = {"32": "no", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def run_accelerate(
    bench: Any, args: argparse.Namespace, data: Dataset, compile: bool, device: torch.device, precision: str
) -> float:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=_ACCELERATE_PRECISION[precision])
    model = bench.make_model(args)
    if compile:
        model.compile()
    optimizer = bench.make_optimizer(model, accelerator.device)
    model, optimizer, loader = accelerator.prepare(model, optimizer, bench.make_loader(data, args, device))
    clock = bench.StepClock(args.warmup, args.steps, device)
    model.train()
    for i, x in enumerate(loader):
        if clock.tick(i):
            break
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return clock.per_step


def run_lightning(
    bench: Any, args: argparse.Namespace, data: Dataset, compile: bool, device: torch.device, precision: str
) -> float:
    import lightning.pytorch as pl

    clock = bench.StepClock(args.warmup, args.steps, device)

    class LitGPT2(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = bench.make_model(args)
            if compile:
                self.model.compile()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            clock.tick(batch_idx)
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return bench.make_optimizer(self.model, self.device)

    with tempfile.TemporaryDirectory(prefix="pl-throughput-") as root:
        trainer = pl.Trainer(
            accelerator="auto",
            devices=1,
            precision=precision if precision != "32" else "32-true",
            max_steps=args.warmup + args.steps + 1,
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(LitGPT2(), bench.make_loader(data, args, device))
    return clock.per_step


def loops(bench: Any) -> Dict[str, Callable[..., float]]:
    out: Dict[str, Callable[..., float]] = {}
    for name, module, run in (
        ("accelerate", "accelerate", run_accelerate),
        ("lightning", "lightning.pytorch", run_lightning),
    ):
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        out[name] = functools.partial(run, bench)
    return out
