"""HF Accelerate's ``Accelerator`` arguments that a ported script uses, on trainforge's ``Accelerator``:
``AccelerateOptions`` checks them and translates them to trainforge's (Accelerate's members are the
Accelerator's own, in ``trainer/accelerator/accelerator.py``).

Arguments: ``mixed_precision`` ("no", "fp16", "bf16", "fp8": trainforge's precisions "32", "16-mixed",
"bf16-mixed", "fp8"), ``cpu=True`` (``accelerator="cpu"``), ``kwargs_handlers`` (the handlers of
``trainforge.utils``: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``, ``InitProcessGroupKwargs``),
``rng_types`` (only ``"generator"``, which trainforge always does), ``device_placement``,
``log_with`` (``trackers.py``), and ``project_config``/``dataloader_config``
(``dataclasses.py``). Accelerate's other arguments (plugins, dynamo) are refused with the
trainforge way in the message.
"""

from __future__ import annotations

import gc
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from trainforge.strategies.checkpoint.remote import is_remote
from trainforge.strategies.errors import ConfigurationError, invalid_choice
from trainforge.trainer.compat.accelerate.dataclasses import (
    HANDLERS,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    check_loader_extras,
    check_project_extras,
)
from trainforge.trainer.compat.accelerate.trackers import parse_log_with
from trainforge.trainer.loop.profiling import ProfileKwargs

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.precision import Precision

MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
RNG_TYPES = ("torch", "cuda", "xla", "generator")
_INSTEAD = {
    "deepspeed_plugin": "strategy=DeepSpeedStrategy(stage=..., ...) or strategy='deepspeed'",
    "deepspeed_plugins": "strategy=DeepSpeedStrategy(stage=..., ...) (one DeepSpeed configuration per Accelerator)",
    "fsdp_plugin": "strategy=FSDPStrategy(sharding_strategy=..., ...) or strategy='fsdp'",
    "megatron_lm_plugin": "strategy=MegatronStrategy(tensor_parallel_size=..., pipeline_parallel_size=...)",
    "torch_tp_plugin": "strategy=MegatronStrategy(tensor_parallel_size=...)",
    "parallelism_config": "strategy=MegatronStrategy(tensor_parallel_size=..., pipeline_parallel_size=..., "
    "data_parallel_size=...)",
    "gradient_accumulation_plugin": "gradient_accumulation_steps=<num_steps>",
    "dynamo_backend": "model = torch.compile(model, backend=...) before accelerator.prepare(model)",
    "dynamo_plugin": "model = torch.compile(model, backend=..., mode=...) before accelerator.prepare(model)",
}
_PROCESS_GROUP_STRATEGIES = ("ddp", "fsdp", "deepspeed", "megatron")


class AccelerateOptions:
    """Accelerate's constructor arguments, checked (a bad value fails before any process group starts)
    and turned into trainforge's."""

    def __init__(
        self,
        *,
        precision: Optional[str],
        mixed_precision: Optional[str],
        accelerator: Optional[str],
        cpu: bool,
        kwargs_handlers: Optional[List[Any]],
        rng_types: Optional[List[str]],
        device_placement: bool,
        log_with: Any,
        dataloader_config: Any,
        project_config: Any,
        others: Dict[str, Any],
    ) -> None:
        _refuse_others(others)
        self.precision = _precision(precision, mixed_precision)
        if not isinstance(cpu, bool):
            raise ConfigurationError(f"cpu={cpu!r} must be True or False")
        if cpu and accelerator not in (None, "auto", "cpu"):
            raise ConfigurationError(f"cpu=True and accelerator={accelerator!r} disagree: pass one of them")
        self.accelerator = "cpu" if cpu else accelerator
        if not isinstance(device_placement, bool):
            raise ConfigurationError(f"device_placement={device_placement!r} must be True or False")
        self.device_placement = device_placement
        self.handlers = _handlers(kwargs_handlers)
        self.profile_handler: Optional[ProfileKwargs] = self.handlers.get(ProfileKwargs)  # profile()'s default
        self.rng_types = _rng_types(rng_types)
        self.log_with = log_with
        self.dataloader_config, self.project_config = dataloader_config, project_config
        if dataloader_config is not None and not isinstance(dataloader_config, DataLoaderConfiguration):
            # Accelerate's own object (duck-typed): its extra fields are checked as ours are
            check_loader_extras(
                getattr(dataloader_config, "use_seedable_sampler", False),
                getattr(dataloader_config, "data_seed", None),
                getattr(dataloader_config, "non_blocking", False),
                getattr(dataloader_config, "use_stateful_dataloader", False),
            )
        self.logging_dir: Optional[str] = None

    def loader_arguments(self, even: Any, split: Any, dispatch: Any) -> Tuple[Any, Any, Any, Any]:
        """(even_batches, split_batches, dispatch_batches, a foreign config for ``data_options``)."""
        config = self.dataloader_config
        if isinstance(config, DataLoaderConfiguration):
            return config.even_batches, config.split_batches, config.dispatch_batches, None
        return even, split, dispatch, config

    def seedable_arguments(self) -> Tuple[bool, Optional[int]]:
        """(use_seedable_sampler, data_seed) of the DataLoaderConfiguration, ours or Accelerate's."""
        config = self.dataloader_config
        return bool(getattr(config, "use_seedable_sampler", False)), getattr(config, "data_seed", None)

    def project_arguments(self, project_dir: Any, automatic: Any, total_limit: Any) -> Tuple[Any, Any, Any]:
        """(project_dir, automatic_checkpoint_naming, total_limit); sets ``logging_dir``."""
        config = self.project_config
        logging_dir = None
        if isinstance(config, ProjectConfiguration):
            project_dir = project_dir or config.project_dir
            automatic, total_limit, logging_dir = (
                config.automatic_checkpoint_naming,
                config.total_limit,
                config.logging_dir,
            )
        elif config is not None:  # Accelerate's ProjectConfiguration, duck-typed
            check_project_extras(getattr(config, "iteration", 0), getattr(config, "save_on_each_node", False))
            project_dir = project_dir or getattr(config, "project_dir", None)
            automatic = getattr(config, "automatic_checkpoint_naming", automatic)
            total_limit = getattr(config, "total_limit", total_limit)
            logging_dir = getattr(config, "logging_dir", None)
        for name, value in (("project_dir", project_dir), ("logging_dir", logging_dir)):
            if is_remote(value):  # trackers and automatic naming write local files: not a folder named 's3:'
                raise ConfigurationError(
                    f"Accelerator({name}={value!r}): {name} holds the trackers' files and the automatically named "
                    "checkpoints on local disk, and object storage is not supported there; give a local "
                    f"directory, and save_state({str(value).rstrip('/') + '/checkpoint_0'!r}) / load_state(URL) to "
                    "keep checkpoints in object storage"
                )
        self.logging_dir = logging_dir or project_dir
        self.log_with = parse_log_with(self.log_with, self.logging_dir)  # before any work: needs logging_dir
        return project_dir, automatic, total_limit

    def strategy_arguments(self, strategy: Any, kwargs: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
        """The strategy (a name or instance) and its constructor's arguments, with the kwargs handlers'."""
        from trainforge.strategies.base import Strategy

        ddp = self.handlers.get(DistributedDataParallelKwargs)
        group = self.handlers.get(InitProcessGroupKwargs)
        handlers = [type(h).__name__ for h in (ddp, group) if h is not None]
        if isinstance(strategy, Strategy):
            if handlers:
                raise ConfigurationError(
                    f"kwargs_handlers=[{', '.join(handlers)}(...)] with a Strategy instance: pass those settings to "
                    f"the strategy's constructor ({type(strategy).__name__}(find_unused_parameters=..., timeout=...))"
                )
            name = strategy.name
        else:
            name = str(strategy).lower()
            if name == "auto":  # what resolve_strategy would pick
                from trainforge.strategies.environment import detect_environment

                name = "ddp" if detect_environment().world_size > 1 else "single"
        if not self.device_placement and name not in ("single", "ddp"):
            raise ConfigurationError(
                f"device_placement=False with strategy {name!r}: that strategy places the model itself; "
                "device_placement=False works with one process or DDP"
            )
        extra: Dict[str, Any] = {}
        if ddp is not None and name not in ("single", "ddp"):
            raise ConfigurationError(
                f"DistributedDataParallelKwargs applies to DDP, and this Accelerator uses strategy {name!r}: "
                "pass its settings to that strategy's constructor"
            )
        if ddp is not None and name == "ddp":
            extra.update(ddp.strategy_kwargs())
        if group is not None and name not in ("single", *_PROCESS_GROUP_STRATEGIES):
            raise ConfigurationError(f"InitProcessGroupKwargs: strategy {name!r} starts no torch process group")
        if group is not None and name != "single":
            extra.update(group.strategy_kwargs())
        if not extra or isinstance(strategy, Strategy):
            return strategy, kwargs
        return name, {**kwargs, **extra}

    def apply_precision(self, precision: Precision) -> None:
        """GradScalerKwargs: the fp16 grad scaler's settings (no scaler otherwise, as Accelerate, which says
        nothing; a warning here, not an error, so that one script keeps running under fp16 and bf16)."""
        scaler = self.handlers.get(GradScalerKwargs)
        if scaler is not None and precision.scaler is None:
            warnings.warn(
                f"GradScalerKwargs({scaler.to_kwargs()}) is ignored: precision {precision.name!r} uses no grad "
                "scaler (only fp16, mixed_precision='fp16', scales the loss). Leave it out, or train in fp16",
                UserWarning,
                stacklevel=4,
            )
        if scaler is not None and precision.scaler is not None:
            precision.scaler = torch.amp.GradScaler(precision.device.type, **scaler.to_kwargs())


def _refuse_others(others: Dict[str, Any]) -> None:
    for name, value in others.items():
        if name == "step_scheduler_with_optimizer" and value is True:
            continue  # what a prepared scheduler does: it steps when the optimizer does
        if name == "step_scheduler_with_optimizer":
            raise ConfigurationError(
                f"step_scheduler_with_optimizer={value!r} is not supported: a prepared scheduler steps with the "
                "optimizer (skipped on accumulation steps). Step a scheduler of your own unprepared"
            )
        if name in _INSTEAD:
            raise ConfigurationError(f"Accelerator({name}=...) is Accelerate's; with trainforge pass {_INSTEAD[name]}")
        raise ConfigurationError(
            f"Accelerator() got an unknown argument {name}={value!r}; Accelerate's arguments that trainforge "
            "takes: mixed_precision, gradient_accumulation_steps, cpu, log_with, project_dir, project_config, "
            "dataloader_config, kwargs_handlers, rng_types, device_placement, step_scheduler_with_optimizer; "
            "trainforge's own: strategy, precision, accelerator, seed (see help(trainforge.Accelerator))"
        )


def _precision(precision: Optional[str], mixed_precision: Optional[str]) -> Optional[str]:
    if mixed_precision is None:
        return precision
    key = str(getattr(mixed_precision, "value", mixed_precision)).lower()  # Accelerate's PrecisionType or a str
    if key not in MIXED_PRECISION:
        raise invalid_choice(
            "mixed_precision",
            mixed_precision,
            MIXED_PRECISION,
            "(or precision= with trainforge's names: '32', '16-mixed', 'bf16-mixed', 'bf16-true', 'fp8')",
        )
    if precision is not None:
        raise ConfigurationError(
            f"precision={precision!r} and mixed_precision={mixed_precision!r} both given: pass one of them"
        )
    return key


def _handlers(kwargs_handlers: Optional[List[Any]]) -> Dict[type, Any]:
    if kwargs_handlers is None:
        return {}
    if not isinstance(kwargs_handlers, (list, tuple)):
        raise ConfigurationError(f"kwargs_handlers={kwargs_handlers!r} must be a list of handler objects")
    found: Dict[type, Any] = {}
    for handler in kwargs_handlers:
        if not isinstance(handler, HANDLERS):
            names = ", ".join(cls.__name__ for cls in HANDLERS)
            raise ConfigurationError(
                f"kwargs_handlers got {type(handler).__name__}: trainforge takes {names} from trainforge.utils "
                "(not accelerate.utils'; other handlers are done differently, see their classes in trainforge.utils)"
            )
        if type(handler) in found:
            raise ConfigurationError(f"kwargs_handlers got two {type(handler).__name__}: pass one")
        found[type(handler)] = handler
    return found


def _rng_types(rng_types: Optional[List[str]]) -> List[str]:
    if rng_types is None:
        return ["generator"]
    if isinstance(rng_types, str) or not isinstance(rng_types, (list, tuple)):
        raise ConfigurationError(f"rng_types={rng_types!r} must be a list, e.g. ['generator']")
    names = [str(getattr(r, "value", r)).lower() for r in rng_types]  # Accelerate's RNGType or a str
    for name, given in zip(names, rng_types):
        if name not in RNG_TYPES:
            raise invalid_choice("rng_types", given, RNG_TYPES)
        if name != "generator":
            raise ConfigurationError(
                f"rng_types=[{given!r}] is not supported: trainforge does not copy rank 0's global {name} RNG to "
                "the other processes at each epoch. The data order is rank 0's already (what 'generator' does, "
                "always on), and save_state/load_state restore every RNG of every rank. For the same global "
                "random stream on every rank call set_seed(seed) on each (the Trainer has the RNGSync callback)"
            )
    return names


def release_memory(*objects: Any) -> List[Any]:
    """Accelerate's ``release_memory``: ``None`` for each object (``a, b = release_memory(a, b)``), then
    garbage collection and the device caches emptied."""
    released: List[Any] = [None] * len(objects)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        torch.mps.empty_cache()
    return released
