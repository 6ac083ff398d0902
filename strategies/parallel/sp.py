"""``MegatronStrategy(sequence_parallel=True, loss_parallel=True)``: a resolved tensor-parallel plan
rewritten as torchtitan's ``parallelize`` lays out a transformer (Korthikanti et al. 2022).

Sequence parallelism (activations ``(batch, seq, hidden)``): the residual stream between the TP
regions is a ``DTensor`` sharded on the sequence dimension (``Shard(1)``), so norms and dropout
there hold ``1/tp`` of the tokens:

- the embedding's output is ``Shard(1)`` (rowwise embedding, or an unplanned one chunked locally);
- every norm of the hidden size (class name ending in ``Norm``, not in the plan) is ``SequenceParallel``;
- colwise layers all-gather their ``Shard(1)`` input (``input_layouts=Shard(1)``); rowwise layers
  reduce-scatter their output back to ``Shard(1)`` (``output_layouts=Shard(1)``), kept a ``DTensor``
  so that shapes seen by the model's own code (masks, positions) stay the full ones.

Each colwise layer gathers its own input (torchtitan gathers once per attention/MLP with
``PrepareModuleInput``: the same result, more all-gathers). The model's code between the regions
must be elementwise on the stream (residual adds, norms, dropout); an op over the sequence there
(a cumsum) or a Linear reading the stream that is not in the plan is not supported.

Loss parallelism: the output head (the plan's colwise layer with a replicated output,
``colwise_rep``/``colwise_gather_output``, e.g. ``lm_head``) keeps its logits sharded on the vocabulary
(``Shard(-1)``, a ``DTensor``), and ``F.cross_entropy`` runs under torch's ``loss_parallel()``:
the full logits are never gathered. Contract for the module's loss: ``F.cross_entropy`` (or
``nn.CrossEntropyLoss``, class indices as targets) on the logits, reshaped only (``flatten``,
``view``, ``float()``); anything else that reads the logits' values needs ``logits.full_tensor()``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

from torch import nn

from trainforge.strategies.errors import ConfigurationError


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Norm") or isinstance(module, (nn.LayerNorm, nn.RMSNorm))


def rewrite_plan(
    model: nn.Module, plan: Dict[str, Any], *, sequence_parallel: bool, loss_parallel: bool
) -> Dict[str, Any]:
    """``plan`` (``{module name: ParallelStyle}``, resolved) with the sequence- and loss-parallel layouts."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    out: Dict[str, Any] = {}
    seq = Shard(1)
    heads = [
        n
        for n, s in plan.items()
        if isinstance(s, ColwiseParallel)
        and isinstance(model.get_submodule(n), nn.Linear)
        and s.output_layouts[0] == Replicate()
    ]
    if loss_parallel and not heads:
        raise ConfigurationError(
            "loss_parallel=True keeps the output head's logits sharded on the vocabulary, but tp_plan has no colwise "
            "layer with a replicated output (the head); add it, e.g. {'lm_head': 'colwise_rep'}, or set "
            "loss_parallel=False"
        )
    hidden = {
        model.get_submodule(n).out_features
        for n, s in plan.items()
        if isinstance(s, RowwiseParallel) and isinstance(model.get_submodule(n), nn.Linear)
    }
    if sequence_parallel and not hidden:
        raise ConfigurationError(
            "sequence_parallel=True shards the residual stream between rowwise and colwise "
            "layers, but tp_plan has no rowwise Linear; add the blocks' output projections as "
            "'rowwise' or set sequence_parallel=False"
        )
    for name, style in plan.items():
        module = model.get_submodule(name)
        if isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear):
            head = loss_parallel and name in heads
            style = ColwiseParallel(
                input_layouts=seq if sequence_parallel else style.input_layouts[0],
                output_layouts=Shard(-1) if head else style.output_layouts[0],
                use_local_output=False if head else style.use_local_output,
            )
        elif sequence_parallel and isinstance(style, RowwiseParallel):
            style = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=seq, use_local_output=False)
        out[name] = style
    if sequence_parallel:
        for name, module in model.named_modules():
            if name in out or not name:
                continue
            weight = getattr(module, "weight", None)
            width = weight.shape[-1] if weight is not None and weight.dim() >= 1 else None
            if _is_norm(module) and width in hidden:
                out[name] = SequenceParallel()
            elif isinstance(module, nn.Embedding) and module.embedding_dim in hidden:
                out[name] = PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=False
                )
    return out


def _loss_ops_enabled() -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    return all(op in DTensor._op_dispatcher._custom_op_handlers for op in customized_loss_ops)


@contextlib.contextmanager
def loss_parallel_context() -> Iterator[None]:
    """torch's ``loss_parallel()``, entered only when not active already (it does not nest)."""
    if _loss_ops_enabled():
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def install_loss_parallel(module: nn.Module) -> None:
    """The module's forward (the Trainer's training/validation step, a transformers model computing
    its loss from ``labels``) runs under ``loss_parallel_context``."""
    stack: list = []

    def enter(*_: Any) -> None:
        ctx = loss_parallel_context()
        ctx.__enter__()
        stack.append(ctx)

    def leave(*_: Any) -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
