"""A small stand-in for the Trainer contract (trainer_contract.md), to test callbacks in isolation.

Collectives are real ``torch.distributed`` calls when a process group is up (gloo in the tests),
identities otherwise. ``fit`` fires the events in the order of ``callbacks/events.py``.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


class StandInStrategy:
    root_device = torch.device("cpu")

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.clone()
        if self.world_size > 1:
            dist.all_reduce(out, op=getattr(dist.ReduceOp, _OPS.get(op, "SUM")))
        return out / self.world_size if op == "mean" else out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


class StandInTrainer:
    def __init__(self, callbacks: List[Any], log_every_n_steps: int = 1, root: Optional[str] = None) -> None:
        self.callbacks = callbacks
        self.strategy = StandInStrategy()
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = self.strategy.world_size
        self.is_global_zero = self.global_rank == 0
        self.device = torch.device("cpu")
        self.default_root_dir = root or tempfile.mkdtemp()
        self.log_every_n_steps = log_every_n_steps
        self.global_step = self.current_epoch = self.batch_idx = 0
        self.stage = "fit"
        self.should_stop = False
        self.optimizers: List[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: List[Dict[str, Any]] = []
        self.callback_metrics: Dict[str, torch.Tensor] = {}
        self.precision = "32"
        self.max_steps, self.max_epochs = -1, None
        self.logged: List[tuple] = []  # (metrics, step) of every LOG event
        self.train_dataloader: Any = None

    def fire(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, self.module, *args)

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        step = self.global_step if step is None else step
        self.logged.append((dict(metrics), step))
        self.fire("on_log", dict(metrics), step)

    def series(self, name: str) -> Dict[int, float]:
        return {step: m[name] for m, step in self.logged if name in m}

    def fit(
        self,
        module: torch.nn.Module,
        loader: Any,
        optimizer: torch.optim.Optimizer,
        *,
        max_steps: int,
        max_epochs: int = 1000,
        scheduler: Any = None,
        loss_fn: Optional[Callable] = None,
        val_every_n_steps: Optional[int] = None,
        val_metrics: Optional[Callable[[Any], Dict]] = None,
    ) -> None:
        self.module, self.optimizers, self.train_dataloader = module, [optimizer], loader
        self.val_dataloaders = ["validation"] if val_every_n_steps else []  # as the Trainer: a validation loop runs
        if scheduler is not None:
            self.lr_scheduler_configs = [{"scheduler": scheduler, "interval": "step", "frequency": 1, "name": None}]
        loss_fn = loss_fn or (lambda m, b: m(b[0]).float().pow(2).mean())
        self.fire("on_fit_start")
        while self.current_epoch < max_epochs and not self.should_stop and self.global_step < max_steps:
            self.fire("on_train_epoch_start")
            for batch_idx, batch in enumerate(loader):
                self.batch_idx = batch_idx
                self.fire("on_train_batch_start", batch, batch_idx)
                loss = loss_fn(module, batch)
                self.fire("on_before_backward", loss)
                loss.backward()
                self.fire("on_after_backward")
                self.fire("on_before_optimizer_step", optimizer)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
                self.global_step += 1
                self.fire("on_train_batch_end", loss, batch, batch_idx)
                if val_every_n_steps and self.global_step % val_every_n_steps == 0:
                    self.fire("on_validation_start")
                    self.callback_metrics.update({k: torch.as_tensor(v) for k, v in val_metrics(self).items()})
                    self.fire("on_validation_end")
                if self.should_stop or self.global_step >= max_steps:
                    break
            self.fire("on_train_epoch_end")
            self.current_epoch += 1
        self.fire("on_fit_end")
