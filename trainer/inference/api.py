"""Big-model inference reachable from the Accelerator, as in Accelerate: ``Accelerator.init_empty_weights``
and the others are these functions (static attributes of the class), which import ``trainer/inference``
on first use so that ``import trainforge`` does not."""

from __future__ import annotations

from typing import Any, Dict

from torch import nn


def init_empty_weights(include_buffers: bool = True) -> Any:
    """Context: modules built inside have their weights on meta (see trainer.inference)."""
    from trainforge.trainer.inference import init_empty_weights

    return init_empty_weights(include_buffers)


def infer_auto_device_map(model: nn.Module, **kwargs: Any) -> Dict[str, Any]:
    """Where each submodule of ``model`` goes (``trainforge.trainer.inference.infer_auto_device_map``)."""
    from trainforge.trainer.inference import infer_auto_device_map

    return infer_auto_device_map(model, **kwargs)


def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: Any, **kwargs: Any) -> nn.Module:
    """Load ``checkpoint`` into ``model`` and place it per a device map (``trainforge.trainer.inference``)."""
    from trainforge.trainer.inference import load_checkpoint_and_dispatch

    return load_checkpoint_and_dispatch(model, checkpoint, **kwargs)


def dispatch_model(model: nn.Module, device_map: Dict[str, Any], **kwargs: Any) -> nn.Module:
    """Place ``model``'s submodules per ``device_map`` (``trainforge.trainer.inference.dispatch_model``)."""
    from trainforge.trainer.inference import dispatch_model

    return dispatch_model(model, device_map, **kwargs)


def cpu_offload(model: nn.Module, execution_device: Any = None, **kwargs: Any) -> nn.Module:
    """Keep ``model``'s weights on the CPU, moved to ``execution_device`` for each forward."""
    from trainforge.trainer.inference import cpu_offload

    return cpu_offload(model, execution_device, **kwargs)


def disk_offload(model: nn.Module, offload_dir: Any, execution_device: Any = None, **kwargs: Any) -> nn.Module:
    """Keep ``model``'s weights memory-mapped in ``offload_dir``, moved to ``execution_device`` for each forward."""
    from trainforge.trainer.inference import disk_offload

    return disk_offload(model, offload_dir, execution_device, **kwargs)
