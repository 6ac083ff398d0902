"""Lightning's rank-zero helpers (``lightning.pytorch.utilities.rank_zero``, ``lightning_utilities``):
``rank_zero_only`` runs a function on global rank 0 only, ``rank_zero_info``/``_debug``/``_warn``/
``_deprecation`` log or warn there only.

``rank_zero_only.rank`` is the process's global rank, read when asked: a value assigned to it (Lightning's
Trainer assigns it; a program may too) wins; else the rank of the initialized process group; else the rank
trainforge's launch environment gives (``torchrun``, SLURM, MPI, Kubeflow: trainforge.strategies.environment),
else Lightning's environment variables (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK``),
else 0. So a decorated function called before the Trainer starts (at import, in ``__init__``) already knows
its rank under ``trainforge launch``, as Lightning's does under torchrun.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any, Callable, Optional, TypeVar, Union

import torch.distributed as dist

from trainforge.strategies.environment import detect_environment
from trainforge.strategies.errors import ConfigurationError

T = TypeVar("T")
log = logging.getLogger("trainforge")
_RANK_KEYS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")  # Lightning's order
_LAUNCH_KEYS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # one of them in any launch


def _environment_rank() -> int:
    if not any(key in os.environ for key in _LAUNCH_KEYS + _RANK_KEYS):
        return 0  # a plain process (detect_environment would also look for a free port: not needed here)
    try:
        env = detect_environment()
        if env.world_size > 1:
            return env.rank
    except (ConfigurationError, ValueError):  # a malformed launch environment is refused by the Trainer, not here
        pass
    for key in _RANK_KEYS:
        value = os.environ.get(key)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return 0


class _RankZeroOnly:
    """The ``rank_zero_only`` decorator: ``@rank_zero_only`` or ``rank_zero_only(fn, default)``; on another
    rank the call returns ``default`` (None unless given). Its ``rank`` attribute: see the module docstring."""

    def __init__(self) -> None:
        self._rank: Optional[int] = None

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return _environment_rank()

    @rank.setter
    def rank(self, value: Optional[int]) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigurationError(
                f"rank_zero_only.rank={value!r} must be a global rank (an int >= 0), or None to read it from the "
                "process group and the launch environment"
            )
        self._rank = value

    def __call__(self, fn: Callable[..., T], default: Optional[T] = None) -> Callable[..., Optional[T]]:
        if not callable(fn):
            raise ConfigurationError(
                f"rank_zero_only({fn!r}): decorate a function (@rank_zero_only) or pass one: rank_zero_only(fn)"
            )

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Optional[T]:
            return fn(*args, **kwargs) if self.rank == 0 else default

        return wrapped


rank_zero_only = _RankZeroOnly()


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.debug`` on the ``trainforge`` logger, on global rank 0 only."""
    log.debug(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.info`` on the ``trainforge`` logger, on global rank 0 only."""
    log.info(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_warn(message: Union[str, Warning], stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn`` on global rank 0 only (``category`` as ``warnings.warn``, UserWarning by default)."""
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


def rank_zero_deprecation(message: Union[str, Warning], stacklevel: int = 5, **kwargs: Any) -> None:
    """A ``DeprecationWarning`` (or ``category``) on global rank 0 only."""
    category = kwargs.pop("category", DeprecationWarning)
    rank_zero_warn(message, stacklevel=stacklevel, category=category, **kwargs)


def rank_prefixed_message(message: str, rank: Optional[int]) -> str:
    """``"[rank: 1] message"``, or ``message`` when ``rank`` is None (Lightning's)."""
    return message if rank is None else f"[rank: {rank}] {message}"
