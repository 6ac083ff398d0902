"""Big-model inference reachable from the Accelerator (a mixin of ``Accelerator``), as in
Accelerate: the same functions as ``trainforge.trainer.inference``."""

from __future__ import annotations

from typing import Any, Dict

from torch import nn


class BigModelInference:
    """Mixed into ``Accelerator``: static methods only."""

    # Big-model inference (trainer/inference): the same functions, reachable from the Accelerator.
    @staticmethod
    def init_empty_weights(include_buffers: bool = True) -> Any:
        """Context: modules built inside have their weights on meta (see trainer.inference)."""
        from trainforge.trainer.inference import init_empty_weights

        return init_empty_weights(include_buffers)

    @staticmethod
    def infer_auto_device_map(model: nn.Module, **kwargs: Any) -> Dict[str, Any]:
        from trainforge.trainer.inference import infer_auto_device_map

        return infer_auto_device_map(model, **kwargs)

    @staticmethod
    def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: Any, **kwargs: Any) -> nn.Module:
        from trainforge.trainer.inference import load_checkpoint_and_dispatch

        return load_checkpoint_and_dispatch(model, checkpoint, **kwargs)

    @staticmethod
    def dispatch_model(model: nn.Module, device_map: Dict[str, Any], **kwargs: Any) -> nn.Module:
        from trainforge.trainer.inference import dispatch_model

        return dispatch_model(model, device_map, **kwargs)

    @staticmethod
    def cpu_offload(model: nn.Module, execution_device: Any = None, **kwargs: Any) -> nn.Module:
        from trainforge.trainer.inference import cpu_offload

        return cpu_offload(model, execution_device, **kwargs)

    @staticmethod
    def disk_offload(model: nn.Module, offload_dir: Any, execution_device: Any = None, **kwargs: Any) -> nn.Module:
        from trainforge.trainer.inference import disk_offload

        return disk_offload(model, offload_dir, execution_device, **kwargs)
