"""Strategies own placement and parallelism. ``resolve_strategy`` turns a user's choice into one."""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from trainforge.strategies.base import Strategy
from trainforge.strategies.ddp import DDPStrategy
from trainforge.strategies.errors import CheckpointError, ConfigurationError, LaunchError, TrainforgeError
from trainforge.strategies.single import SingleDeviceStrategy

# name -> "module:Class"; imported on first use so a backend library is needed only when chosen.
_REGISTRY = {
    "single": "trainforge.strategies.single:SingleDeviceStrategy",
    "ddp": "trainforge.strategies.ddp:DDPStrategy",
    "fsdp": "trainforge.strategies.fsdp:FSDPStrategy",
    "deepspeed": "trainforge.strategies.deepspeed:DeepSpeedStrategy",
    "megatron": "trainforge.strategies.megatron:MegatronStrategy",
    "xla": "trainforge.strategies.xla:XLAStrategy",  # imports torch_xla only in setup_environment; never picked by "auto"
}
_NOT_BUILT: dict = {}
STRATEGY_NAMES = ("auto",) + tuple(_REGISTRY)
# Lightning's strategy names -> (trainforge's name, constructor arguments)
LIGHTNING_ALIASES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "single_device": ("single", {}),
    "ddp_find_unused_parameters_true": ("ddp", {"find_unused_parameters": True}),
    "ddp_find_unused_parameters_false": ("ddp", {}),
    "fsdp_cpu_offload": ("fsdp", {"cpu_offload": True}),
    "deepspeed_stage_1": ("deepspeed", {"stage": 1}),
    "deepspeed_stage_2": ("deepspeed", {"stage": 2}),
    "deepspeed_stage_2_offload": ("deepspeed", {"stage": 2, "offload_optimizer": True}),
    "deepspeed_stage_3": ("deepspeed", {"stage": 3}),
    "deepspeed_stage_3_offload": ("deepspeed", {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    "deepspeed_stage_3_offload_nvme": (
        "deepspeed",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True, "offload_device": "nvme"},
    ),
    "single_xla": ("xla", {}),
}
_NO_SPAWN = (
    "trainforge starts one process per device by running the script again (Trainer(devices=N) from "
    "`python script.py`, as Lightning's 'ddp') or with `trainforge launch --nproc-per-node N script.py`; "
    "pass strategy='ddp'"
)
# Lightning's names trainforge refuses, with what to do instead
LIGHTNING_REFUSED = {
    "ddp_spawn": _NO_SPAWN,
    "ddp_fork": _NO_SPAWN + " (in a notebook: trainforge.notebook_launcher(fn, num_processes=N))",
    "ddp_notebook": "in a notebook, start the processes with trainforge.notebook_launcher(fn, num_processes=N) "
    "and pass strategy='ddp'",
    "dp": "DataParallel is not supported (Lightning 2 removed it too); pass strategy='ddp'",
}


def strategy_class(name: str) -> type:
    refused = next((k for k in LIGHTNING_REFUSED if name == k or name.startswith(k + "_find_unused")), None)
    if refused is not None:
        raise ConfigurationError(f"strategy={name!r} (Lightning's) is not supported: {LIGHTNING_REFUSED[refused]}")
    if name in _NOT_BUILT:
        raise ConfigurationError(
            f"strategy={name!r} ({_NOT_BUILT[name]}) is not available in this version of trainforge; "
            f"choose one of: {', '.join(STRATEGY_NAMES)}"
        )
    if name not in _REGISTRY:
        raise ConfigurationError(
            f"strategy={name!r} is not one of: {', '.join(STRATEGY_NAMES)} (or Lightning's "
            f"{', '.join(LIGHTNING_ALIASES)}); or pass a Strategy object"
        )
    module_name, cls_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def resolve_strategy(
    strategy: Union[str, Strategy, None] = "auto", environ: Optional[Mapping[str, str]] = None, **kwargs: Any
) -> Strategy:
    """``"auto"``: several processes in the environment -> DDP, one -> single device."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, type):
        names = [n for n in STRATEGY_NAMES if n != "auto" and strategy_class(n) is strategy]
        raise ConfigurationError(
            f"strategy={strategy.__name__} is a class; pass an instance, "
            f"strategy={strategy.__name__}(...)" + (f", or its name {names[0]!r}" if names else "")
        )
    if strategy is not None and not isinstance(strategy, str):
        raise ConfigurationError(
            f"strategy={strategy!r} is neither a name ({', '.join(STRATEGY_NAMES)}) nor a Strategy instance"
        )
    name = "auto" if strategy is None else str(strategy).lower()
    if name == "auto":
        from trainforge.strategies.environment import detect_environment

        env = detect_environment(os.environ if environ is None else environ)
        name = "ddp" if env.world_size > 1 else "single"
    if name in LIGHTNING_ALIASES:
        name, preset = LIGHTNING_ALIASES[name]
        kwargs = {**preset, **kwargs}
    return strategy_class(name)(**kwargs)


__all__ = [
    "Strategy",
    "SingleDeviceStrategy",
    "DDPStrategy",
    "resolve_strategy",
    "strategy_class",
    "STRATEGY_NAMES",
    "TrainforgeError",
    "ConfigurationError",
    "CheckpointError",
    "LaunchError",
]


def __getattr__(name: str) -> Any:  # lazy FSDPStrategy / DeepSpeedStrategy
    for key, target in _REGISTRY.items():
        if target.endswith(":" + name):
            return strategy_class(key)
    raise AttributeError(f"module 'trainforge.strategies' has no attribute {name!r}")
