"""DistributedDataParallel over the process group that the environment describes."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainforge.strategies import clean_exit
from trainforge.strategies.base import REDUCE_OPS, Strategy, mean_from_sum
from trainforge.strategies.errors import ConfigurationError, invalid_choice

log = logging.getLogger("trainforge")
# What DistributedDataParallel accepts besides what DDPStrategy sets itself (module, device_ids).
_DDP_ARGS = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module", "device_ids"}

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
COMM_HOOKS = ("fp16", "bf16", "power_sgd", "batched_power_sgd")  # torch's built-in DDP communication hooks
COMM_WRAPPERS = ("fp16", "bf16")  # compress what a hook sends (torch's default_hooks.*_compress_wrapper)


def check_timeout(timeout: Any, owner: str) -> timedelta:
    """The process-group timeout, checked at construction (torch would fail only at setup)."""
    if not isinstance(timeout, timedelta):
        raise ConfigurationError(
            f"{owner}(timeout={timeout!r}) must be a datetime.timedelta, e.g. "
            f"timeout=timedelta(seconds={timeout!r}) or timedelta(minutes=30)"
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
            else f"{owner}(timeout={timeout!r}) must be a datetime.timedelta, e.g. timedelta(minutes=30)"
        )
    if timeout.total_seconds() <= 0:
        raise ConfigurationError(f"{owner}(timeout={timeout!r}) must be positive")
    return timeout


_POWER_SGD = ("power_sgd", "batched_power_sgd")


def check_comm_hook(hook: Any, state: Any, wrapper: Any) -> None:
    """``comm_hook`` / ``comm_hook_state`` / ``comm_wrapper``, checked at construction: a known hook name or a
    callable, a wrapper only around a hook, PowerSGD options only for a PowerSGD hook."""
    if hook is not None and not callable(hook) and hook not in COMM_HOOKS:
        raise invalid_choice("comm_hook", hook, COMM_HOOKS, "or pass a DDP communication hook callable")
    if wrapper is not None and wrapper not in COMM_WRAPPERS:
        raise invalid_choice("comm_wrapper", wrapper, COMM_WRAPPERS, "or None (what the hook sends, uncompressed)")
    if wrapper is not None and hook is None:
        raise ConfigurationError(
            f"comm_wrapper={wrapper!r} compresses what a communication hook sends, and comm_hook is None: pass "
            f"comm_hook='power_sgd' (or another hook) with it, or comm_hook={wrapper!r} to compress the gradients"
        )
    if hook in ("fp16", "bf16") and state is not None:
        raise ConfigurationError(
            f"comm_hook_state={state!r} with comm_hook={hook!r}: the {hook} hook takes no state; its options are "
            "PowerSGD's (comm_hook='power_sgd'), or a callable comm_hook's own state"
        )
    if hook in _POWER_SGD and state is not None:
        _check_power_sgd_state(hook, state)
    if hook == "batched_power_sgd" and not _batched_power_sgd_works():
        raise ConfigurationError(
            f"comm_hook='batched_power_sgd': torch {torch.__version__}'s batched_powerSGD_hook fails at its first "
            "compressed step (it orthogonalizes one matrix with a function that takes batches of them). Use "
            "comm_hook='power_sgd' (the same compression, one matrix per gradient)"
        )


def _batched_power_sgd_works() -> bool:
    """Whether torch's batched PowerSGD hook can run: it calls ``_orthogonalize`` on one 2-D matrix, which some
    torch versions (2.13) accept only as a batch (3-D)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return False
    return True


def _check_power_sgd_state(hook: str, state: Any) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if isinstance(state, PowerSGDState):
        return
    if not isinstance(state, dict):
        raise ConfigurationError(
            f"comm_hook_state={state!r} with comm_hook={hook!r} must be a dict of PowerSGDState options "
            "(e.g. {'matrix_approximation_rank': 1, 'start_powerSGD_iter': 1000}) or a PowerSGDState"
        )
    options = [p for p in inspect.signature(PowerSGDState).parameters if p != "process_group"]
    unknown = sorted(set(state) - set(options))
    if unknown:
        raise ConfigurationError(
            f"comm_hook_state={state!r} with comm_hook={hook!r}: {unknown} not PowerSGDState options; "
            f"it takes {', '.join(options)}"
        )


def comm_hook_and_state(hook: Any, state: Any, wrapper: Optional[str]) -> tuple:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook`` (names checked by ``check_comm_hook``);
    a PowerSGD state is built here from its options, as Accelerate's ``PowerSGDState(None, **options)``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    builtin = {
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
        "power_sgd": powerSGD_hook.powerSGD_hook,
        "batched_power_sgd": powerSGD_hook.batched_powerSGD_hook,
    }
    function = builtin[hook] if isinstance(hook, str) else hook
    if hook in _POWER_SGD and not isinstance(state, powerSGD_hook.PowerSGDState):
        try:
            state = powerSGD_hook.PowerSGDState(None, **(state or {}))
        except (TypeError, ValueError) as err:
            raise ConfigurationError(f"comm_hook_state={state!r} for comm_hook={hook!r}: {err}") from None
    if wrapper is not None:
        wrap = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}
        function = wrap[wrapper](function)  # type: ignore[arg-type]  # torch's hooks are typed loosely
    return state, function


def _elastic_store(env: Any, timeout: timedelta) -> dict:
    """After a torchrun ``--max-restarts`` restart, a store namespaced by the attempt.

    torch's agent store outlives a failed attempt, and torch 2.x no longer prefixes keys by
    attempt: a restarted rank could read a dead rank's gloo address and fail to connect (seen
    here). Keys under ``attempt_<TORCHELASTIC_RESTART_COUNT>`` are written fresh by every rank."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if env.kind != "torchrun" or attempt is None:
        return {}  # plain env:// rendezvous
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=not agent_hosts_store and env.rank == 0,
        timeout=timeout,
    )
    return {
        "store": dist.PrefixStore(f"trainforge/attempt_{attempt}", store),
        "rank": env.rank,
        "world_size": env.world_size,
    }


class ProcessGroupMixin:
    """Process-group start, device choice and collectives, shared by every multi-process strategy.

    A mixin rather than a base class: FSDP and DeepSpeed reuse the collectives without being a
    kind of DDP (docs/ARCHITECTURE.md: composition over inheritance)."""

    if TYPE_CHECKING:  # the Strategy's, for the type checker
        name: str
        accelerator: str
        _device: Optional[torch.device]

    cluster: Any = None  # the detected environment (strategies/environment.py), set when the group starts

    _owns_process_group = False

    def _start_process_group(self, backend: Optional[str], timeout: timedelta) -> torch.device:
        from trainforge.strategies.devices import default_device, set_current_device
        from trainforge.strategies.environment import default_backend, detect_environment

        env = detect_environment()
        self.cluster = env
        device = self._device
        if device is None:
            device = default_device(self.accelerator, env.local_rank)
        if device.type != "cpu":
            set_current_device(device)
        if not dist.is_available():
            raise ConfigurationError("torch.distributed is not available in this torch build; use strategy='single'")
        if not dist.is_initialized():
            os.environ.update(env.as_env())
            backend = backend or default_backend(device)
            dist.init_process_group(backend=backend, timeout=timeout, **_elastic_store(env, timeout))
            self._owns_process_group = True
            clean_exit.register(self._stop_process_group)  # torch warns at exit about a group left open
        clean_exit.register()  # a group someone else started exits cleanly too
        if dist.get_rank() == 0:
            log.info(
                "trainforge: strategy=%s backend=%s world_size=%d environment=%s master=%s:%s device=%s",
                self.name,
                dist.get_backend(),
                dist.get_world_size(),
                env.kind,
                env.master_addr,
                env.master_port,
                device.type,
            )
        return device

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        return self.cluster.local_rank if self.cluster is not None else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in REDUCE_OPS:
            raise invalid_choice("op", op, REDUCE_OPS)
        if self.world_size == 1:
            return tensor
        out = tensor.clone()
        dist.all_reduce(out, op=_REDUCE.get(op, dist.ReduceOp.SUM))
        return mean_from_sum(out, self.world_size) if op == "mean" else out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts)

    def all_gather_object(self, obj: Any) -> List[Any]:
        if self.world_size == 1:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        if isinstance(obj, torch.Tensor):
            out = obj.clone().contiguous()
            dist.broadcast(out, src)
            return out
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self, name: Optional[str] = None) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _stop_process_group(self) -> None:
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False


class DDPStrategy(ProcessGroupMixin, Strategy):
    """Data parallelism with ``DistributedDataParallel``: every rank holds the whole model, gradients are
    averaged over the ranks; accumulation skips the gradient sync with ``no_sync``.

    Args:
        device: this process's device (a ``torch.device`` or a string such as ``"cuda:1"``). Default None: the
            device of the process's local rank for the accelerator asked for (the CPU, or ``cuda:<local_rank>``).
        find_unused_parameters: DDP finds the parameters a forward did not use, so their gradients do not
            hang the all-reduce (default False: faster; set True for models with branches).
        static_graph: tell DDP the set of used parameters and the graph do not change between iterations,
            which allows its optimizations (default False).
        gradient_as_bucket_view: gradients are views into DDP's communication buckets, saving one copy of
            the gradients' memory (default False).
        comm_hook: the DDP communication hook, one of torch's by name: ``"fp16"`` or ``"bf16"`` (gradients
            compressed for the all-reduce), ``"power_sgd"`` or ``"batched_power_sgd"`` (PowerSGD low-rank
            compression), or a hook callable ``(state, bucket) -> Future``. Default None: no hook, full precision.
        comm_hook_state: the ``state`` handed to a callable ``comm_hook``; for ``"power_sgd"`` and
            ``"batched_power_sgd"`` a dict of ``PowerSGDState`` options (``matrix_approximation_rank``,
            ``start_powerSGD_iter``, ...) or a ``PowerSGDState`` (default None: PowerSGD's defaults).
        comm_wrapper: ``"fp16"`` or ``"bf16"``: wrap ``comm_hook`` so what it sends is compressed to that type
            (torch's ``fp16_compress_wrapper``/``bf16_compress_wrapper``, Accelerate's ``comm_wrapper``).
        process_group_backend: the ``torch.distributed`` backend of the process group this strategy starts
            (default None: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU, else the backend registered for the device
            type). Not used when a process group already exists.
        timeout: how long a collective may wait for the other ranks before it fails, a ``datetime.timedelta``
            (default 30 minutes), passed to ``init_process_group``.
        activation_checkpointing: trade compute for activation memory, the same values for every strategy
            (``strategies/activation_memory.py``): None, False or ``"none"`` (default: off), ``"full"`` or True
            (every repeated block recomputed in backward), ``"selective:<n>"`` (every n-th block), ``"op"``
            (matmul and attention outputs kept, the rest recomputed), ``"offload"`` (saved activations moved to
            host memory), a dict ``{"mode": ..., "every": n, "blocks": ...}``, or a set of module classes /
            class names or a callable ``(module, name) -> bool`` ("full" on those modules). Applied before DDP wraps the module.
        **ddp_kwargs: any other ``DistributedDataParallel`` argument (e.g. ``bucket_cap_mb``), passed on;
            an unknown name is refused at construction.
    """

    name = "ddp"
    redirect_forward = True
    grad_reduction = "mean"  # the reducer all-reduces and divides by world_size (so do the fp16/bf16 hooks)
    window_grads_in_params = True  # mid-window: each rank's .grad, accumulated locally
    trainable_only_checkpoints = True

    def __init__(
        self,
        device: Optional[Union[torch.device, str]] = None,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        comm_hook: Optional[Union[str, Callable]] = None,
        comm_hook_state: Any = None,
        comm_wrapper: Optional[str] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=30),
        activation_checkpointing: Any = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(device, activation_checkpointing)
        check_comm_hook(comm_hook, comm_hook_state, comm_wrapper)
        unknown = sorted(set(ddp_kwargs) - _DDP_ARGS)
        if unknown:
            raise ConfigurationError(
                f"DDPStrategy got unknown keyword argument(s) {unknown}: they are passed to "
                f"DistributedDataParallel, which accepts: {', '.join(sorted(_DDP_ARGS))}"
            )
        check_timeout(timeout, "DDPStrategy")
        self.ddp_kwargs = dict(
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **ddp_kwargs,
        )
        self.comm_hook, self.comm_hook_state, self.comm_wrapper = comm_hook, comm_hook_state, comm_wrapper
        self.backend, self.timeout = process_group_backend, timeout

    def setup_environment(self, accelerator: str = "auto") -> None:
        self.accelerator = accelerator
        self._device = self._start_process_group(self.backend, self.timeout)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        if self.world_size == 1:
            return module
        # One device per process on any accelerator (cuda, xpu, a PrivateUse1 backend); none on CPU/MPS.
        device = self.root_device
        device_ids = [device.index] if device.type not in ("cpu", "mps") and device.index is not None else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        self._register_comm_hook(ddp)
        return ddp

    def _register_comm_hook(self, ddp: DistributedDataParallel) -> None:
        if self.comm_hook is None:
            return
        try:
            ddp.register_comm_hook(*comm_hook_and_state(self.comm_hook, self.comm_hook_state, self.comm_wrapper))
        except TypeError as err:  # torch refuses its bf16 hooks without NCCL 2.10+ (CUDA) or XCCL (XPU)
            if "BF16" not in str(err):
                raise
            given = "comm_wrapper" if self.comm_wrapper == "bf16" else "comm_hook"
            raise ConfigurationError(
                f"{given}='bf16': torch compresses gradients to bf16 only with CUDA and NCCL 2.10+ or XPU and "
                f"XCCL; this process group uses {dist.get_backend()!r} ({err}). Use {given}='fp16' here"
            ) from None

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def prepare_for_manual_backward(self, module: nn.Module, loss: torch.Tensor) -> None:
        """Manual optimization runs several backward passes per forward (one per optimizer): ready
        DDP's reducer for each, as Lightning's DDP strategy does before every backward."""
        if not isinstance(module, DistributedDataParallel) or not torch.is_grad_enabled():
            return
        if not module.require_backward_grad_sync:
            module.require_forward_param_sync = False
            return
        module.require_forward_param_sync = True
        find = module.find_unused_parameters and not module.static_graph
        outputs = [t for t in (loss if isinstance(loss, (list, tuple)) else [loss]) if isinstance(t, torch.Tensor)]
        module.reducer._rebuild_buckets()
        module.reducer.prepare_for_backward(outputs if find else [])

    @contextlib.contextmanager
    def force_backward_sync(self, module: nn.Module) -> Iterator[None]:
        """The forward and backward inside all-reduce gradients even within ``no_sync`` (Accelerate's
        ``trigger_sync_in_backward``): DDP's sync flags are set for the block, then restored."""
        if not isinstance(module, DistributedDataParallel):
            yield
            return
        old = module.require_backward_grad_sync, module.require_forward_param_sync
        module.require_backward_grad_sync = module.require_forward_param_sync = True
        try:
            yield
        finally:
            module.require_backward_grad_sync, module.require_forward_param_sync = old

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def teardown(self) -> None:
        self._stop_process_group()
