"""Which device a process trains on: the ``accelerator`` choice (Lightning's vocabulary).

``"auto"`` takes the accelerator torch reports (``torch.accelerator.current_accelerator()``: CUDA,
MPS, XPU, or a PrivateUse1 backend registered by a plugin such as torch-tpu's ``"tpu"``) at this
process's local rank, else the CPU; ``"cpu"`` pins the CPU even where GPUs are visible (a CPU run,
or CPU tests on a GPU workstation); ``"gpu"``/``"cuda"`` insist on CUDA and say so when there is
none; the name of the accelerator torch reports (e.g. ``"tpu"``, ``"xpu"``) insists on it. A
strategy given an explicit ``device`` keeps it. Nothing here names a plugin backend: a backend that
registers with torch as an accelerator needs no code (and no strategy) of its own.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from trainforge.strategies.errors import ConfigurationError, invalid_choice

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def current_accelerator() -> Optional[torch.device]:
    """The accelerator torch reports as available (None on a CPU-only machine or an older torch)."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    device = acc.current_accelerator()
    return torch.device(device.type) if device is not None else None


def accelerator_choices() -> tuple:
    """The accepted names: the fixed ones plus the type of the accelerator torch reports, if another."""
    found = current_accelerator()
    return ACCELERATORS + ((found.type,) if found is not None and found.type not in ACCELERATORS else ())


def normalize_accelerator(value: object) -> str:
    key = str(value).lower().strip() if value is not None else "auto"
    if key in ACCELERATORS:
        return "cuda" if key == "gpu" else key
    choices = accelerator_choices()  # asks torch only for a name outside the fixed ones
    if key not in choices:
        raise invalid_choice(
            "accelerator",
            value,
            choices,
            "'auto' picks the accelerator torch reports "
            "(torch.accelerator: CUDA, MPS, XPU, or a registered backend such as 'tpu'), else the "
            "CPU; for torch_xla use strategy='xla'",
        )
    return "cuda" if key == "gpu" else key


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()


def default_device(accelerator: str = "auto", local_rank: int = 0) -> torch.device:
    """The device of the process with this ``local_rank`` for the ``accelerator`` choice."""
    kind = normalize_accelerator(accelerator)
    if kind == "cpu":
        return torch.device("cpu")
    found = current_accelerator()
    if found is None and torch.cuda.is_available():  # a torch without torch.accelerator
        found = torch.device("cuda")
    if found is None and _mps_available():
        found = torch.device("mps")
    if found is not None and kind in ("auto", found.type):
        if found.type == "mps":
            return torch.device("mps")
        count = _device_count(found.type)
        if local_rank >= count:
            raise ConfigurationError(
                f"local rank {local_rank} has no {found.type.upper()} device: {count} visible"
                + (f" (CUDA_VISIBLE_DEVICES={_visible()})" if found.type == "cuda" else "")
                + "; launch at most that many processes per node, or pass accelerator='cpu'"
            )
        return torch.device(found.type, local_rank)
    if kind == "auto":
        return torch.device("cpu")
    raise ConfigurationError(
        f"accelerator={accelerator!r} but this process sees no {kind.upper()} device "
        f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
        f"{_visible()}, torch.accelerator: {found.type if found is not None else None}); pass "
        "accelerator='auto' or 'cpu'"
    )


def _device_count(device_type: str) -> int:
    if device_type == "cuda":
        return torch.cuda.device_count()
    acc = getattr(torch, "accelerator", None)
    return acc.device_count() if acc is not None else 1


def set_current_device(device: torch.device) -> None:
    """Make ``device`` this process's current device (CUDA, or any accelerator torch knows)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return
    acc = getattr(torch, "accelerator", None)
    found = current_accelerator()
    if device.index is not None and found is not None and found.type == device.type and acc is not None:
        setter = getattr(acc, "set_device_index", None) or getattr(acc, "set_device_idx", None)
        if setter is not None:
            setter(device.index)


def check_device_matches(accelerator: str, device: Optional[torch.device]) -> None:
    """An explicit strategy device and an explicit accelerator must agree."""
    kind = normalize_accelerator(accelerator)
    if device is not None and kind != "auto" and torch.device(device).type != kind:
        raise ConfigurationError(
            f"accelerator={accelerator!r} conflicts with the strategy's device={device}; drop one of them"
        )


def _visible() -> str:
    return repr(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
