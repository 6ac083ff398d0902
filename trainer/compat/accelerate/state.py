"""Accelerate's ``DistributedType``, ``PartialState`` and ``accelerator.state``, over trainforge's strategies.

``PartialState()`` is the process topology without an Accelerator (Accelerate's use: logging, splitting
inputs between processes, ``wait_for_everyone`` in scripts that prepare nothing). It starts the
process group the launcher's environment describes, as ``Accelerator()`` would, and joins one that is
already started. ``accelerator.state`` is the same view of the Accelerator's own strategy, plus its
``mixed_precision``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional

import torch

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.process_control import ProcessControl

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy
    from trainforge.strategies.precision import Precision


class DistributedType(str, enum.Enum):
    """Accelerate's names for how a run is distributed (``accelerator.distributed_type``)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    MEGATRON_LM = "MEGATRON_LM"
    XLA = "XLA"

    def __str__(self) -> str:
        return self.value


_BY_STRATEGY = {
    "fsdp": DistributedType.FSDP,
    "deepspeed": DistributedType.DEEPSPEED,
    "megatron": DistributedType.MEGATRON_LM,
    "xla": DistributedType.XLA,
}

# trainforge's precision names -> Accelerate's ``mixed_precision`` values
_MIXED_PRECISION = {"32": "no", "16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16", "fp8": "fp8"}


def distributed_type_of(strategy: Strategy) -> DistributedType:
    """FSDP, DeepSpeed, Megatron and XLA by strategy (also on one process, as Accelerate); otherwise
    NO on one process and MULTI_CPU/MULTI_GPU (any accelerator) on several."""
    if strategy.name in _BY_STRATEGY:
        return _BY_STRATEGY[strategy.name]
    if strategy.world_size == 1:
        return DistributedType.NO
    return DistributedType.MULTI_CPU if strategy.root_device.type == "cpu" else DistributedType.MULTI_GPU


def mixed_precision_name(precision: Precision) -> str:
    """Accelerate's name of a trainforge precision ("bf16-true" is reported as "bf16")."""
    return _MIXED_PRECISION[precision.name]


class PartialState(ProcessControl):
    """Accelerate's ``PartialState``: the processes of this run. ``cpu=True`` runs on the CPU. Has
    ``device``, ``process_index``, ``local_process_index``, ``num_processes``, ``is_main_process``,
    ``is_local_main_process``, ``is_last_process``, ``distributed_type``, ``use_distributed``,
    ``wait_for_everyone()``, ``print()``, ``split_between_processes()``, ``main_process_first()``,
    ``on_main_process`` and the other process decorators (those of ``ProcessControl``, which it is,
    on a strategy of its own)."""

    mixed_precision: Optional[str] = None  # AcceleratorState's (an Accelerator's state has it)

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        if kwargs:
            raise ConfigurationError(
                f"PartialState({', '.join(f'{k}=...' for k in sorted(kwargs))}) is not supported: the process "
                "group's settings come with the Accelerator: Accelerator(kwargs_handlers="
                "[InitProcessGroupKwargs(backend=..., timeout=...)])"
            )
        if not isinstance(cpu, bool):
            raise ConfigurationError(f"PartialState(cpu={cpu!r}) must be True or False")
        from trainforge.strategies import resolve_strategy

        strategy = resolve_strategy("auto")
        strategy.setup_environment("cpu" if cpu else "auto")
        super().__init__(strategy)

    @classmethod
    def of(cls, strategy: Strategy, precision: Optional[Precision] = None) -> PartialState:
        """The state of an existing strategy (``Accelerator.state``), with its precision when given."""
        state = cls.__new__(cls)
        ProcessControl.__init__(state, strategy)
        state.mixed_precision = mixed_precision_name(precision) if precision is not None else None
        return state

    use_distributed = property(lambda self: self.strategy.world_size > 1)

    @property
    def distributed_type(self) -> DistributedType:
        return distributed_type_of(self.strategy)

    @property
    def backend(self) -> Optional[str]:
        """The process group's backend (``"gloo"``, ``"nccl"``...), None without one."""
        dist = torch.distributed
        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None

    def __repr__(self) -> str:
        backend = self.backend
        text = (
            f"Distributed environment: {self.distributed_type}{f'  Backend: {backend}' if backend else ''}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
        )
        if self.mixed_precision is not None:
            text += f"\nMixed precision type: {self.mixed_precision}\n"
        return text
