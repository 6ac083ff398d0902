"""``ParallelDims``: the (pp, dp, tp) sizes, checked once, and the one named ``DeviceMesh`` over them.

Mesh dimensions are ordered outermost to innermost: ``pp`` (least traffic), ``dp``, ``tp`` (most
traffic, so its ranks are adjacent: on a GPU cluster they land in one node, as Megatron does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, overload

from trainforge.strategies.errors import ConfigurationError

Size = Union[int, str]
DIM_NAMES = ("pp", "dp", "tp")


@overload
def check_positive(name: str, value: Any, auto_ok: Literal[False]) -> int: ...
@overload
def check_positive(name: str, value: Any, auto_ok: bool) -> Optional[int]: ...
def check_positive(name: str, value: Any, auto_ok: bool) -> Optional[int]:
    if auto_ok and value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or 'auto'" if auto_ok else ""
        raise ConfigurationError(f"{name}={value!r} must be a positive int{extra}")
    return value


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp: int
    tp: int
    world_size: int

    @classmethod
    def resolve(cls, *, tp: Size, pp: Size, dp: Size, world_size: int) -> ParallelDims:
        """``dp='auto'`` takes what tp x pp leave; every size named in the error when they do not fit."""
        if tp == "auto" or pp == "auto":
            raise ConfigurationError(
                "ParallelDims.resolve takes tensor_parallel_size/pipeline_parallel_size as ints; "
                "'auto' is chosen from the model by MegatronStrategy (strategies/parallel/auto.py) "
                "or choose_auto_layout"
            )
        tp_, pp_ = (
            check_positive("tensor_parallel_size", tp, False),
            check_positive("pipeline_parallel_size", pp, False),
        )
        dp_ = check_positive("data_parallel_size", dp, True)
        if dp_ is None:
            if world_size % (tp_ * pp_):
                raise ConfigurationError(
                    f"tensor_parallel_size={tp_} x pipeline_parallel_size={pp_} = {tp_ * pp_} does not divide "
                    f"world_size={world_size}; launch a multiple of {tp_ * pp_} processes or change the sizes"
                )
            dp_ = world_size // (tp_ * pp_)
        if pp_ * dp_ * tp_ != world_size:
            raise ConfigurationError(
                f"pipeline_parallel_size={pp_} x data_parallel_size={dp_} x tensor_parallel_size={tp_} = "
                f"{pp_ * dp_ * tp_}, but world_size={world_size}; the three must multiply to the number of "
                "processes (data_parallel_size='auto' takes what the others leave)"
            )
        return cls(pp_, dp_, tp_, world_size)

    def build_mesh(self, device_type: str) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=DIM_NAMES)

    def __str__(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp}"
