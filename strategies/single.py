"""One process, one device: cpu, cuda or mps."""
from __future__ import annotations

from typing import Optional

import torch

from strategies.base import Strategy


def default_device() -> torch.device:
    """The best device this process can see: cuda (this local rank's), then mps, then cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class SingleDeviceStrategy(Strategy):
    name = "single"

    def __init__(self, device: Optional[torch.device | str] = None) -> None:
        super().__init__(device if device is not None else default_device())

    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
