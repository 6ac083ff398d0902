"""GradientNormMonitor: the gradient norm the optimizer is about to see.

It runs in ``on_before_optimizer_step``, where gradients are already unscaled (mixed precision) and
not yet clipped, on the parameters of the optimizer that is about to step. With sharded gradients
(FSDP2's DTensor) the result is the norm of the full gradient, not of the local shard:
``torch.nn.utils.get_total_norm`` reduces DTensor norms across the mesh and ``.full_tensor()``
materialises the result. Values are logged every ``trainer.log_every_n_steps`` optimizer steps at
the step the optimizer is about to complete (``global_step + 1``), next to that step's loss:
``grad_norm/total`` and, with ``per_layer=True``, ``grad_norm/<parameter name>``. With several
optimizers the names get ``_opt<k>``. Parameters whose gradient lives outside ``.grad``
(DeepSpeed keeps its own buffers) are not seen.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Iterable, List

import torch

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: DTensor results (sharded or partial) are reduced to the full value."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def total_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all ``grads`` together, as ``clip_grad_norm_`` computes it."""
    grads = list(grads)
    if not grads:
        return torch.tensor(0.0)
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:  # torch >= 2.6, DTensor-aware
        return _full(get_total_norm(grads, norm_type))
    # Older torch: the same computation by hand (the norm of the per-tensor norms).
    norms = [_full(torch.linalg.vector_norm(g, norm_type)) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


class GradientNormMonitor(Callback):
    """Log the total gradient norm (and per-parameter norms if ``per_layer``)."""

    def __init__(self, norm_type: float = 2.0, per_layer: bool = False) -> None:
        norm_type = float(norm_type)
        if not (norm_type > 0 or math.isinf(norm_type)):
            raise ConfigurationError(
                f"GradientNormMonitor(norm_type={norm_type!r}) must be > 0 or inf "
                "(2.0 for the Euclidean norm, inf for the largest absolute value)"
            )
        self.norm_type = norm_type
        self.per_layer = per_layer
        self.last_metrics: Dict[str, float] = {}

    def on_before_optimizer_step(self, trainer: TrainerView, module: TrainingModule, optimizer: Any) -> None:
        step = trainer.global_step + 1  # the step this optimizer call completes
        if step % max(1, int(trainer.log_every_n_steps)) != 0:
            return
        metrics = self.compute(module, optimizer)
        optimizers = list(trainer.optimizers)
        if len(optimizers) > 1:
            k = next((i for i, o in enumerate(optimizers) if o is optimizer), 0)
            metrics = {f"{name}_opt{k}": value for name, value in metrics.items()}
        if metrics:
            self.last_metrics = metrics
            trainer.log_metrics(metrics, step=step)

    def compute(self, module: torch.nn.Module, optimizer: Any) -> Dict[str, float]:
        """``{"grad_norm/total": ..., "grad_norm/<name>": ...}`` for the optimizer's parameters.

        Collective when gradients are DTensors: call it on every rank."""
        params: List[torch.nn.Parameter] = [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        if not params:
            return {}
        metrics = {"grad_norm/total": float(total_norm([p.grad for p in params if p.grad is not None], self.norm_type))}
        if self.per_layer:
            names = {id(p): name for name, p in module.named_parameters()}
            norms = [_full(torch.linalg.vector_norm(p.grad, self.norm_type)).float() for p in params]
            values = torch.stack([n.to(norms[0].device) for n in norms]).cpu().tolist()  # one device sync
            for i, (p, value) in enumerate(zip(params, values)):
                metrics[f"grad_norm/{names.get(id(p), f'param{i}')}"] = value
        return metrics
