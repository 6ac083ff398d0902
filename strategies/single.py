"""One process, one device: cpu, cuda or mps."""
from __future__ import annotations

from typing import Optional

import torch

from strategies.base import Strategy
from strategies.devices import default_device


class SingleDeviceStrategy(Strategy):
    name = "single"

    def __init__(self, device: Optional[torch.device | str] = None) -> None:
        super().__init__(device)

    def setup_environment(self) -> None:
        if self._device is None:  # chosen now: the Accelerator sets ``accelerator`` before this call
            self._device = default_device(self.accelerator)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
