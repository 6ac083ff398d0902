"""One process, one device: the CPU, CUDA, MPS, or any accelerator torch reports (torch.accelerator)."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from trainforge.strategies.base import Strategy
from trainforge.strategies.devices import default_device, set_current_device
from trainforge.strategies.errors import ConfigurationError


class SingleDeviceStrategy(Strategy):
    """One process on one device: the CPU, a CUDA GPU, MPS, or any accelerator torch reports.

    Args:
        device: the device to train on (a ``torch.device`` or a string such as ``"cuda:1"``). Default None:
            the first device of the accelerator asked for (``Trainer(accelerator=...)``; "auto": a GPU when
            there is one, else the CPU).
        activation_checkpointing: trade compute for activation memory, the same values for every strategy
            (``strategies/activation_memory.py``): None, False or ``"none"`` (default: off), ``"full"`` or True
            (every repeated block recomputed in backward), ``"selective:<n>"`` (every n-th block), ``"op"``
            (matmul and attention outputs kept, the rest recomputed), ``"offload"`` (saved activations moved to
            host memory), a dict ``{"mode": ..., "every": n, "blocks": ...}``, or a set of module classes /
            class names or a callable ``(module, name) -> bool`` ("full" on those modules). A mode the
            strategy cannot apply is refused at construction.
    """

    name = "single"
    grad_reduction = "mean"  # of one device's gradients: they are used as they are
    window_grads_in_params = True  # mid-window: each rank's .grad, accumulated locally
    trainable_only_checkpoints = True

    def __init__(self, device: Optional[torch.device | str] = None, *, activation_checkpointing: Any = None) -> None:
        super().__init__(device, activation_checkpointing)

    def setup_environment(self, accelerator: str = "auto") -> None:
        self.accelerator = accelerator
        world = os.environ.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1:  # each process would train alone and write the same files
            raise ConfigurationError(
                f"strategy='single' runs one process, but this one was launched as one of "
                f"WORLD_SIZE={world} processes (rank {os.environ.get('RANK', '?')}); use "
                "strategy='ddp' (or 'auto', 'fsdp', 'deepspeed'), or launch one process"
            )
        if self._device is None:  # chosen now, of the type asked for
            self._device = default_device(self.accelerator)
        if self.root_device.type != "cpu":
            set_current_device(self.root_device)
