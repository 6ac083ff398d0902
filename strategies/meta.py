"""Building models without memory (``init_empty_weights``) and keeping weight ties (used by the
inference dispatch and by the strategies that materialise a model built on the meta device).

Torch 2.13 breaks ties on ``to_empty`` and on ``load_state_dict(assign=True)``: each name gets its
own tensor. ``tie_groups`` records them beforehand (parameter identity, plus a transformers model's
``all_tied_weights_keys``/``_tied_weights_keys``) and ``retie`` makes every name of a group point to
the group's first parameter again.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = True) -> Iterator[None]:
    """Modules built inside get their parameters and persistent buffers (unless
    ``include_buffers=False``) on the meta device: shapes and dtypes, no memory, no init cost.

    Non-persistent buffers (rotary ``inv_freq``, causal masks) stay real: no checkpoint holds them,
    so their computed values could not be loaded back. Each parameter is moved to meta as soon as it
    is registered, before the module's ``reset_parameters`` runs, so initialisation costs nothing.
    """
    if not isinstance(include_buffers, bool):
        raise ConfigurationError(f"include_buffers={include_buffers!r} must be True or False")
    reg_param, reg_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        reg_param(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    def register_buffer(module: nn.Module, name: str, tensor: Optional[torch.Tensor], persistent: bool = True) -> None:
        if tensor is not None and persistent:
            tensor = tensor.to("meta")
        reg_buffer(module, name, tensor, persistent=persistent)

    # setattr: patching a method of the class (mypy would check it as a bound method)
    setattr(nn.Module, "register_parameter", register_parameter)  # noqa: B010
    if include_buffers:
        setattr(nn.Module, "register_buffer", register_buffer)  # noqa: B010
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", reg_param)  # noqa: B010
        setattr(nn.Module, "register_buffer", reg_buffer)  # noqa: B010


def _hf_ties(model: nn.Module) -> Dict[str, str]:
    for attr in ("all_tied_weights_keys", "_tied_weights_keys"):
        ties = getattr(model, attr, None)
        if isinstance(ties, dict):
            return {str(k): str(v) for k, v in ties.items()}
    return {}


def shared_tensor_groups(model: nn.Module) -> List[List[str]]:
    """Every parameter's names, grouped by the tensor object they name now (groups of one included)."""
    by_id: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return list(by_id.values())


def tie_groups(model: nn.Module) -> List[List[str]]:
    """Groups (size >= 2) of parameter names that must share one tensor, each group's names in
    module order; the first name is the one a checkpoint holds."""
    shared = shared_tensor_groups(model)
    names = {n for group in shared for n in group}
    parent = {n: n for n in names}

    def find(n: str) -> str:
        while parent[n] != n:
            n = parent[n]
        return n

    for group in shared:
        for n in group[1:]:
            parent[find(n)] = find(group[0])
    declared = {  # a transformers model's ties, also when it is a submodule (a TrainingModule's self.model)
        f"{prefix}{target}": f"{prefix}{source}"
        for mod_name, mod in model.named_modules()
        for prefix in [f"{mod_name}." if mod_name else ""]
        for target, source in _hf_ties(mod).items()
    }
    for target, source in declared.items():
        if target in names and source in names:
            parent[find(target)] = find(source)
    order = {n: i for i, n in enumerate(names_in_order(model))}
    groups: Dict[str, List[str]] = {}
    for n in names:
        groups.setdefault(find(n), []).append(n)
    return sorted((sorted(g, key=order.__getitem__) for g in groups.values() if len(g) > 1), key=lambda g: order[g[0]])


def names_in_order(model: nn.Module) -> List[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False)]


def get_param(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, leaf = name.rpartition(".")
    return model.get_submodule(module_name)._parameters[leaf]  # type: ignore[return-value]


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` under ``name`` (parameter or buffer) as it is: no copy, no device check."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        module._parameters[leaf] = value
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise KeyError(name)


def retie(model: nn.Module, groups: List[List[str]]) -> None:
    """Every name of each group points to the group's first parameter again."""
    for group in groups:
        first = get_param(model, group[0])
        for name in group[1:]:
            set_tensor(model, name, first)


def materialize(model: nn.Module, device="cpu") -> nn.Module:
    """``to_empty(device=device)`` with the ties recorded on the meta model restored."""
    groups = tie_groups(model)
    model.to_empty(device=device)
    retie(model, groups)
    return model
