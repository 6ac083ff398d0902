"""Which device a process trains on: the ``accelerator`` choice (Lightning's vocabulary).

``"auto"`` takes this local rank's CUDA device, then MPS, then the CPU; ``"cpu"`` pins the CPU
even where GPUs are visible (a CPU run, or CPU tests on a GPU workstation); ``"gpu"``/``"cuda"``
insist on CUDA and say so when there is none. A strategy given an explicit ``device`` keeps it.
"""
from __future__ import annotations

from typing import Optional

import torch

from strategies.errors import ConfigurationError, invalid_choice

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def normalize_accelerator(value: object) -> str:
    key = str(value).lower().strip() if value is not None else "auto"
    if key not in ACCELERATORS:
        raise invalid_choice("accelerator", value, ACCELERATORS, "'auto' picks CUDA, then MPS, then the CPU")
    return "cuda" if key == "gpu" else key


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()


def default_device(accelerator: str = "auto", local_rank: int = 0) -> torch.device:
    """The device of the process with this ``local_rank`` for the ``accelerator`` choice."""
    kind = normalize_accelerator(accelerator)
    if kind == "cpu":
        return torch.device("cpu")
    if kind in ("auto", "cuda") and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ConfigurationError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible "
                f"(CUDA_VISIBLE_DEVICES={_visible()}); launch at most that many processes per node, or pass "
                "accelerator='cpu'")
        return torch.device("cuda", local_rank)
    if kind in ("auto", "mps") and _mps_available():
        return torch.device("mps")
    if kind == "auto":
        return torch.device("cpu")
    raise ConfigurationError(f"accelerator={accelerator!r} but this process sees no {kind.upper()} device "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
                             f"{_visible()}); pass accelerator='auto' or 'cpu'")


def check_device_matches(accelerator: str, device: Optional[torch.device]) -> None:
    """An explicit strategy device and an explicit accelerator must agree."""
    kind = normalize_accelerator(accelerator)
    if device is not None and kind != "auto" and torch.device(device).type != kind:
        raise ConfigurationError(f"accelerator={accelerator!r} conflicts with the strategy's device={device}; "
                                 "drop one of them")


def _visible() -> str:
    import os

    return repr(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
