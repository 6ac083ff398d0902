"""HF Accelerate's configuration objects under Accelerate's names and fields (``trainforge.utils``), as
trainforge honours them. Each field is either acted on or refused when the object is built, with the
trainforge way in the message; none is accepted and then ignored.

``kwargs_handlers=[...]`` of the Accelerator takes ``DistributedDataParallelKwargs``,
``GradScalerKwargs``, ``InitProcessGroupKwargs`` and ``ProfileKwargs`` (``trainer/loop/profiling.py``).
Accelerate's plugins and handlers that trainforge does differently (``DeepSpeedPlugin``, ``FullyShardedDataParallelPlugin``, ``AutocastKwargs``, ...)
exist under their names so that a ported import works; building one raises a ConfigurationError
that names what to use instead.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, NoReturn, Optional

from trainforge.strategies.ddp import check_comm_hook
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.loop.profiling import ProfileKwargs  # Accelerator.profile()


@dataclass
class DataLoaderConfiguration:
    """Accelerate's ``DataLoaderConfiguration``: ``split_batches``, ``dispatch_batches`` and
    ``even_batches`` act as in Accelerate. ``non_blocking``: host-to-device copies are non-blocking on
    CUDA whatever it says (the batch is used on the same stream, so this is safe), and
    ``use_stateful_dataloader``: every prepared loader is resumable (``save_state`` records its
    position), so both are accepted. ``use_seedable_sampler``: a shuffled loader's epoch ``e`` is the
    permutation of a generator seeded with ``data_seed + e`` (``data_seed`` None: ``torch.initial_seed()`` when
    the loader is prepared), as Accelerate's ``SeedableRandomSampler``; without it a prepared loader draws each
    epoch's order as Accelerate does (the DataLoader's generator, the global RNG on one process, a generator
    seeded from it when prepared on several)."""

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        check_loader_extras(self.use_seedable_sampler, self.data_seed, self.non_blocking, self.use_stateful_dataloader)


def check_loader_extras(use_seedable_sampler: Any, data_seed: Any, non_blocking: Any, stateful: Any) -> None:
    """The DataLoaderConfiguration fields beyond the three data options (also read from Accelerate's own
    object when one is passed)."""
    for name, value in (("non_blocking", non_blocking), ("use_stateful_dataloader", stateful)):
        if not isinstance(value, bool):
            raise ConfigurationError(f"DataLoaderConfiguration({name}={value!r}) must be True or False")
    if not isinstance(use_seedable_sampler, bool):
        raise ConfigurationError(
            f"DataLoaderConfiguration(use_seedable_sampler={use_seedable_sampler!r}) must be True or False"
        )
    if data_seed is not None and (isinstance(data_seed, bool) or not isinstance(data_seed, int)):
        raise ConfigurationError(
            f"DataLoaderConfiguration(data_seed={data_seed!r}) must be an int or None (None: torch.initial_seed())"
        )


@dataclass
class ProjectConfiguration:
    """Accelerate's ``ProjectConfiguration``: ``project_dir``, ``logging_dir`` (where the trackers of
    ``log_with`` write; default ``project_dir``), ``automatic_checkpoint_naming`` and ``total_limit``
    act as in Accelerate. ``iteration`` must be 0: the next ``checkpoint_<i>`` is one past the newest in
    the folder. ``save_on_each_node=True`` is refused: checkpoints are written once, by rank 0 (sharded
    strategies: by every rank into one directory), on storage every node reads."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        check_project_extras(self.iteration, self.save_on_each_node)
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        """Set ``project_dir``, and ``logging_dir`` to it when none was given (as Accelerate)."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


def check_project_extras(iteration: Any, save_on_each_node: Any) -> None:
    if iteration != 0:
        raise ConfigurationError(
            f"ProjectConfiguration(iteration={iteration!r}) is not supported: save_state() numbers "
            "checkpoint_<i> one past the newest under <project_dir>/checkpoints; leave iteration=0 "
            "(or call save_state(output_dir) with a path of your own)"
        )
    if save_on_each_node is not False:
        raise ConfigurationError(
            f"ProjectConfiguration(save_on_each_node={save_on_each_node!r}) is not supported: trainforge "
            "writes a checkpoint once, on storage every node reads; leave save_on_each_node=False"
        )


class KwargsHandler:
    """Base of the kwargs handlers (Accelerate's name): ``to_kwargs()`` gives the fields that differ
    from their defaults, what trainforge passes on."""

    def to_kwargs(self) -> Dict[str, Any]:
        defaults = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]  # subclasses are dataclasses
            if getattr(self, f.name) != getattr(defaults, f.name)
        }


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's names of torch's DDP communication hooks (``DistributedDataParallelKwargs(comm_hook=...,
    comm_wrapper=...)``); a string of the same value is taken too."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


COMM_HOOKS = tuple(h.value for h in DDPCommunicationHookType)


def _hook_name(value: Any, field_name: str, choices: tuple) -> Optional[str]:
    name = str(getattr(value, "value", value)).lower()  # Accelerate's enum or a str
    if name not in choices:
        raise ConfigurationError(
            f"DistributedDataParallelKwargs({field_name}={value!r}): choose one of {', '.join(choices)} "
            "(DDPCommunicationHookType). For your own hook pass strategy=DDPStrategy(comm_hook=<hook callable>, "
            "comm_hook_state=<its state>) to the Accelerator"
        )
    return None if name == "no" else name


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Passed to ``DistributedDataParallel`` when the run uses DDP (several processes; on one there is
    no DDP, as in Accelerate). ``comm_hook`` (``DDPCommunicationHookType``): torch's ``fp16``/``bf16``
    compression or ``power_sgd``/``batched_power_sgd`` hook, registered as Accelerate registers it;
    ``comm_wrapper`` (``fp16``/``bf16``) wraps it; ``comm_state_option``: the ``PowerSGDState`` options. What
    Accelerate would ignore (a wrapper without a hook, options for a hook without state) is refused."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = "no"
    comm_wrapper: Any = "no"
    comm_state_option: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        hook = _hook_name(self.comm_hook, "comm_hook", COMM_HOOKS)
        wrapper = _hook_name(self.comm_wrapper, "comm_wrapper", ("no", "fp16", "bf16"))
        if not isinstance(self.comm_state_option, dict):
            raise ConfigurationError(
                f"DistributedDataParallelKwargs(comm_state_option={self.comm_state_option!r}) must be a dict of "
                "PowerSGDState options"
            )
        try:
            check_comm_hook(hook, self.comm_state_option or None, wrapper)
        except ConfigurationError as err:
            raise ConfigurationError(
                f"DistributedDataParallelKwargs: {err}".replace("comm_hook_state", "comm_state_option")
            ) from None
        self.comm_hook, self.comm_wrapper = hook or "no", wrapper or "no"

    def strategy_kwargs(self) -> Dict[str, Any]:
        """``DDPStrategy``'s keyword arguments for these settings."""
        kwargs = self.to_kwargs()
        for name in ("comm_hook", "comm_wrapper"):
            if kwargs.pop(name, "no") != "no":
                kwargs[name] = getattr(self, name)
        if kwargs.pop("comm_state_option", None):
            kwargs["comm_hook_state"] = dict(self.comm_state_option)
        return kwargs


@dataclass
class GradScalerKwargs(KwargsHandler):
    """The ``torch.amp.GradScaler`` of ``mixed_precision="fp16"`` (with other precisions there is no
    scaler, as in Accelerate)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """The process group's ``backend`` and ``timeout`` (a ``datetime.timedelta``), for DDP, FSDP,
    DeepSpeed and Megatron runs. ``init_method`` is refused: trainforge starts the group from the
    launcher's environment (``trainforge launch`` / torchrun)."""

    backend: Optional[str] = "nccl"
    init_method: Optional[str] = None
    timeout: Optional[timedelta] = None

    def __post_init__(self) -> None:
        if self.init_method is not None:
            raise ConfigurationError(
                f"InitProcessGroupKwargs(init_method={self.init_method!r}) is not supported: trainforge starts "
                "the process group from the launcher's environment (MASTER_ADDR, MASTER_PORT, RANK...); start "
                "the processes with `trainforge launch` or torchrun"
            )
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise ConfigurationError(
                f"InitProcessGroupKwargs(timeout={self.timeout!r}) must be a datetime.timedelta, "
                "e.g. timedelta(seconds=1800)"
            )

    def strategy_kwargs(self) -> Dict[str, Any]:
        kwargs: Dict[str, Any] = {}
        if self.backend != "nccl":  # Accelerate passes only what differs from its defaults
            kwargs["process_group_backend"] = self.backend
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        return kwargs


HANDLERS = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)


def refusing(name: str, instead: str) -> type:
    """A class named like Accelerate's that refuses to be built, saying what trainforge uses instead."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise ConfigurationError(f"{name} is Accelerate's; trainforge does not take it. {instead}")

    return type(name, (), {"__init__": __init__, "__doc__": f"Refused (Accelerate's): {instead}"})


DeepSpeedPlugin = refusing(
    "DeepSpeedPlugin",
    "Pass strategy=DeepSpeedStrategy(stage=..., offload_optimizer=..., config=...) "
    "(trainforge.strategies.DeepSpeedStrategy) or strategy='deepspeed' to the Accelerator",
)
FullyShardedDataParallelPlugin = refusing(
    "FullyShardedDataParallelPlugin",
    "Pass strategy=FSDPStrategy(sharding_strategy=..., auto_wrap_policy=..., cpu_offload=...) "
    "(trainforge.strategies.FSDPStrategy) or strategy='fsdp' to the Accelerator",
)
MegatronLMPlugin = refusing(
    "MegatronLMPlugin",
    "Pass strategy=MegatronStrategy(tensor_parallel_size=..., pipeline_parallel_size=...) "
    "(trainforge.strategies.MegatronStrategy) to the Accelerator",
)
GradientAccumulationPlugin = refusing(
    "GradientAccumulationPlugin",
    "Pass Accelerator(gradient_accumulation_steps=<num_steps>): gradients sync on the window's last "
    "micro-batch and at the end of the dataloader, and a prepared scheduler steps once per optimizer step",
)
AutocastKwargs = refusing(
    "AutocastKwargs",
    "Mixed precision comes from Accelerator(mixed_precision=...); for other autocast settings wrap the "
    "code in torch.autocast(device_type, dtype=..., cache_enabled=...) yourself",
)
FP8RecipeKwargs = refusing(
    "FP8RecipeKwargs",
    "Accelerator(mixed_precision='fp8') trains with torchao's float8 recipe (tensorwise scaling); "
    "it takes no recipe arguments",
)
TorchDynamoPlugin = refusing(
    "TorchDynamoPlugin",
    "Call model = torch.compile(model, backend=..., mode=...) before accelerator.prepare(model)",
)
REFUSED = (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    MegatronLMPlugin,
    GradientAccumulationPlugin,
    AutocastKwargs,
    FP8RecipeKwargs,
    TorchDynamoPlugin,
)


class LoggerType(str, enum.Enum):
    """The tracker names ``log_with`` takes (Accelerate's, those trainforge has, and ``csv``)."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"
    COMETML = "comet_ml"
    WANDB = "wandb"
    CSV = "csv"

    def __str__(self) -> str:
        return self.value
