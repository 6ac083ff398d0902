"""What a ``TrainingModule`` does with the world outside the loop, as a LightningModule does:
``all_gather`` across processes, ``to_torchscript`` and ``to_onnx`` (torch's own exporters)."""

from __future__ import annotations

from typing import Any

import torch

from trainforge.strategies.errors import ConfigurationError, invalid_choice

_JIT_METHODS = ("script", "trace")


def module_all_gather(module: Any, data: Any, group: Any, sync_grads: bool) -> Any:
    """Lightning's ``all_gather``: numbers become tensors on the module's device; each tensor gathered."""
    from trainforge.strategies.data.utils import apply_to_tensors

    trainer = module._trainer
    world = trainer.world_size if trainer is not None else 1
    data = _as_tensors(data, module.device)
    if world == 1:
        return data
    if group is not None:
        raise ConfigurationError("all_gather(group=...): only the default group (all processes) is supported")
    if sync_grads:
        import torch.distributed.nn.functional as dist_fn

        return apply_to_tensors(data, lambda t: torch.stack(dist_fn.all_gather(t.contiguous())))
    return apply_to_tensors(data, trainer.strategy.all_gather)


def _as_tensors(data: Any, device: torch.device) -> Any:
    if isinstance(data, (int, float, bool)):
        return torch.tensor(data, device=device)
    if isinstance(data, dict):
        return {k: _as_tensors(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_as_tensors(v, device) for v in data)
    return data


def export_torchscript(module: Any, file_path: Any, method: str, example_inputs: Any, **kwargs: Any) -> Any:
    if method not in _JIT_METHODS:
        raise invalid_choice("to_torchscript(method)", method, _JIT_METHODS)
    mode = module.training
    module.eval()
    # torch.jit reads every attribute: ``trainer`` is None then instead of an error (as in Lightning)
    module.__dict__["_jit_is_scripting"] = True
    try:
        if method == "script":
            scripted = torch.jit.script(module, **kwargs)
        else:
            example = example_inputs if example_inputs is not None else getattr(module, "example_input_array", None)
            if example is None:
                raise ConfigurationError(
                    "to_torchscript(method='trace') needs example_inputs=..., or set self.example_input_array"
                )
            scripted = torch.jit.trace(module, example_inputs=example, **kwargs)
    finally:
        module.__dict__.pop("_jit_is_scripting", None)
        module.train(mode)
    if file_path is not None:
        torch.jit.save(scripted, file_path)
    return scripted


def export_onnx(module: Any, file_path: Any, input_sample: Any, **kwargs: Any) -> Any:
    sample = input_sample if input_sample is not None else getattr(module, "example_input_array", None)
    if sample is None:
        raise ConfigurationError("to_onnx needs input_sample=..., or set self.example_input_array")
    mode = module.training
    module.eval()
    try:
        return torch.onnx.export(module, sample if isinstance(sample, tuple) else (sample,), file_path, **kwargs)
    finally:
        module.train(mode)
