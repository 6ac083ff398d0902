"""trainforge's own exception types.

They live in the bottom layer (``strategies/``) so that every package can raise them without
breaking the one-way imports of docs/ARCHITECTURE.md; ``trainer`` re-exports them. Messages say what was
given, what is valid and what to do.
"""

from __future__ import annotations

from typing import Iterable


class TrainforgeError(Exception):
    """Base class of every error trainforge raises on purpose."""


class ConfigurationError(TrainforgeError, ValueError):
    """A setting, argument or combination of them that cannot work."""


class CheckpointError(TrainforgeError):
    """A checkpoint that is missing, incomplete, corrupted or unsafe to load."""


class LaunchError(TrainforgeError):
    """Processes could not be started or one of them failed."""


def invalid_choice(name: str, value: object, choices: Iterable[object], hint: str = "") -> ConfigurationError:
    """``name='value' is not one of: a, b, c`` plus an optional hint on what to do."""
    listed = ", ".join(str(c) for c in choices)
    message = f"{name}={value!r} is not one of: {listed}"
    return ConfigurationError(message + (f". {hint}" if hint else ""))


def check_metric_name(name: object, where: str) -> str:
    """A metric name: a non-empty string (what self.log records and monitors look up)."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(f"{where}={name!r}: a metric name must be a non-empty string, e.g. 'val/loss'")
    return name
