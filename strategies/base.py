"""The narrow Strategy interface (docs/ARCHITECTURE.md "The strategy interface").

A strategy owns placement, wrapping, collectives and sharded checkpoint I/O. It never imports
``trainer``. The Accelerator calls, in this order::

    setup_environment(accelerator) -> configure(RunSettings) -> setup(module, optimizers)
        -> setup_dataloader(dl) ... -> teardown()

``configure`` hands over the run's settings as one frozen ``RunSettings`` (replaced whole, never
edited field by field); what a strategy can do is declared on this class with defaults
(``pipelined``, ``redirect_forward``, ``handles_accumulation``, ``loss_scaling_in_backend``,
``input_dtype``, ``device_batches``, ``grad_reduction``, ``window_grads_in_params``,
``activation_checkpointing_modes``), so callers read attributes instead of probing.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from trainforge.strategies.activation_memory import (
    MODES,
    ActivationMemory,
    apply_activation_memory,
    check_supported,
    parse_activation_checkpointing,
    select_blocks,
)
from trainforge.strategies.errors import CheckpointError, invalid_choice
from trainforge.strategies.materialize import has_meta, materialize
from trainforge.strategies.precision import Precision

log = logging.getLogger("trainforge")
REDUCE_OPS = ("sum", "mean", "max", "min")
#: What ``Strategy.setup`` takes: built optimizers, or a callable that builds them after placement.
Optimizers = Union[Sequence[torch.optim.Optimizer], Callable[[], Sequence[torch.optim.Optimizer]]]


def build_optimizers(optimizers: Optimizers) -> List[torch.optim.Optimizer]:
    """The optimizers as a list; a builder is called here (after the module was placed/wrapped)."""
    return list(optimizers() if callable(optimizers) else optimizers)


def mean_from_sum(total: torch.Tensor, world_size: int) -> torch.Tensor:
    """``op="mean"`` for backends that reduce with a sum: floats divided, integers floor-divided."""
    return total / world_size if total.is_floating_point() else total // world_size


@dataclass(frozen=True)
class RunSettings:
    """The run's settings a strategy acts on, handed over by ``Strategy.configure`` (the Accelerator
    sends a new object when one changes: the micro-batch size is known once the first loader is
    prepared, the Trainer's clipping once it is built). Backends that generate their own
    configuration (DeepSpeed) read all of them at ``setup``; the rest read ``precision``."""

    precision: Precision = field(default_factory=Precision)
    accumulation_steps: int = 1
    micro_batch_size: Optional[int] = None  # per process, from the training DataLoader
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    device_placement: bool = True  # False: the module stays where the user put it (Accelerate's option)


class Strategy:
    """Base class of every strategy. Subclasses override what differs; the defaults are a single process.

    A strategy owns placement, wrapping, collectives and sharded checkpoint I/O. It gets the run's settings
    (precision, accumulation, clipping) as one frozen ``RunSettings`` through ``configure``, and declares
    what it can do as class attributes (``redirect_forward``, ``handles_accumulation``, ``grad_reduction``,
    ...), so callers read them instead of probing.

    Args:
        device: the device this process trains on (a ``torch.device`` or a string such as ``"cuda:1"``).
            Default None: chosen at ``setup_environment`` from the accelerator asked for and the local rank.
        activation_checkpointing: trade compute for activation memory, the same values for every strategy
            (``strategies/activation_memory.py``): None, False or ``"none"`` (default: off), ``"full"`` or True
            (every repeated block recomputed in backward), ``"selective:<n>"`` (every n-th block), ``"op"``
            (matmul and attention outputs kept, the rest recomputed), ``"offload"`` (saved activations moved to
            host memory), a dict ``{"mode": ..., "every": n, "blocks": ...}``, or a set of module classes /
            class names or a callable ``(module, name) -> bool`` ("full" on those modules). A mode the
            strategy cannot apply is refused at construction.
    """

    #: Whether ``init_module(empty_init=None)`` builds on the meta device (strategies/materialize.py).
    empty_init_default = False

    name = "base"
    #: The wrapper acts in ``forward`` (DDP's reducer, FSDP's unshard, ZeRO-3's gathering): a module's
    #: ``training_step`` is called through the prepared model's forward (``Accelerator.step_function``).
    redirect_forward = False
    #: The backend divides the loss by the accumulation steps itself (DeepSpeed's ``engine.backward``).
    handles_accumulation = False
    #: The backend runs the backward itself (DeepSpeed's ``engine.backward``): a module's ``backward`` hook
    #: cannot replace ``loss.backward()`` there.
    own_backward = False
    #: The backend scales fp16 losses itself (DeepSpeed): the precision's grad scaler is not used.
    loss_scaling_in_backend = False
    #: Floating inputs are cast to this dtype (parameters kept in half precision by the backend), or None.
    input_dtype: Optional[torch.dtype] = None
    #: How gradients are combined over the data-parallel ranks at a sync step: "mean" (one device, DDP,
    #: FSDP2), or None where trainforge cannot rescale them afterwards (DeepSpeed's engine scales them
    #: itself, pipeline schedules, XLA). A loss summed over items (``trainer/accelerator/token_loss.py``) needs "mean".
    grad_reduction: Optional[str] = None
    #: Inside an accumulation window (no sync yet) each rank's ``param.grad`` holds all of its partial
    #: gradient as a plain tensor, so a checkpoint written there can save and restore it
    #: (``trainer/checkpoint/partial_grads.py``): one device, DDP. False where the backend keeps it elsewhere
    #: (FSDP2's unsharded accumulated gradients, DeepSpeed's engine, pipeline stages, XLA).
    window_grads_in_params = False
    #: ``save_trainable``/``load_trainable`` write and read checkpoints without the frozen parameters
    #: (``strategies/checkpoint/frozen.py``): one device, DDP, FSDP2. False where the backend writes the
    #: whole model itself (DeepSpeed's engine) or it is untested (pipeline stages, XLA).
    trainable_only_checkpoints = False

    #: The ``activation_checkpointing`` modes this strategy applies (``strategies/activation_memory.py``);
    #: another is refused at construction, with ``activation_checkpointing_limits`` saying why.
    activation_checkpointing_modes: Tuple[str, ...] = MODES
    activation_checkpointing_limits = ""

    def __init__(self, device: Optional[torch.device | str] = None, activation_checkpointing: Any = None) -> None:
        self._device = torch.device(device) if device is not None else None
        self.accelerator = "auto"  # the device type asked for (setup_environment's argument)
        self.settings = RunSettings()
        self.activation_checkpointing = activation_checkpointing  # as given; parsed:
        self.activation_memory: ActivationMemory = parse_activation_checkpointing(activation_checkpointing)
        check_supported(
            self.activation_memory, self.name, self.activation_checkpointing_modes, self.activation_checkpointing_limits
        )
        self.checkpointed_modules: List[str] = []  # names of the blocks wrapped for activation_checkpointing

    @property
    def pipelined(self) -> bool:
        """``forward_backward`` runs a pipeline schedule (returns the batch loss, runs the backward itself)."""
        return False

    def configure(self, settings: RunSettings) -> None:
        """Take the run's settings (before ``setup``; again, whole, when one of them changes)."""
        if not isinstance(settings, RunSettings):
            raise TypeError(f"configure() takes a RunSettings, got {type(settings).__name__}")
        self.settings = settings

    @property
    def precision(self) -> Precision:
        return self.settings.precision

    # ---- topology -------------------------------------------------------------------------
    @property
    def requested_device(self) -> Optional[torch.device]:
        """The device given at construction; None when the strategy picks it at setup."""
        return self._device

    @property
    def root_device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def data_parallel_rank(self) -> int:
        """Which data shard this process reads (model-parallel ranks of one replica share one)."""
        return self.global_rank

    @property
    def data_parallel_size(self) -> int:
        return self.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    # ---- lifecycle ------------------------------------------------------------------------
    def setup_environment(self, accelerator: str = "auto") -> None:
        """Start the process group, pick the device (of type ``accelerator`` when the strategy was
        given no device). Called once, before anything is placed."""
        self.accelerator = accelerator

    def plan_layout(self, module: nn.Module, loader: Any) -> None:
        """Called with the model and the first loader before any loader is sharded: a strategy whose
        layout depends on the model (MegatronStrategy's "auto" sizes) chooses it here. Default: nothing."""

    def setup(self, module: nn.Module, optimizers: Optimizers) -> Tuple[nn.Module, List[torch.optim.Optimizer]]:
        """Move (and wrap) the module; return the module to call and the optimizers to step.

        ``optimizers``: those the user built beforehand (Accelerate's order), or a callable that
        builds them, called once the module is placed and wrapped so that they see its final
        device and parameters (the Trainer's order, for every strategy)."""
        # a model built on the meta device gets new parameters when materialised: optimizers built
        # on the meta ones are pointed at them (matched by name)
        built = [] if callable(optimizers) else list(optimizers)
        before = list(module.named_parameters()) if built and has_meta(module) else []
        module = self.setup_module(module)
        if before:
            from trainforge.strategies.fsdp_wrap import remap_optimizers

            remap_optimizers(before, module, built)
        return module, build_optimizers(optimizers)

    def setup_module(self, module: nn.Module) -> nn.Module:
        if has_meta(module) and self.settings.device_placement:  # built with empty_init: whole, before placement
            materialize(module, self.root_device)  # (device_placement=False: the user's model is left as it is)
        placed = module.to(self.root_device) if self.settings.device_placement else module
        module = self.precision.convert_module(placed)
        self.wrap_activation_blocks(module)
        return module

    def wrap_activation_blocks(
        self, module: nn.Module, default_blocks: Any = None, names: Optional[Sequence[str]] = None
    ) -> Dict[int, nn.Module]:
        """Apply ``activation_checkpointing`` to ``module``'s blocks (``names``, else those
        ``select_blocks`` finds, by ``default_blocks`` when the value names none); returns
        ``{id(block): wrapper}`` for strategies that shard the wrappers."""
        spec = self.activation_memory
        if names is None:
            names = select_blocks(module, spec, default_blocks)
        wrappers = apply_activation_memory(module, spec, names)
        if names:
            self.checkpointed_modules = [n for n in names if n in dict(module.named_modules())]
        if spec.kind == "offload" and wrappers and self.root_device.type == "cpu" and self.is_global_zero:
            log.warning(
                "trainforge: activation_checkpointing='offload' moves saved activations to host memory; "
                "this run computes on the CPU, where they already are, so it saves nothing here"
            )
        return wrappers

    def setup_dataloader(self, dataloader: Any, *, seed: int = 0) -> Any:
        """Shard and make resumable (see ``trainforge.strategies.data.loader``)."""
        from trainforge.strategies.data.loader import prepare_dataloader

        return prepare_dataloader(dataloader, rank=self.global_rank, world_size=self.world_size, seed=seed)

    #: A strategy whose backend moves batches to the device itself (XLA's ``MpDeviceLoader``) defines
    #: ``device_batches(iterable) -> iterable``; the prepared loader then iterates through it (and keeps
    #: the data position of each batch the loop received, not of batches prefetched ahead).
    device_batches: Optional[Callable[[Any], Any]] = None

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``setup`` put around it."""
        return getattr(module, "module", module) if self.world_size > 1 else module

    def teardown(self) -> None:
        """Release what ``setup_environment`` took."""

    # ---- the step -------------------------------------------------------------------------
    def forward_backward(
        self,
        module: nn.Module,
        step_fn: Optional[Callable[..., Any]],
        batch: Any,
        batch_idx: int,
        backward: Optional[Callable[[Any], None]] = None,
        loss_fn: Optional[Callable[[Any, Any], Any]] = None,
    ) -> Any:
        """One training batch, the Trainer's only step path: ``step_fn(batch, batch_idx)`` under the
        precision's autocast, then ``backward(output)`` (the caller's loss extraction and backward);
        returns the step's output. A pipeline strategy runs its micro-batch schedule here instead
        (forward, ``loss_fn`` or the module's, and backward on every stage) and returns the batch loss."""
        with self.precision.autocast():
            output = step_fn(batch, batch_idx)  # type: ignore[misc]
        if backward is not None:
            backward(output)
        return output

    def evaluate_batch(self, module: nn.Module, step_fn: Callable[..., Any], batch: Any, batch_idx: int) -> Any:
        """One validation/test/predict batch: ``step_fn`` under autocast (a pipeline strategy: the
        batch's loss through the stages, forward only)."""
        with self.precision.autocast():
            return step_fn(batch, batch_idx)

    def backward(self, loss: torch.Tensor, module: Optional[nn.Module]) -> None:
        self.precision.backward(loss)

    def force_backward_sync(self, module: nn.Module) -> ContextManager[Any]:
        """Gradients sync in the backward inside even within ``no_backward_sync`` (DDP overrides)."""
        return contextlib.nullcontext()

    def prepare_for_manual_backward(self, module: nn.Module, loss: torch.Tensor) -> None:
        """Called before each backward of manual optimization (several per forward); DDP readies its reducer."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> Any:
        return self.precision.optimizer_step(optimizer)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager[Any]:
        """Skip gradient synchronisation for the backward passes inside (accumulation)."""
        return contextlib.nullcontext()

    def clip_gradients(
        self,
        parameters: Any,
        *,
        max_norm: Optional[float] = None,
        clip_value: Optional[float] = None,
        norm_type: float = 2.0,
    ) -> Optional[torch.Tensor]:
        """Clip by total norm (returns the norm before clipping) or by value."""
        params = [p for p in parameters if p.grad is not None]
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, clip_value)
            return None
        if max_norm is None:
            return None
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    # ---- collectives (identities on one process) ------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in REDUCE_OPS:
            raise invalid_choice("op", op, REDUCE_OPS)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Tensors from every rank stacked on a new leading dim of size ``world_size``."""
        return tensor.unsqueeze(0)

    def all_gather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self, name: Optional[str] = None) -> None:
        pass

    # ---- checkpoints ----------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """A full (consolidated) state dict of the user's module; every rank calls it."""
        return self.unwrap(module).state_dict()

    def load_module_state_dict(self, module: nn.Module, state: Dict[str, torch.Tensor], strict: bool = True) -> None:
        self.unwrap(module).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)

    def save_checkpoint(self, writer: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Write model and optimizer state into an open ``CheckpointWriter``.

        The default consolidates on rank 0: weights as safetensors, optimizers with torch.save.
        Sharded strategies override this with their own format inside the same directory."""
        weights = self.module_state_dict(module)
        opt_states = [self.optimizer_state_dict(module, opt) for opt in optimizers]
        if self.is_global_zero:
            writer.save_tensors("model", weights)
            writer.save_object("optimizers", opt_states)

    def load_checkpoint(self, path: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        from trainforge.strategies.checkpoint.io import load_object, load_tensors

        weights = load_tensors(path, "model", device="cpu")
        check_model_state(path, self.unwrap(module).state_dict(), weights)
        self.load_module_state_dict(module, weights)
        if optimizers:
            states = load_object(path, "optimizers")
            check_optimizer_states(path, optimizers, states)
            for opt, state in zip(optimizers, states):
                self.load_optimizer_state_dict(module, opt, state)

    def trainable_state_dict(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """``module_state_dict`` less the frozen parameters (buffers kept); rank 0's is the full one."""
        from trainforge.strategies.checkpoint.frozen import without_frozen

        return without_frozen(self.module_state_dict(module), self.unwrap(module))

    def save_trainable(self, writer: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """``save_checkpoint`` without the frozen parameters (``trainable_only_checkpoints``)."""
        weights = self.trainable_state_dict(module)
        opt_states = [self.optimizer_state_dict(module, opt) for opt in optimizers]
        if self.is_global_zero:
            writer.save_tensors("model", weights)
            writer.save_object("optimizers", opt_states)

    def load_trainable(self, path: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Restore a ``save_trainable`` checkpoint; the frozen parameters stay as they are (the caller
        has checked them against the checkpoint's record of its base)."""
        from trainforge.strategies.checkpoint.frozen import without_frozen
        from trainforge.strategies.checkpoint.io import load_object, load_tensors

        weights = load_tensors(path, "model", device="cpu")
        check_model_state(path, without_frozen(self.unwrap(module).state_dict(), self.unwrap(module)), weights)
        self.load_module_state_dict(module, weights, strict=False)
        if optimizers:
            states = load_object(path, "optimizers")
            check_optimizer_states(path, optimizers, states)
            for opt, state in zip(optimizers, states):
                self.load_optimizer_state_dict(module, opt, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device}, world_size={self.world_size})"


def check_model_state(path: Any, expected: Dict[str, Any], loaded: Dict[str, torch.Tensor]) -> None:
    """CheckpointError naming ``path`` and the first mismatching keys when ``loaded`` does not fit the model."""
    missing = [k for k in expected if k not in loaded]
    unexpected = [k for k in loaded if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(loaded[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in loaded and hasattr(expected[k], "shape") and tuple(loaded[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or shapes:
        parts = [
            f"{what} {items[:3]}{' ...' if len(items) > 3 else ''}"
            for what, items in (
                ("missing from the checkpoint:", missing),
                ("not in the model:", unexpected),
                ("different shapes:", shapes),
            )
            if items
        ]
        raise CheckpointError(
            f"{path} does not fit this model ({'; '.join(parts)}); resume with the model it was "
            "saved from, or start a new run (load only matching weights yourself)"
        )


def check_optimizer_states(path: Any, optimizers: Sequence[torch.optim.Optimizer], states: Any) -> None:
    """CheckpointError naming ``path`` when the saved optimizer states do not fit ``optimizers``."""
    if not isinstance(states, (list, tuple)) or len(states) != len(optimizers):
        count = len(states) if isinstance(states, (list, tuple)) else "no list of"
        raise CheckpointError(
            f"{path} holds {count} optimizer state(s) but the module has {len(optimizers)} "
            "optimizer(s); resume with the same configure_optimizers"
        )
    for i, (opt, state) in enumerate(zip(optimizers, states)):
        groups = state.get("param_groups", []) if isinstance(state, dict) else []
        if len(groups) != len(opt.param_groups):
            raise CheckpointError(
                f"{path}: optimizer {i} has {len(groups)} parameter group(s) in the checkpoint, "
                f"{len(opt.param_groups)} now ({type(opt).__name__}); resume with the same optimizer"
            )
        for g, (saved, now) in enumerate(zip(groups, opt.param_groups)):
            # keys on both sides differ: another optimizer class (one side only: another torch version)
            keys = sorted(set(saved) ^ set(now)) if set(saved) - set(now) and set(now) - set(saved) else []
            if keys or len(saved.get("params", [])) != len(now["params"]):
                detail = (
                    f"settings differ: {keys[:5]} (a different optimizer class?)"
                    if keys
                    else f"{len(saved.get('params', []))} parameters saved, {len(now['params'])} now"
                )
                raise CheckpointError(
                    f"{path}: optimizer {i} ({type(opt).__name__}) group {g} does not match the "
                    f"checkpoint: {detail}; resume with the optimizer it was saved with"
                )
