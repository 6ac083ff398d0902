"""The narrow Strategy interface (DESIGN.md "Strategy interface").

A strategy owns placement, wrapping, collectives and sharded checkpoint I/O. It never imports
``trainer``: the Accelerator hands it a precision object (duck-typed: ``convert_module``,
``backward``) and calls these methods in a fixed order:

    setup_environment() -> setup(module, optimizers) -> setup_dataloader(dl) ... -> teardown()
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from strategies.errors import invalid_choice

REDUCE_OPS = ("sum", "mean", "max", "min")


class Strategy:
    """Base class. Subclasses override what differs; the defaults are a single process."""

    name = "base"
    #: True when ``setup`` must see the optimizers created *after* the model is wrapped
    #: (FSDP shards parameters, DeepSpeed builds its own optimizer).
    requires_optimizer_after_setup = False

    def __init__(self, device: Optional[torch.device | str] = None) -> None:
        self._device = torch.device(device) if device is not None else None
        self.precision: Any = None  # set by the Accelerator before setup()
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

    def setup(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Tuple[nn.Module, List[torch.optim.Optimizer]]:
        """Move (and wrap) the module; return the module to call and the optimizers to step."""
        return self.setup_module(module), list(optimizers)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = module.to(self.root_device)
        if self.precision is not None:
            module = self.precision.convert_module(module)
        return module

    def setup_dataloader(self, dataloader: Any, *, seed: int = 0) -> Any:
        """Shard and make resumable (see ``strategies.data``)."""
        from strategies.data import prepare_dataloader

        return prepare_dataloader(dataloader, rank=self.global_rank, world_size=self.world_size, seed=seed)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``setup`` put around it."""
        return getattr(module, "module", module) if self.world_size > 1 else module

    def teardown(self) -> None:
        """Release what ``setup_environment`` took."""

    # ---- the step -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: nn.Module) -> None:
        if self.precision is not None:
            self.precision.backward(loss)
        else:
            loss.backward()

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
        from strategies.checkpoint_io import load_object, load_tensors

        self.load_module_state_dict(module, load_tensors(path, "model", device="cpu"))
        if optimizers:
            states = load_object(path, "optimizers")
            for opt, state in zip(optimizers, states):
                self.load_optimizer_state_dict(module, opt, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device}, world_size={self.world_size})"
