"""How the Accelerator calls a prepared model: its forward under autocast (Accelerate's mixed precision) and a
module's step method through the wrapper's ``forward`` (so that DDP's reducer and FSDP's gathering see it)."""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn

from trainforge.strategies.data.utils import apply_to_tensors
from trainforge.strategies.precision import Precision
from trainforge.trainer.loop.module_hooks import STEP_NAMES, step_arguments


def autocast_forward(module: nn.Module, precision: Precision) -> None:
    """Make ``module``'s forward compute under ``precision``'s autocast and return float32 tensors, with or
    without ``accelerator.autocast()`` around the call; once (a forward already wrapped is left as it is)."""
    if getattr(module.forward, "_trainforge_autocast", False):
        return
    forward = getattr(module.forward, "__func__", None)
    if forward is None:  # a forward set on the instance: wrap it as it is
        bound = module.forward

        def forward(self_: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return bound(*args, **kwargs)

    def autocast_forward(self_: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with precision.autocast():
            out = forward(self_, *args, **kwargs)
        return apply_to_tensors(out, _to_float32)

    autocast_forward._trainforge_autocast = True  # type: ignore[attr-defined]
    # bound to the module: a deepcopy of the model binds the copy (copy handles MethodType)
    module.forward = types.MethodType(autocast_forward, module)


def bound_step(model: nn.Module, user: nn.Module, method: str, redirect_forward: bool) -> Callable[..., Any]:
    """``user.<method>`` as one callable; where ``model`` wraps ``user`` and the strategy redirects steps
    (``redirect_forward``), called through ``model``'s forward."""
    step: Callable = getattr(user, method)
    if method in STEP_NAMES:  # training_step(self, batch) is called without batch_idx (Lightning)
        step = step_arguments(step)
    if model is user and not redirect_forward:
        return step

    def through_forward(*args: Any) -> Any:
        original = user.__dict__.get("forward")

        def redirected(*a: Any, **k: Any) -> Any:
            _restore_forward(user, original)
            return step(*a, **k)

        user.forward = redirected
        try:
            return model(*args)
        finally:
            _restore_forward(user, original)

    return through_forward


def _restore_forward(module: nn.Module, original: Any) -> None:
    if original is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original


def _to_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
