"""The names Accelerate 1.15 exports at its top level (``accelerate/__init__.py``), importable from ``trainforge``
too, so that ``from accelerate import Accelerator, DataLoaderConfiguration, find_executable_batch_size`` becomes
``from trainforge import ...`` (Accelerate's ``checkpointing.py`` example imports that way). Names trainforge has
are its own objects (the same as in ``trainforge.utils``); those it does differently refuse when called or built,
saying what to use instead (``debug_launcher``, ``prepare_pippy``, ``ParallelismConfig``, ...)."""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.compat.accelerate.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    refusing,
)
from trainforge.trainer.compat.accelerate.imports import is_rich_available
from trainforge.trainer.inference import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)


def _refusing_function(name: str, instead: str) -> Callable[..., NoReturn]:
    """A function named like Accelerate's that refuses to run, saying what trainforge uses instead."""

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise ConfigurationError(f"{name} is Accelerate's; trainforge does not have it. {instead}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Refused (Accelerate's): {instead}"
    return refuse


cpu_offload_with_hook = _refusing_function(
    "cpu_offload_with_hook",
    "Use cpu_offload(model, execution_device) (the weights stay on the CPU and move for each forward) or "
    "dispatch_model(model, device_map) to place the models of a pipeline",
)
init_on_device = _refusing_function(
    "init_on_device",
    "Use init_empty_weights() to build on the meta device, or `with torch.device(device):` to build on a device",
)
load_checkpoint_in_model = _refusing_function(
    "load_checkpoint_in_model",
    "Use load_checkpoint_and_dispatch(model, checkpoint, device_map=...) or trainforge.load_pretrained",
)
synchronize_rng_states = _refusing_function(
    "synchronize_rng_states",
    "Seed every process with set_seed(seed); a prepared DataLoader draws its shuffling order from one seed "
    "shared by all processes, and the RNGSync callback keeps the Trainer's generators in step",
)
debug_launcher = _refusing_function(
    "debug_launcher",
    "Use notebook_launcher(function, args, num_processes=2) and Accelerator(cpu=True) inside the function",
)
prepare_pippy = _refusing_function(
    "prepare_pippy",
    "trainforge has no pipeline-parallel inference: place the model across devices with "
    "load_checkpoint_and_dispatch(model, checkpoint, device_map='auto') or dispatch_model(model, device_map)",
)
ParallelismConfig = refusing(
    "ParallelismConfig",
    "Pass the layout to a strategy: strategy=MegatronStrategy(tensor_parallel_size=..., "
    "pipeline_parallel_size=...) or FSDPStrategy(...) (trainforge.strategies) to the Accelerator",
)

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "ProfileKwargs",
    "cpu_offload",
    "cpu_offload_with_hook",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "is_rich_available",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "prepare_pippy",
    "synchronize_rng_states",
]
