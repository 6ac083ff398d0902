"""Small helpers over nested batches (tensors inside dicts, lists, tuples, namedtuples, dataclasses)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List

import torch


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` applied to every tensor in ``data``, keeping the container types."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)((k, apply_to_tensors(v, fn)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(apply_to_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_tensors(v, fn) for v in data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return dataclasses.replace(
            data, **{f.name: apply_to_tensors(getattr(data, f.name), fn) for f in dataclasses.fields(data) if f.init}
        )
    return data


def move_to_device(data: Any, device: torch.device) -> Any:
    non_blocking = device.type == "cuda"
    return apply_to_tensors(data, lambda t: t.to(device, non_blocking=non_blocking))


def batch_size_of(batch: Any) -> int:
    """Leading dim of the first tensor found (1 when none)."""
    found: List[torch.Tensor] = []

    def first(t: torch.Tensor) -> torch.Tensor:
        if not found:
            found.append(t)
        return t

    apply_to_tensors(batch, first)
    if found and found[0].dim() > 0:
        return int(found[0].shape[0])
    return len(batch) if hasattr(batch, "__len__") and not isinstance(batch, (str, bytes, dict)) else 1
