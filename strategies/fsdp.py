"""Fully sharded data parallel on torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Parameters become ``DTensor`` shards on a ``DeviceMesh``; each unit (a repeated block, then the
root) all-gathers its parameters for forward/backward and reduce-scatters gradients, so
parameters, gradients and optimizer state are divided by the shard size (ZeRO stage 3).

``setup`` applies, in torchtitan's order: precision conversion -> activation checkpointing ->
``fully_shard`` on each unit (bottom-up) -> ``fully_shard`` on the root. Optimizers must see the
new DTensor parameters: the Trainer creates them after ``setup`` (for every strategy);
optimizers handed to ``setup`` (``Accelerator.prepare(model, optimizer)``) are remapped by name.

Checkpoints: ``state_dict_type="sharded"`` writes ``dcp/`` (torch.distributed.checkpoint, every
rank its shard; loadable on another number of processes, and by ``trainforge merge-weights``);
``"full"`` writes consolidated ``model.safetensors`` + ``optimizers.pt`` from rank 0.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set, Tuple, Union, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainforge.strategies.base import Optimizers, Strategy, build_optimizers
from trainforge.strategies.checkpoint.dcp import has_sharded, load_sharded, save_sharded
from trainforge.strategies.ddp import ProcessGroupMixin, check_timeout
from trainforge.strategies.errors import CheckpointError, ConfigurationError, invalid_choice
from trainforge.strategies.fsdp_wrap import no_gradient_sync, remap_optimizers, select_modules
from trainforge.strategies.materialize import has_meta, materialize

log = logging.getLogger("trainforge")

SHARDING_STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
STATE_DICT_TYPES = ("sharded", "full")
Policy = Union[None, bool, Set[Any], Callable[[nn.Module, str], bool]]


class FSDPStrategy(ProcessGroupMixin, Strategy):
    """Fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters,
    gradients and optimizer state are sharded over the ranks and gathered per wrapped unit when needed.

    The Accelerator's autocast stays on: it is redundant for matmuls (the parameters already
    arrive in bf16/fp16) but keeps softmax, norms and losses in fp32, as under the other strategies.
    16-mixed keeps the Precision's ``torch.amp.GradScaler``: its inf check on DTensor gradients is
    reduced over the mesh by DTensor itself, so every rank skips the same steps.

    Args:
        device: this process's device (a ``torch.device`` or a string such as ``"cuda:1"``). Default None: the
            device of the process's local rank for the accelerator asked for (the CPU, or ``cuda:<local_rank>``).
        sharding_strategy: how parameters are sharded, case-insensitive (so ``trainforge config``'s
            ``FULL_SHARD`` works). ``"full_shard"`` (default): shard over all ranks, free gathered parameters
            after forward (ZeRO-3). ``"shard_grad_op"``: the same shards, gathered parameters kept from
            forward to backward (ZeRO-2-like memory during the step, one all-gather less).
            ``"hybrid_shard"``: a 2-D mesh ``(replicate, shard)``: shard within a node (``LOCAL_WORLD_SIZE``
            ranks), replicate across nodes (HSDP). ``"no_shard"``: the same 2-D mesh with shard size 1, i.e.
            every rank holds everything and gradients are all-reduced (DDP semantics), done with
            ``fully_shard`` so that one code path serves state dicts, DCP checkpoints, clipping and no-sync.
        auto_wrap_policy: which submodules become their own sharded units. Default None: the model's
            repeated blocks (e.g. transformer layers); or a set of module classes / class names, or a
            callable ``(module, name) -> bool``.
        cpu_offload: keep the sharded parameters, gradients and optimizer step in host memory (torch's
            ``CPUOffloadPolicy``, pinned on CUDA); default False.
        activation_checkpointing: trade compute for activation memory, the same values for every strategy
            (``strategies/activation_memory.py``): None, False or ``"none"`` (default: off), ``"full"`` or True
            (every repeated block recomputed in backward), ``"selective:<n>"`` (every n-th block), ``"op"``
            (matmul and attention outputs kept, the rest recomputed), ``"offload"`` (saved activations moved to
            host memory), a dict ``{"mode": ..., "every": n, "blocks": ...}``, or a set of module classes /
            class names or a callable ``(module, name) -> bool`` ("full" on those modules). Applied on the wrapped units by default, or "full" on a policy of the same kinds.
            Default False: off.
        mixed_precision: a ``torch.distributed.fsdp.MixedPrecisionPolicy``. Default None: derived from the
            precision (bf16-mixed/fp8: bf16 parameters, 16-mixed: fp16 parameters; gradients reduced in fp32).
        state_dict_type: how checkpoints are written: ``"sharded"`` (default: each rank writes its shard to
            ``dcp/``, fast, and loadable on another number of ranks) or ``"full"`` (one consolidated
            safetensors file from rank 0).
        reshard_after_forward: free the gathered parameters after forward (True), keep them until backward
            (False), or reshard to a smaller group of this size (an int dividing the shard size). Default
            None: from ``sharding_strategy`` (True for full_shard and hybrid_shard).
        fp8_all_gather: under ``precision="fp8"``, torchao's Float8Linear weights are all-gathered in float8.
            Default None: on; False: gathered in the parameter dtype, cast to fp8 after the gather; True
            under another precision is refused.
        process_group_backend: the ``torch.distributed`` backend of the process group this strategy starts
            (default None: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU, else the backend registered for the device
            type). Not used when a process group already exists.
        timeout: how long a collective may wait for the other ranks before it fails, a ``datetime.timedelta``
            (default 30 minutes), passed to ``init_process_group``.
    """

    name = "fsdp"
    redirect_forward = True  # FSDP's unshard hooks run in the root's forward
    grad_reduction = "mean"  # reduce-scatter (HSDP: and all-reduce) divided by the data-parallel size
    empty_init_default = True  # init_module(): built on meta, materialised shard by shard after sharding
    trainable_only_checkpoints = True  # the frozen parameters are left out of dcp/ or the full state dict

    def __init__(
        self,
        device: Optional[Union[torch.device, str]] = None,
        *,
        sharding_strategy: str = "full_shard",
        auto_wrap_policy: Policy = None,
        cpu_offload: bool = False,
        activation_checkpointing: Any = False,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        state_dict_type: str = "sharded",
        reshard_after_forward: Optional[Union[bool, int]] = None,
        fp8_all_gather: Optional[bool] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        super().__init__(device, activation_checkpointing)
        key = str(sharding_strategy).lower()
        if key not in SHARDING_STRATEGIES:
            raise invalid_choice(
                "sharding_strategy",
                sharding_strategy,
                SHARDING_STRATEGIES,
                "(case does not matter: FULL_SHARD is full_shard)",
            )
        if state_dict_type not in STATE_DICT_TYPES:
            raise invalid_choice(
                "state_dict_type",
                state_dict_type,
                STATE_DICT_TYPES,
                "'sharded' saves each rank's shard (fast, reshardable); 'full' one safetensors file",
            )
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise ConfigurationError(
                f"mixed_precision={mixed_precision!r} must be a torch.distributed.fsdp."
                "MixedPrecisionPolicy or None (derived from the Trainer's precision)"
            )
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
            raise ConfigurationError(
                f"reshard_after_forward={reshard_after_forward!r} must be None (from "
                "sharding_strategy), True, False or an int (a divisor of the shard size)"
            )
        if fp8_all_gather is not None and not isinstance(fp8_all_gather, bool):
            raise ConfigurationError(
                f"fp8_all_gather={fp8_all_gather!r} must be None (on under precision='fp8'), True or False"
            )
        self.fp8_all_gather = fp8_all_gather
        self.sharding_strategy, self.state_dict_type = key, state_dict_type
        self.auto_wrap_policy = auto_wrap_policy
        self.cpu_offload, self.mixed_precision = bool(cpu_offload), mixed_precision
        self.reshard_after_forward = reshard_after_forward
        self.backend, self.timeout = process_group_backend, check_timeout(timeout, "FSDPStrategy")
        self.mesh: Optional[DeviceMesh] = None
        self.wrapped_modules: List[str] = []  # names of the units sharded before the root

    # ---- lifecycle ----------------------------------------------------------------------------
    def setup_environment(self, accelerator: str = "auto") -> None:
        self.accelerator = accelerator
        self._device = self._start_process_group(self.backend, self.timeout)
        self.mesh = self._build_mesh()

    def _build_mesh(self) -> DeviceMesh:
        world, device_type = self.world_size, self.root_device.type
        if self.sharding_strategy == "no_shard":
            return init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "shard"))
        if self.sharding_strategy == "hybrid_shard":
            node = self.cluster.local_world_size
            if node < 1 or world % node:
                raise ConfigurationError(
                    f"sharding_strategy='hybrid_shard' shards within a node of LOCAL_WORLD_SIZE="
                    f"{node} ranks, which does not divide world_size={world}; launch the same "
                    "number of processes on every node, or use 'full_shard'"
                )
            return init_device_mesh(device_type, (world // node, node), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))

    def setup(self, module: nn.Module, optimizers: Optimizers) -> Tuple[nn.Module, List[torch.optim.Optimizer]]:
        if isinstance(module, FSDPModule):  # sharded before: its optimizers already hold the DTensors
            return module, build_optimizers(optimizers)
        before = list(module.named_parameters())
        module = self.setup_module(module)
        if callable(optimizers):  # built now, on the DTensor parameters
            return module, build_optimizers(optimizers)
        if optimizers:  # built by the user on the unsharded parameters
            remap_optimizers(before, module, optimizers)
        return module, list(optimizers)

    def setup_module(self, module: nn.Module) -> nn.Module:
        if isinstance(module, FSDPModule):
            return module  # prepared before (e.g. Trainer.validate after fit)
        if self.mesh is None:
            raise ConfigurationError(
                "FSDPStrategy.setup called before setup_environment(); use it through the "
                "Trainer or Accelerator, or call strategy.setup_environment() first"
            )
        module = self.precision.convert_module(module, fp8_all_gather=self._gathers_fp8())
        units = select_modules(module, self.auto_wrap_policy)
        wrappers = self.wrap_activation_blocks(module, {type(m) for _, m in units} or None)
        self.checkpointed_modules.reverse()  # descendants first, the order units are sharded in
        kwargs = self._fully_shard_kwargs()
        for _, unit in units:
            fully_shard(wrappers.get(id(unit), unit), **kwargs)
        fully_shard(module, **kwargs)
        if has_meta(module):  # built with empty_init: each rank allocates and fills only its shards
            materialize(module, torch.device("cpu") if self.cpu_offload else self.root_device)
        self.wrapped_modules = [name for name, _ in units]
        if self.is_global_zero:
            log.info(
                "trainforge: fsdp %s over mesh %s, %d unit(s) + root, activation checkpointing on %d",
                self.sharding_strategy,
                tuple(self.mesh.shape),
                len(units),
                len(self.checkpointed_modules),
            )
        return module

    def _gathers_fp8(self) -> bool:
        """Whether the Float8Linear weights are all-gathered in fp8 (half the bytes of bf16). Their
        scale is computed in the pre-all-gather from the amax over the mesh each time (one small
        all-reduce per weight), so it is right whatever changed the weights (optimizer, a load, EMA's
        swap); torchao's precomputed scales would go stale on anything but an optimizer step."""
        fp8 = self.precision.name == "fp8"
        if self.fp8_all_gather and not fp8:
            raise ConfigurationError(
                f"FSDPStrategy(fp8_all_gather=True) with precision={self.precision.name!r}: the weights are "
                "float8 only under precision='fp8'; set precision='fp8' or drop fp8_all_gather"
            )
        return fp8 and self.fp8_all_gather is not False

    def _fully_shard_kwargs(self) -> Dict[str, Any]:
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = self.sharding_strategy in ("full_shard", "hybrid_shard")
        offload: OffloadPolicy = OffloadPolicy()
        if self.cpu_offload:
            offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        return {
            "mesh": self.mesh,
            "reshard_after_forward": reshard,
            "mp_policy": self.mixed_precision_policy(),
            "offload_policy": offload,
        }

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        if self.mixed_precision is not None:
            return self.mixed_precision
        dtype = self.precision.autocast_dtype
        if dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # fully_shard works in place: the module is the user's module

    def teardown(self) -> None:
        self.mesh = None
        self._stop_process_group()

    # ---- the step -----------------------------------------------------------------------------
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Accumulate unsharded gradients locally, reduce-scatter only on the window's last backward.
        ``set_requires_gradient_sync`` also turns off HSDP's all-reduce (``set_requires_all_reduce``)
        and ``set_is_last_backward`` stays True: no reduction is pending, so none is waited for."""
        if not (enabled and isinstance(module, FSDPModule)):
            return contextlib.nullcontext()
        return no_gradient_sync(module)

    def clip_gradients(
        self,
        parameters: Any,
        *,
        max_norm: Optional[float] = None,
        clip_value: Optional[float] = None,
        norm_type: float = 2.0,
    ) -> Optional[torch.Tensor]:
        """The total norm over the *sharded* gradients equals the unsharded one: each rank's partial
        norm is a ``Partial`` DTensor that ``full_tensor`` reduces over the mesh."""
        params = [p for p in parameters if p.grad is not None]
        if clip_value is not None or max_norm is None:
            return super().clip_gradients(params, max_norm=max_norm, clip_value=clip_value, norm_type=norm_type)
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if isinstance(total, DTensor):
            local = total.to_local()
            mesh = total.device_mesh
            if local.device.type != mesh.device_type:  # CPU-offloaded grads, collectives on the GPU
                total = DTensor.from_local(local.to(mesh.device_type), mesh, total.placements)
            total = total.full_tensor().to(local.device)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    # ---- state dicts --------------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """The full state dict on CPU on rank 0; {} on the other ranks (every rank must call it:
        it all-gathers one tensor at a time, so no rank ever holds more than one full copy)."""
        return cast(
            Dict[str, torch.Tensor],
            get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        )

    def load_module_state_dict(self, module: nn.Module, state: Dict[str, torch.Tensor], strict: bool = True) -> None:
        """``state`` is a full state dict present on every rank; each keeps its shard."""
        # torch types the argument dict[str, ValueType] (invariant): a dict of tensors is one
        set_model_state_dict(
            module, cast(Dict[str, Any], state), options=StateDictOptions(full_state_dict=True, strict=strict)
        )

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return get_optimizer_state_dict(
            module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]
    ) -> None:
        if any(isinstance(k, int) for k in state.get("state", {})):
            raise CheckpointError(
                "the optimizer state is keyed by parameter index (written by DDP or a single "
                "device), FSDP needs it keyed by parameter name; load the weights only, or "
                "resume with the strategy that wrote it"
            )
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, writer: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """``sharded``: ``dcp/`` (strategies/checkpoint/dcp.py), every rank writing its own file, in
        the background for an asynchronous save. ``full``: consolidated files from rank 0 (the base class)."""
        if self.state_dict_type == "full":
            super().save_checkpoint(writer, module, optimizers)
        else:
            save_sharded(writer, module, optimizers, flat=False)

    def load_checkpoint(self, path: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Whichever format the checkpoint holds; a sharded one may come from another world size."""
        if has_sharded(path):
            load_sharded(path, module, optimizers)
        else:
            super().load_checkpoint(path, module, optimizers)

    def trainable_state_dict(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """The full state dict less the frozen parameters, which are never gathered."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return cast(Dict[str, torch.Tensor], get_model_state_dict(module, options=options))

    def save_trainable(self, writer: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if self.state_dict_type == "full":
            super().save_trainable(writer, module, optimizers)
        else:
            save_sharded(writer, module, optimizers, flat=False, trainable_only=True)

    def load_trainable(self, path: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if has_sharded(path):
            load_sharded(path, module, optimizers, trainable_only=True)
        else:
            super().load_trainable(path, module, optimizers)

    def __repr__(self) -> str:
        return (
            f"FSDPStrategy(sharding_strategy={self.sharding_strategy!r}, device={self.root_device}, "
            f"world_size={self.world_size})"
        )


def local_state_bytes(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> Dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, summed over the actual
    local tensors (a DTensor counts its local shard only)."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(module.parameters())
    out = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            nbytes(v)
            for opt in optimizers
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ),
    }
    out["total"] = sum(out.values())
    return out
