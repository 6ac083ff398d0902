"""What ``TrainingModule.log`` records: latest step values and weighted epoch means.

Values stay tensors (detached) until they are reported, so logging costs no device sync per step;
they become floats only at report points (every ``log_every_n_steps`` and at epoch end).

A ``torchmetrics.Metric`` is logged as Lightning logs it: on_step, the value its forward returned
for the batch; on_epoch, its ``compute()`` at the epoch end (torchmetrics syncs the states of every
rank inside ``compute`` when torch.distributed is initialized); every Metric logged in an epoch is
``reset()`` after the epoch-end hooks. torchmetrics is optional: it is looked up in ``sys.modules``
only (a program that logs a Metric has imported it), so trainforge never imports it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Set

import torch

from trainforge.strategies.errors import ConfigurationError

REDUCE_FX = ("mean", "sum", "max", "min")


def torchmetrics_type(name: str = "Metric") -> Optional[type]:
    """``torchmetrics.<name>`` if torchmetrics is imported, else None (never imports it)."""
    module = sys.modules.get("torchmetrics")
    found = getattr(module, name, None) if module is not None else None
    return found if isinstance(found, type) else None


def metric_scalar(name: str, value: Any, metric: Any, what: str) -> torch.Tensor:
    """What a logged Metric gave (its ``what``: the batch's forward value or ``compute()``) as one
    detached value, or a ConfigurationError naming the metric."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(())
    got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"{value!r:.80}"
    raise ConfigurationError(
        f"self.log({name!r}, {type(metric).__name__}): its {what} is {got}, and a logged value is one "
        "number: configure the metric to reduce to one value (e.g. average='macro'), or log the values "
        "you need one by one from metric.compute()"
    )


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
    # names logged on_epoch with prog_bar=True: shown once the epoch's value is known (Lightning's bar shows the
    # last epoch's value during an epoch, never a batch's value under the epoch's name)
    prog_bar_epoch: Set[str] = field(default_factory=set)
    epoch_objects: Dict[str, Any] = field(default_factory=dict)  # torchmetrics.Metric logged on_epoch
    logged_objects: Dict[int, Any] = field(default_factory=dict)  # every Metric logged: reset at the epoch end

    def log_metric_object(
        self, name: str, metric: Any, *, on_step: bool, on_epoch: bool, prog_bar: bool, suffix: str = ""
    ) -> None:
        """A ``torchmetrics.Metric``: on_step its forward value for this batch, on_epoch its
        ``compute()`` at the epoch end (``pop_epoch_metrics``). ``suffix``: Lightning's
        ``/dataloader_idx_N``, after ``_step``/``_epoch``."""
        step_name, epoch_name = (f"{name}_step", f"{name}_epoch") if on_step and on_epoch else (name, name)
        step_name, epoch_name = step_name + suffix, epoch_name + suffix
        self.logged_objects[id(metric)] = metric
        if on_step:
            value = metric._forward_cache  # what metric(preds, target) returned for the batch
            if value is None:
                raise ConfigurationError(
                    f"self.log({name!r}, {type(metric).__name__}, on_step=True): on_step logs the value the "
                    "metric's forward returned for this batch, and it has none (updated with .update(), or "
                    "logged before it was called); call the metric, metric(preds, target), before self.log, "
                    "or log it with on_step=False, on_epoch=True for the epoch value only"
                )
            tensor = metric_scalar(name, value, metric, "value for the batch")
            self.step_values[step_name] = tensor
            self.step_sync[step_name] = False  # the batch's value on this rank (Lightning)
            if prog_bar:
                self.prog_bar[step_name] = tensor
        if on_epoch:
            self.epoch_objects[epoch_name] = metric
            if prog_bar and metric._forward_cache is not None:  # the batch's value, compute() at the end
                self.prog_bar[epoch_name] = metric_scalar(name, metric._forward_cache, metric, "value for the batch")

    def reset_metric_objects(self) -> None:
        """``reset()`` every Metric logged since the last call (Lightning: after the epoch-end hooks)."""
        for metric in self.logged_objects.values():
            metric.reset()
        self.logged_objects.clear()

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
        suffix: str = "",
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"log name={name!r} must be a non-empty string")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            tensor = value.detach()
        elif isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigurationError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; self.log takes one "
                    "number, as in Lightning 2.x: log a scalar (e.g. value.mean()), or one name per element with "
                    f"self.log_dict({{f'{name}/{{i}}': v for i, v in enumerate(value)}})"
                )
            tensor = value.detach().reshape(())
        elif isinstance(value, (int, float)):
            tensor = torch.tensor(float(value))
        else:
            raise ConfigurationError(f"self.log({name!r}, value={value!r}): value must be a number or a scalar tensor")
        step_name, epoch_name = (f"{name}_step", f"{name}_epoch") if on_step and on_epoch else (name, name)
        step_name, epoch_name = step_name + suffix, epoch_name + suffix
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
                self.prog_bar_epoch.add(epoch_name)

    def pop_step_metrics(self, strategy: Any) -> Dict[str, float]:
        """Latest step values as floats (mean over ranks where sync_dist), then forgotten."""
        out = {}
        for name, value in self.step_values.items():
            if self.step_sync.get(name) and strategy.world_size > 1:
                value = strategy.all_reduce(value.float(), "mean")
            out[name] = float(value)
        self.step_values.clear()
        return out

    def pop_epoch_metrics(self, strategy: Any, compute: bool = True) -> Dict[str, float]:
        """Weighted means over the epoch's batches; with sync_dist, over every rank's batches. A
        Metric's value is its ``compute()`` (every rank's states; not called where ``compute`` is
        False: the sanity check, whose values are dropped); ``reset_metric_objects`` resets it."""
        out = {}
        if compute:
            for name, metric in self.epoch_objects.items():
                tensor = metric_scalar(name, metric.compute(), metric, "compute()")
                out[name] = float(tensor)
                if name in self.prog_bar:
                    self.prog_bar[name] = tensor
        self.epoch_objects.clear()
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
            # divided in float32, as Lightning's epoch mean (its float32 sum over the batch sizes)
            out[name] = float(total.float().cpu() / weight.float().cpu())
        self.epoch_means.clear()
        if compute:  # not the sanity check's values (dropped)
            self.prog_bar.update({n: torch.tensor(v) for n, v in out.items() if n in self.prog_bar_epoch})
        return out
