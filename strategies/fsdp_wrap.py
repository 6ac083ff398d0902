"""Which submodules FSDP shards as units (and activation_checkpointing wraps) for ``FSDPStrategy``.

Applied in torchtitan's order (``apply_ac`` -> ``apply_fsdp`` on blocks -> root)::

    units = select_modules(model, policy)                 # [(name, module)], bottom-up, root excluded
    wrappers = strategy.wrap_activation_blocks(model, ...)  # strategies/activation_memory.py
    units = [(n, wrappers.get(id(m), m)) for n, m in units]
    ... fully_shard(m) for each unit, then fully_shard(model)

A policy is ``None`` (the repeated blocks, see ``repeated_blocks``), a set of classes or class names,
or a callable ``(module, name) -> bool``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError

log = logging.getLogger("trainforge")
Named = List[Tuple[str, nn.Module]]
#: The prefix ``checkpoint_wrapper`` (activation_memory.py) puts before the wrapped module's names.
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def repeated_blocks(model: nn.Module) -> Named:
    """The outermost children of ``nn.ModuleList``/``nn.Sequential`` containers whose (>= 2) elements
    all share one class and all have parameters: transformer blocks (GPT2's ``h``, Llama's
    ``layers``), ResNet stages... Blocks nested inside a block already found are not repeated."""
    found: Named = []
    inside: List[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.named_children())
        classes = {type(child) for _, child in children}
        if len(classes) == 1 and all(any(True for _ in child.parameters()) for _, child in children):
            for child_name, child in children:
                full = f"{name}.{child_name}" if name else child_name
                found.append((full, child))
                inside.append(full + ".")
    return found


def _class_matcher(classes: Iterable[Any]) -> Callable[[nn.Module, str], bool]:
    types = tuple(c for c in classes if isinstance(c, type))
    names = {c for c in classes if isinstance(c, str)}
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise ConfigurationError(
            f"wrap policy entry {bad[0]!r} is neither a module class nor a class name; give "
            "a set such as {{GPT2Block}} or {{'GPT2Block'}}, or a callable (module, name) -> bool"
        )
    return lambda module, name: isinstance(module, types) or type(module).__name__ in names


def select_modules(model: nn.Module, policy: Any) -> Named:
    """``(name, module)`` pairs the policy picks, descendants before their ancestors (the order
    ``fully_shard`` must be applied in), never the root itself."""
    if policy is None or policy is True:
        chosen = repeated_blocks(model)
        order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
        return sorted(chosen, key=lambda nm: -order[id(nm[1])])
    if policy is False:
        return []
    if isinstance(policy, (set, frozenset, list, tuple)):
        match = _class_matcher(policy)
        if not policy:
            raise ConfigurationError(
                "wrap policy is an empty set; pass None for the automatic choice of repeated "
                "blocks, or name at least one module class"
            )
    elif callable(policy):
        match = policy
    else:
        raise ConfigurationError(
            f"wrap policy {policy!r} is not one of: None (repeated blocks), a set of module "
            "classes or class names, or a callable (module, name) -> bool"
        )
    chosen = [(name, m) for name, m in model.named_modules() if name and match(m, name)]
    if isinstance(policy, (set, frozenset, list, tuple)) and not chosen:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigurationError(
            f"wrap policy {sorted(map(_label, policy))} matches no module of "
            f"{type(model).__name__}; its module classes are: {', '.join(present)}"
        )
    return list(reversed(chosen))


def _label(c: Any) -> str:
    return c if isinstance(c, str) else c.__name__


def clean_name(name: str) -> str:
    """A parameter/module name without the activation-checkpointing wrapper's prefix."""
    return name.replace(CHECKPOINT_PREFIX, "")


# ---- shared by FSDPStrategy, MegatronStrategy (its data-parallel dimension) and XLAStrategy ----
@contextlib.contextmanager
def no_gradient_sync(module: Any) -> Iterator[None]:
    """FSDP2 module: no reduce-scatter (nor HSDP all-reduce) for the backward passes inside."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def remap_optimizers(
    before: List[Tuple[str, nn.Parameter]], module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Point optimizers built on the original parameters at the sharded ones (matched by name),
    dropping any state they had (it described unsharded tensors)."""
    after = {clean_name(name): p for name, p in module.named_parameters()}
    new = {}
    for name, old in before:
        if name not in after:
            raise ConfigurationError(
                f"parameter {name!r} disappeared while sharding; keep every parameter registered "
                "on the module passed to prepare()"
            )
        new[id(old)] = after[name]
    for opt in optimizers:
        if opt.state:
            log.warning(
                "trainforge: %s had state before FSDP sharding; it is discarded (create or prepare the "
                "optimizer before its first step)",
                type(opt).__name__,
            )
        for group in opt.param_groups:
            missing = [tuple(p.shape) for p in group["params"] if id(p) not in new]
            if missing:
                raise ConfigurationError(
                    f"{type(opt).__name__} holds parameters of shapes {missing[:3]} that are not "
                    "in the prepared model; prepare the model together with its own optimizer"
                )
            group["params"] = [new[id(p)] for p in group["params"]]
        opt.state.clear()
