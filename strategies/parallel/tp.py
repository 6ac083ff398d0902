"""Tensor parallelism (Megatron's column/row scheme) from a plan, on the ``tp`` mesh dimension.

A plan maps module-path globs (``*`` is one path component: ``blocks.*.mlp.0``) to a
``ParallelStyle`` or one of the names in ``STYLE_NAMES`` (Hugging Face's words included, so a
model's own ``_tp_plan`` is read unchanged). ``"auto"`` reads the plan a transformers model ships
(``model._tp_plan``, else ``config.base_model_tp_plan``). ``parallelize_module`` turns each chosen
module's parameters into ``DTensor`` shards; activations between a colwise and the following
rowwise layer stay sharded, so a block costs one all-reduce forward and one backward.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from torch import nn

from trainforge.strategies.errors import ConfigurationError, invalid_choice

Plan = Union[None, str, Mapping[str, Any]]


def _styles() -> Dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel,
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }


STYLE_NAMES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "colwise_gather_output",
    "rowwise_rep",
    "embedding_rowwise",
    "sequence_parallel",
)
EXAMPLE_PLAN = '{"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise", "head": "colwise_rep"}'


def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def hf_plan(model: nn.Module) -> Dict[str, str]:
    """The plan of the outermost transformers model inside ``model``, its keys prefixed by its path."""
    for name, sub in model.named_modules():
        config = getattr(sub, "config", None)
        plan = dict(getattr(sub, "_tp_plan", None) or {})
        if not plan and config is not None and getattr(config, "base_model_tp_plan", None):
            base = getattr(sub, "base_model_prefix", "")
            inner = base if base and hasattr(sub, base) else ""
            plan = {(f"{inner}.{k}" if inner else k): v for k, v in config.base_model_tp_plan.items()}
        if plan:
            return {(f"{name}.{k}" if name else k): v for k, v in plan.items()}
    return {}


def _no_plan_error(model: nn.Module) -> ConfigurationError:
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    shown = ", ".join(linears[:20]) + (f", ... ({len(linears)} in all)" if len(linears) > 20 else "")
    return ConfigurationError(
        f"{type(model).__name__} has no tensor-parallel plan (tp_plan='auto' reads a transformers model's "
        f"_tp_plan / config.base_model_tp_plan); pass tp_plan={{glob: style}}. Its Linear layers: "
        f"{shown or 'none'}. Styles: {', '.join(STYLE_NAMES)} or a ParallelStyle. Example: {EXAMPLE_PLAN}"
    )


def resolve_plan(model: nn.Module, plan: Plan, tp_size: int) -> Dict[str, Any]:
    """``{module name: ParallelStyle}``; every glob must match and every sharded size divide by tp."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if plan is None or plan == "auto":
        plan = hf_plan(model)
        if not plan:
            raise _no_plan_error(model)
    elif isinstance(plan, str) or not isinstance(plan, Mapping):
        raise ConfigurationError(
            f"tp_plan={plan!r} must be None or 'auto' (the model's own plan) or a dict "
            f"{{module glob: style}}, e.g. {EXAMPLE_PLAN}"
        )
    styles, names = _styles(), [n for n, _ in model.named_modules() if n]
    resolved: Dict[str, Any] = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in styles:
                raise invalid_choice(f"tp_plan[{pattern!r}]", style, STYLE_NAMES, "or pass a ParallelStyle object")
        elif not isinstance(style, ParallelStyle):
            raise ConfigurationError(
                f"tp_plan[{pattern!r}]={style!r} is neither a style name ({', '.join(STYLE_NAMES)})"
                " nor a torch.distributed.tensor.parallel.ParallelStyle"
            )
        matched = [n for n in names if _glob(pattern).match(n)]
        if not matched:
            raise ConfigurationError(
                f"tp_plan glob {pattern!r} matches no module of {type(model).__name__}; "
                f"module names look like: {', '.join(names[:12])}"
            )
        for name in matched:
            resolved[name] = styles[style]() if isinstance(style, str) else style
            _check_divisible(name, model.get_submodule(name), style, tp_size)
    _check_heads(model, tp_size)
    return resolved


def _check_divisible(name: str, module: nn.Module, style: Any, tp: int) -> None:
    kind = style if isinstance(style, str) else type(style).__name__.lower()
    sizes: List[Tuple[str, int]] = []
    if isinstance(module, nn.Linear):
        sizes = [("out_features", module.out_features)] if "col" in kind else [("in_features", module.in_features)]
    elif isinstance(module, nn.Embedding):
        sizes = (
            [("num_embeddings", module.num_embeddings)] if "row" in kind else [("embedding_dim", module.embedding_dim)]
        )
    for attr, size in sizes:
        if size % tp:
            raise ConfigurationError(
                f"tensor_parallel_size={tp} does not divide {name}.{attr}={size}; choose a "
                f"tensor_parallel_size that divides it (or leave {name} out of tp_plan)"
            )


def _check_heads(model: nn.Module, tp: int) -> None:
    for sub in model.modules():
        config = getattr(sub, "config", None)
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, attr, None) if config is not None else None
            if isinstance(value, int) and value % tp:
                raise ConfigurationError(
                    f"tensor_parallel_size={tp} does not divide {attr}={value} of "
                    f"{type(sub).__name__}; each tp rank must hold whole heads: use a "
                    f"tensor_parallel_size that divides {value}"
                )


def apply_tp(
    model: nn.Module,
    tp_mesh: Any,
    plan: Plan,
    only: Optional[Callable[[str], bool]] = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> Dict[str, Any]:
    """Shard ``model`` in place; returns the coverage report (which weights are sharded). ``plan``
    may be resolved already (``resolve_plan``); ``only`` keeps the modules this rank holds (pipeline).
    ``sequence_parallel``/``loss_parallel``: the plan rewritten by ``sp.rewrite_plan``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from trainforge.strategies.parallel.sp import rewrite_plan

    if only is None:
        resolved = resolve_plan(model, plan, tp_mesh.size())
    elif isinstance(plan, Mapping):
        resolved = {name: style for name, style in plan.items() if only(name)}
    else:  # with ``only`` the plan comes resolved: a dict
        raise TypeError(f"apply_tp(only=...) needs a resolved plan (a dict), not {plan!r}")
    if sequence_parallel or loss_parallel:
        resolved = rewrite_plan(model, resolved, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    total = sum(p.numel() for p in model.parameters())
    sharded_names = [
        f"{m}.{p}"
        for m, style in resolved.items()
        if isinstance(style, (ColwiseParallel, RowwiseParallel))
        for p, _ in model.get_submodule(m).named_parameters()
    ]
    sharded = sum(model.get_parameter(n).numel() for n in sharded_names)
    parallelize_module(model, tp_mesh, resolved)
    return {
        "modules": len(resolved),
        "sharded_params": sharded_names,
        "sharded_numel": sharded,
        "total_numel": total,
        "fraction": sharded / max(total, 1),
    }
