"""What ``TrainingModule.log`` records: latest step values and weighted epoch means.

Values stay tensors (detached) until they are reported, so logging costs no device sync per step;
they become floats only at report points (every ``log_every_n_steps`` and at epoch end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import torch

from trainforge.strategies.errors import ConfigurationError

REDUCE_FX = ("mean", "sum", "max", "min")


@dataclass
class _EpochMean:
    total: torch.Tensor
    weight: float
    sync_dist: bool
    reduce_fx: str = "mean"


@dataclass
class MetricStore:
    step_values: Dict[str, torch.Tensor] = field(default_factory=dict)
    step_sync: Dict[str, bool] = field(default_factory=dict)
    epoch_means: Dict[str, _EpochMean] = field(default_factory=dict)
    prog_bar: Dict[str, torch.Tensor] = field(default_factory=dict)

    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: bool,
        on_epoch: bool,
        prog_bar: bool,
        sync_dist: bool,
        batch_size: int,
        reduce_fx: str = "mean",
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"log name={name!r} must be a non-empty string")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            tensor = value.detach()
        elif isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigurationError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; "
                    "log a scalar (e.g. value.mean())"
                )
            tensor = value.detach().reshape(())
        elif isinstance(value, (int, float)):
            tensor = torch.tensor(float(value))
        else:
            raise ConfigurationError(f"self.log({name!r}, value={value!r}): value must be a number or a scalar tensor")
        step_name, epoch_name = (f"{name}_step", f"{name}_epoch") if on_step and on_epoch else (name, name)
        if on_step:
            self.step_values[step_name] = tensor
            self.step_sync[step_name] = sync_dist
            if prog_bar:
                self.prog_bar[step_name] = tensor
        if on_epoch:
            weighted = tensor.float() * batch_size if reduce_fx == "mean" else tensor.float()
            acc = self.epoch_means.get(epoch_name)
            if acc is None:
                self.epoch_means[epoch_name] = _EpochMean(weighted, float(batch_size), sync_dist, reduce_fx)
            elif reduce_fx in ("mean", "sum"):
                acc.total = acc.total + weighted
                acc.weight += batch_size
            else:
                acc.total = (
                    torch.maximum(acc.total, weighted) if reduce_fx == "max" else torch.minimum(acc.total, weighted)
                )
            if prog_bar:
                self.prog_bar[epoch_name] = tensor

    def pop_step_metrics(self, strategy: Any) -> Dict[str, float]:
        """Latest step values as floats (mean over ranks where sync_dist), then forgotten."""
        out = {}
        for name, value in self.step_values.items():
            if self.step_sync.get(name) and strategy.world_size > 1:
                value = strategy.all_reduce(value.float(), "mean")
            out[name] = float(value)
        self.step_values.clear()
        return out

    def pop_epoch_metrics(self, strategy: Any) -> Dict[str, float]:
        """Weighted means over the epoch's batches; with sync_dist, over every rank's batches."""
        out = {}
        for name, acc in self.epoch_means.items():
            if acc.reduce_fx != "mean":  # sum, max, min: over batches, then over ranks (sync_dist)
                total = acc.total
                if acc.sync_dist and strategy.world_size > 1:
                    total = strategy.all_reduce(total.to(strategy.root_device), acc.reduce_fx)
                out[name] = float(total)
                continue
            total, weight = acc.total, torch.tensor(acc.weight, dtype=torch.float64)
            if acc.sync_dist and strategy.world_size > 1:
                total = strategy.all_reduce(total.to(strategy.root_device, torch.float64), "sum")
                weight = strategy.all_reduce(weight.to(strategy.root_device), "sum")
            out[name] = float(total.double().cpu() / weight.cpu())
        self.epoch_means.clear()
        return out
