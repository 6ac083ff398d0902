"""XLA devices (TPU; XLA:CPU for tests) through torch_xla, one process per device (PJRT).

torch_xla is imported here only, and only when this strategy is chosen (``strategy="xla"`` or
``XLAStrategy()``): it is never picked by ``"auto"``, and importing trainforge or choosing any other
strategy never imports it. torch_xla releases pair with torch by minor version (torch_xla 2.9.0 needs
torch 2.9, its last release); ``import_torch_xla`` says so before a bare ImportError or a crash in a
mismatched C extension. Backends that register with torch as an accelerator (torch-tpu's PrivateUse1
"tpu" device, torch 2.11+) need no strategy: "single" and "ddp" take them from ``torch.accelerator``.

Where XLA differs, this strategy answers through the Strategy interface; the loop has no XLA branch:

- the device is ``torch_xla.device()``; ranks and world size come from ``torch_xla.runtime``;
- loaders are iterated through ``MpDeviceLoader`` (``device_batches``), which moves batches to the
  device in the background and cuts the lazy graph once per batch;
- gradients are all-reduced (``xm.all_reduce``, mean over replicas) only when an optimizer steps, so
  the micro-batches of an accumulation window never communicate, and the step ends with
  ``torch_xla.sync()`` so the graph is cut at optimizer steps and accumulation boundaries;
- collectives go through ``torch_xla.core.xla_model``;
- checkpoints: weights and optimizer state are copied to the CPU before writing, in trainforge's
  format (safetensors + torch.save), so any other strategy loads them.

Several XLA:CPU devices (``PJRT_DEVICE=CPU`` with ``CPU_NUM_DEVICES`` > 1) are refused: their
collectives hang upstream (pytorch/xla#5005, #9089).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from trainforge.strategies.base import REDUCE_OPS, Strategy, build_optimizers, mean_from_sum
from trainforge.strategies.data.utils import apply_to_tensors
from trainforge.strategies.errors import ConfigurationError, invalid_choice
from trainforge.strategies.materialize import materialize_whole

#: torch_xla release -> the torch it was built against (torch_xla follows torch's minor versions).
LAST_TORCH_XLA = "2.9.0"
XLA_PRECISIONS = ("32", "bf16-mixed", "bf16-true")
MULTI_CPU_ISSUES = "pytorch/xla#5005, pytorch/xla#9089"


def _minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _installed_version(dist_name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def check_torch_xla_versions(torch_version: str, xla_version: Optional[str]) -> None:
    """ConfigurationError unless torch_xla is installed and built for this torch's minor version."""
    pair = f"pip install torch=={LAST_TORCH_XLA} torch_xla=={LAST_TORCH_XLA}"
    if xla_version is None:
        raise ConfigurationError(
            f"strategy='xla' needs torch_xla, which is not installed (this process has torch {torch_version}). "
            f"torch_xla pairs with the torch of the same minor version; its last release is torch_xla "
            f"{LAST_TORCH_XLA} for torch {LAST_TORCH_XLA}: `{pair}` (scripts/xla-env.sh builds such an "
            "environment). On newer torch, TPUs come through the torch-tpu plugin: keep strategy='single' or "
            "'ddp' (the 'tpu' accelerator is picked from torch.accelerator)"
        )
    if _minor(torch_version) != _minor(xla_version):
        want = ".".join(map(str, _minor(xla_version)))
        raise ConfigurationError(
            f"torch_xla {xla_version} is built for torch {want}.x but this process has torch {torch_version}; "
            f"install the matching pair, e.g. `pip install torch=={want}.* torch_xla=={xla_version}` "
            f"(last release: `{pair}`), or uninstall torch_xla and use another strategy"
        )


def check_xla_cpu_devices(device_type: str, world_size: int) -> None:
    """Several XLA:CPU devices: refused (their collectives hang upstream)."""
    if str(device_type).upper() == "CPU" and world_size > 1:
        raise ConfigurationError(
            f"strategy='xla' on {world_size} XLA:CPU devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES="
            f"{os.environ.get('CPU_NUM_DEVICES', '<unset>')}): collectives between XLA:CPU devices hang in torch_xla "
            f"(upstream limitation, {MULTI_CPU_ISSUES}). Use one XLA:CPU device (CPU_NUM_DEVICES=1), strategy='ddp' "
            "with accelerator='cpu' for several CPU processes, or run on TPUs (PJRT_DEVICE=TPU)"
        )


def import_torch_xla() -> Any:
    """``torch_xla`` after checking that it is installed and matches this torch."""
    check_torch_xla_versions(torch.__version__, _installed_version("torch_xla") or _installed_version("torch-xla"))
    try:
        return importlib.import_module("torch_xla")
    except (ImportError, OSError) as error:  # a broken install: undefined symbols, missing libtpu...
        raise ConfigurationError(
            f"torch_xla {_installed_version('torch_xla')} is installed but does not import with "
            f"torch {torch.__version__}: {error}. Reinstall the pair, e.g. `pip install "
            f"torch=={LAST_TORCH_XLA} torch_xla=={LAST_TORCH_XLA}`"
        ) from error


def _reduce_type(xm: Any, op: str) -> str:
    return {"sum": xm.REDUCE_SUM, "mean": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}[op]


class XLAStrategy(Strategy):
    """Data parallelism on XLA devices (TPU; XLA:CPU for tests), one process per device
    (``trainforge launch --xla`` starts them with torch_xla's launcher). torch_xla is imported only when
    this strategy sets up; ``"auto"`` never picks it.

    Args:
        sync_module_states: broadcast rank 0's weights at setup, so the replicas start equal even if the
            model was built with different seeds on each process (default True).
        activation_checkpointing: only None, False or ``"none"`` (the default, off): XLA's compiler merges
            torch's recomputation back into the forward, so every other mode is refused at construction;
            wrap blocks with ``torch_xla.utils.checkpoint.checkpoint`` inside the model instead.
    """

    name = "xla"
    activation_checkpointing_modes = ()
    activation_checkpointing_limits = (
        "XLA's compiler merges torch.utils.checkpoint's recomputation back into the forward (it saves "
        "nothing) and copying saved tensors to the host would cut the lazy graph at every one; wrap your "
        "blocks with torch_xla.utils.checkpoint.checkpoint inside the model instead"
    )

    def __init__(self, *, sync_module_states: bool = True, activation_checkpointing: Any = None) -> None:
        super().__init__(None, activation_checkpointing)
        if not isinstance(sync_module_states, bool):
            raise ConfigurationError(f"XLAStrategy(sync_module_states={sync_module_states!r}) must be True or False")
        self.sync_module_states = sync_module_states
        self._xla: Any = None
        self._xm: Any = None
        self._xr: Any = None
        self._reduced: set = set()  # ids of parameters whose gradients clip_gradients already all-reduced

    # ---- topology ---------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return int(self._xr.global_ordinal()) if self._xr is not None else 0

    @property
    def local_rank(self) -> int:
        return int(self._xr.local_ordinal()) if self._xr is not None else 0

    @property
    def world_size(self) -> int:
        return int(self._xr.world_size()) if self._xr is not None else 1

    # ---- lifecycle --------------------------------------------------------------------------
    def setup_environment(self, accelerator: str = "auto") -> None:
        self.accelerator = accelerator
        if self.accelerator not in ("auto", None):
            raise ConfigurationError(
                f"strategy='xla' places everything on the XLA device that PJRT_DEVICE selects; "
                f"accelerator={self.accelerator!r} conflicts with it. Leave accelerator='auto' "
                "(or choose strategy='single'/'ddp' for that accelerator)"
            )
        torch_xla = import_torch_xla()
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        check_xla_cpu_devices(xr.device_type(), int(xr.world_size()))
        self._xla, self._xm, self._xr = torch_xla, xm, xr
        self._device = torch_xla.device()

    def setup(self, module: nn.Module, optimizers: Any) -> Tuple[nn.Module, List[torch.optim.Optimizer]]:
        """Optimizers built before placement (Accelerate's order) hold the CPU parameters, which moving
        to XLA replaces (CPU and XLA tensors cannot swap storage): they are pointed at the XLA ones."""
        materialize_whole(module, torch.device("cpu"), "xla")  # then moved to the XLA device
        before = list(module.named_parameters())
        module = self.setup_module(module)
        if callable(optimizers):
            return module, build_optimizers(optimizers)
        moved = any(p is not q for (_, p), q in zip(before, module.parameters()))
        if optimizers and moved:
            from trainforge.strategies.fsdp_wrap import remap_optimizers

            remap_optimizers(before, module, optimizers)
        return module, list(optimizers)

    def setup_module(self, module: nn.Module) -> nn.Module:
        name = self.precision.name
        if name not in XLA_PRECISIONS:
            raise ConfigurationError(
                f"precision={name!r} is not supported with strategy='xla'; choose one of: "
                f"{', '.join(XLA_PRECISIONS)} (bf16 is native on TPUs: 'bf16-mixed' or 'bf16-true')"
            )
        module = super().setup_module(module)
        if self.sync_module_states and self.world_size > 1:
            for tensor in list(module.parameters()) + list(module.buffers()):
                tensor.data.copy_(self.broadcast(tensor.data, 0))
        return module

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # nothing is wrapped: gradients are reduced in optimizer_step

    def device_batches(self, batches: Iterable[Any]) -> Iterable[Any]:
        """Batches moved to the device by torch_xla's ``MpDeviceLoader`` (background transfer, one graph
        cut per batch)."""
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        return MpDeviceLoader(batches, self.root_device)

    # ---- the step ---------------------------------------------------------------------------
    def _all_reduce_gradients(self, grads: List[torch.Tensor]) -> None:
        if self.world_size > 1 and grads:
            self._xm.all_reduce(self._xm.REDUCE_SUM, grads, scale=1.0 / self.world_size)

    def clip_gradients(
        self,
        parameters: Any,
        *,
        max_norm: Optional[float] = None,
        clip_value: Optional[float] = None,
        norm_type: float = 2.0,
    ) -> Optional[torch.Tensor]:
        params = [p for p in parameters if p.grad is not None]
        if self.world_size > 1:  # clip the averaged gradients; optimizer_step then does not reduce them again
            self._all_reduce_gradients([p.grad for p in params if id(p) not in self._reduced])
            self._reduced.update(id(p) for p in params)
        return super().clip_gradients(params, max_norm=max_norm, clip_value=clip_value, norm_type=norm_type)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> Any:
        """All-reduce the gradients (what ``xm.optimizer_step`` does), step, and cut the graph."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self._all_reduce_gradients([p.grad for p in params if id(p) not in self._reduced])
        self._reduced.difference_update(id(p) for p in params)
        out = super().optimizer_step(optimizer)
        self._sync()
        return out

    def _sync(self) -> None:
        if self._xla is not None:
            self._xla.sync()

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in REDUCE_OPS:
            raise invalid_choice("op", op, REDUCE_OPS)
        if self.world_size == 1:
            return tensor
        out = self._xm.all_reduce(_reduce_type(self._xm, op), tensor.to(self.root_device))
        return mean_from_sum(out, self.world_size) if op == "mean" else out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        return self._xm.all_gather(tensor.to(self.root_device).unsqueeze(0), dim=0)

    def all_gather_object(self, obj: Any) -> List[Any]:
        if self.world_size == 1:
            return [obj]
        return [self.broadcast(obj, src) for src in range(self.world_size)]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Tensors: zeros on the other ranks, summed. Objects: serialised with torch.save, loaded with
        ``weights_only=True`` (tensors, containers, numbers and strings; nothing executed)."""
        if self.world_size == 1:
            return obj
        if isinstance(obj, torch.Tensor):
            data = obj.to(self.root_device)
            data = data if self.global_rank == src else torch.zeros_like(data)
            return self._xm.all_reduce(self._xm.REDUCE_SUM, data).to(obj.device)
        payload = b""
        if self.global_rank == src:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            payload = buffer.getvalue()
        size = int(self.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src).item())
        data = torch.zeros(size, dtype=torch.uint8)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        received = self.broadcast(data.to(torch.int32), src).to(torch.uint8).cpu()
        return torch.load(io.BytesIO(received.numpy().tobytes()), weights_only=True)

    def barrier(self, name: Optional[str] = None) -> None:
        if self.world_size > 1:
            self._xm.rendezvous(name or "trainforge-barrier")

    # ---- checkpoints (on the CPU, in the common format) -------------------------------------
    def module_state_dict(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        self._sync()  # pending lazy updates are executed before the values are read
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        self._sync()
        return apply_to_tensors(optimizer.state_dict(), lambda t: t.detach().cpu())

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self._sync()

    def __repr__(self) -> str:
        return f"XLAStrategy(device={self._device}, world_size={self.world_size})"
