"""The narrow Strategy interface (docs/ARCHITECTURE.md "The strategy interface").

A strategy owns placement, wrapping, collectives and sharded checkpoint I/O. It never imports
``trainer``: the Accelerator hands it a precision object (duck-typed: ``convert_module``,
``backward``) and calls these methods in a fixed order:

    setup_environment() -> setup(module, optimizers) -> setup_dataloader(dl) ... -> teardown()
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from trainforge.strategies.errors import CheckpointError, invalid_choice

REDUCE_OPS = ("sum", "mean", "max", "min")
#: What ``Strategy.setup`` takes: built optimizers, or a callable that builds them after placement.
Optimizers = Union[Sequence[torch.optim.Optimizer], Callable[[], Sequence[torch.optim.Optimizer]]]


def build_optimizers(optimizers: Optimizers) -> List[torch.optim.Optimizer]:
    """The optimizers as a list; a builder is called here (after the module was placed/wrapped)."""
    return list(optimizers() if callable(optimizers) else optimizers)



def mean_from_sum(total: torch.Tensor, world_size: int) -> torch.Tensor:
    """``op="mean"`` for backends that reduce with a sum: floats divided, integers floor-divided."""
    return total / world_size if total.is_floating_point() else total // world_size

class Strategy:
    """Base class. Subclasses override what differs; the defaults are a single process."""

    name = "base"

    def __init__(self, device: Optional[torch.device | str] = None) -> None:
        self._device = torch.device(device) if device is not None else None
        self.precision: Any = None  # set by the Accelerator before setup()
        self.accelerator = "auto"   # device type when no ``device`` is given; set before setup_environment()
        # Training settings some backends need at setup (DeepSpeed's generated config); set by the
        # Accelerator / Trainer before setup(), defaults otherwise.
        self.accumulation_steps = 1
        self.micro_batch_size: Optional[int] = None
        self.gradient_clip_val: Optional[float] = None
        self.gradient_clip_algorithm = "norm"

    # ---- topology -------------------------------------------------------------------------
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
    def setup_environment(self) -> None:
        """Start the process group, pick the device. Called once, before anything is placed."""

    def plan_layout(self, module: nn.Module, loader: Any) -> None:
        """Called with the model and the first loader before any loader is sharded: a strategy whose
        layout depends on the model (MegatronStrategy's "auto" sizes) chooses it here. Default: nothing."""

    def setup(self, module: nn.Module, optimizers: "Optimizers") -> Tuple[nn.Module, List[torch.optim.Optimizer]]:
        """Move (and wrap) the module; return the module to call and the optimizers to step.

        ``optimizers``: those the user built beforehand (Accelerate's order), or a callable that
        builds them, called once the module is placed and wrapped so that they see its final
        device and parameters (the Trainer's order, for every strategy)."""
        module = self.setup_module(module)
        return module, build_optimizers(optimizers)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = module.to(self.root_device)
        if self.precision is not None:
            module = self.precision.convert_module(module)
        return module

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
    #: True when ``forward_backward`` runs a pipeline schedule; only then does the Trainer send its
    #: training batches through it (elsewhere the loop's inline forward + backward is this same path).
    pipelined = False

    def forward_backward(self, module: nn.Module, step_fn: Callable[..., Any], batch: Any, batch_idx: int,
                         backward: Optional[Callable[[Any], None]] = None) -> Any:
        """One training batch: ``step_fn(batch, batch_idx)`` under the precision's autocast, then
        ``backward(output)`` (the caller's loss extraction and backward); returns the step's output.
        A pipeline strategy runs its micro-batch schedule here instead (forward, the module's loss
        and backward on every stage) and returns the batch's loss."""
        with self.precision.autocast() if self.precision is not None else contextlib.nullcontext():
            output = step_fn(batch, batch_idx)
        if backward is not None:
            backward(output)
        return output

    def backward(self, loss: torch.Tensor, module: nn.Module) -> None:
        if self.precision is not None:
            self.precision.backward(loss)
        else:
            loss.backward()

    def force_backward_sync(self, module: nn.Module) -> ContextManager:
        """Gradients sync in the backward inside even within ``no_backward_sync`` (DDP overrides)."""
        return contextlib.nullcontext()

    def prepare_for_manual_backward(self, module: nn.Module, loss: torch.Tensor) -> None:
        """Called before each backward of manual optimization (several per forward); DDP readies its reducer."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> Any:
        if self.precision is not None:
            return self.precision.optimizer_step(optimizer)
        return optimizer.step()

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Skip gradient synchronisation for the backward passes inside (accumulation)."""
        return contextlib.nullcontext()

    def clip_gradients(self, parameters: Any, *, max_norm: Optional[float] = None,
                       clip_value: Optional[float] = None, norm_type: float = 2.0) -> Optional[torch.Tensor]:
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

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device}, world_size={self.world_size})"


def check_model_state(path: Any, expected: Dict[str, Any], loaded: Dict[str, torch.Tensor]) -> None:
    """CheckpointError naming ``path`` and the first mismatching keys when ``loaded`` does not fit the model."""
    missing = [k for k in expected if k not in loaded]
    unexpected = [k for k in loaded if k not in expected]
    shapes = [f"{k}: checkpoint {tuple(loaded[k].shape)} vs model {tuple(expected[k].shape)}" for k in expected
              if k in loaded and hasattr(expected[k], "shape") and tuple(loaded[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or shapes:
        parts = [f"{what} {items[:3]}{' ...' if len(items) > 3 else ''}" for what, items in
                 (("missing from the checkpoint:", missing), ("not in the model:", unexpected),
                  ("different shapes:", shapes)) if items]
        raise CheckpointError(f"{path} does not fit this model ({'; '.join(parts)}); resume with the model it was "
                              "saved from, or start a new run (load only matching weights yourself)")


def check_optimizer_states(path: Any, optimizers: Sequence[torch.optim.Optimizer], states: Any) -> None:
    """CheckpointError naming ``path`` when the saved optimizer states do not fit ``optimizers``."""
    if not isinstance(states, (list, tuple)) or len(states) != len(optimizers):
        count = len(states) if isinstance(states, (list, tuple)) else "no list of"
        raise CheckpointError(f"{path} holds {count} optimizer state(s) but the module has {len(optimizers)} "
                              "optimizer(s); resume with the same configure_optimizers")
    for i, (opt, state) in enumerate(zip(optimizers, states)):
        groups = state.get("param_groups", []) if isinstance(state, dict) else []
        if len(groups) != len(opt.param_groups):
            raise CheckpointError(f"{path}: optimizer {i} has {len(groups)} parameter group(s) in the checkpoint, "
                                  f"{len(opt.param_groups)} now ({type(opt).__name__}); resume with the same optimizer")
        for g, (saved, now) in enumerate(zip(groups, opt.param_groups)):
            # keys on both sides differ: another optimizer class (one side only: another torch version)
            keys = sorted(set(saved) ^ set(now)) if set(saved) - set(now) and set(now) - set(saved) else []
            if keys or len(saved.get("params", [])) != len(now["params"]):
                detail = (f"settings differ: {keys[:5]} (a different optimizer class?)" if keys else
                          f"{len(saved.get('params', []))} parameters saved, {len(now['params'])} now")
                raise CheckpointError(f"{path}: optimizer {i} ({type(opt).__name__}) group {g} does not match the "
                                      f"checkpoint: {detail}; resume with the optimizer it was saved with")
