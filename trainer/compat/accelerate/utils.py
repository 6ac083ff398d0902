"""HF Accelerate's helper functions under Accelerate's names (exported by ``trainforge.utils``):
``set_seed``, ``get_logger`` (``accelerate.logging``), ``find_executable_batch_size``,
``skip_first_batches`` and ``LocalSGD`` (``accelerate.local_sgd``)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, MutableMapping, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.oom_agreement import FAILED, OK, OOM, agree_on_outcome
from trainforge.trainer.accelerator.seed import seed_everything
from trainforge.trainer.accelerator.wrappers import PreparedDataLoader
from trainforge.trainer.compat.accelerate.accelerator_args import release_memory
from trainforge.trainer.compat.accelerate.state import DistributedType

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.accelerator.accelerator import Accelerator


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (every device), as Accelerate's ``set_seed``: ``device_specific=True``
    adds the process index (``RANK``), ``deterministic=True`` turns on
    ``torch.use_deterministic_algorithms``. trainforge's own name: ``seed_everything``."""
    seed_everything(seed, rank_offset=device_specific)
    if deterministic:
        torch.use_deterministic_algorithms(True)


# ---- logging -----------------------------------------------------------------------------------
def _process() -> Tuple[int, int]:
    """(process index, number of processes), from the process group or the launcher's environment."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class MultiProcessAdapter(logging.LoggerAdapter):
    """Accelerate's logger adapter: a record is logged on the main process only, unless the call passes
    ``main_process_only=False`` (every process logs it); with that, ``in_order=True`` logs it process by
    process (a collective: every process must make the call)."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        rank, world = _process()
        if main_process_only and rank != 0:
            return
        if in_order and not main_process_only and world > 1:
            for i in range(world):
                if i == rank:
                    self.logger.log(level, msg, *args, **kwargs)
                torch.distributed.barrier()
            return
        self.logger.log(level, msg, *args, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    # as Accelerate: each distinct message once per adapter
    @functools.lru_cache(None)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: Optional[str] = None) -> MultiProcessAdapter:
    """``logging.getLogger(name)`` in Accelerate's adapter (``logger.info(msg, main_process_only=False)``).
    ``log_level`` (e.g. ``"INFO"``) sets the logger's and the root logger's level, as Accelerate."""
    logger = logging.getLogger(name)
    if log_level is not None:
        level = str(log_level).upper()
        if not isinstance(logging.getLevelName(level), int):  # a known level's name maps to its number
            raise ConfigurationError(
                f"get_logger(log_level={log_level!r}) is not a logging level: DEBUG, INFO, WARNING, ERROR, CRITICAL"
            )
        logger.setLevel(level)
        logging.getLogger().setLevel(level)
    return MultiProcessAdapter(logger, {})


# ---- find_executable_batch_size ----------------------------------------------------------------
# Accelerate 1.15's list (accelerate/utils/memory.py), in a RuntimeError with one argument
_OOM_MESSAGES = (
    " out of memory.",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN's answer to batches too big for its kernels
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error, as Accelerate tells: a RuntimeError with one argument
    holding one of Accelerate's messages (CUDA/XPU, MPS, cuDNN, CPU allocator, HPU), or any
    ``torch.OutOfMemoryError``."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    return (
        isinstance(exception, RuntimeError)
        and len(exception.args) == 1
        and any(m in str(exception.args[0]) for m in _OOM_MESSAGES)
    )


def find_executable_batch_size(
    function: Optional[Callable[..., Any]] = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Optional[Callable[..., int]] = None,
) -> Any:
    """Decorator (Accelerate's): call ``function(batch_size, *args)`` from ``starting_batch_size``; on an
    out-of-memory error (``should_reduce_batch_size``) free memory and retry with ``int(batch_size * 0.9)``, as
    Accelerate 1.15 (128, 115, 103, ...), or ``reduce_batch_size_fn``'s size (Accelerate's takes no argument and
    returns the new size; one taking the failed size is called with it), until it runs; a batch size of 0 is a
    RuntimeError. Call the decorated function without batch_size.
    Under several processes every process calls it: after each attempt they agree (an out-of-memory error
    on any rank lowers the size on every rank; another error on one rank stops all of them), so no rank
    returns into the collectives that follow while another retries; before any process group exists they agree
    through the launcher's store (``trainforge launch``), and without one several processes are refused;
    a ``reduce_batch_size_fn`` that does not return a smaller size is refused. A collective inside ``function`` (a DDP
    backward) can hang: a rank out of memory before it never enters it. Search with local work (the model
    unwrapped, or ``Tuner.scale_batch_size``), then train with the size found."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int) or starting_batch_size < 1:
        raise ConfigurationError(
            f"find_executable_batch_size(starting_batch_size={starting_batch_size!r}) must be an int >= 1"
        )
    reduce = _reducer(reduce_batch_size_fn)
    batch_size = starting_batch_size

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        release_memory()
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:  # batch_size given by the caller as well
            given = ", ".join(f"{p}={a!r}" for p, a in zip(params[1:], args[1:]))
            raise ConfigurationError(
                f"{function.__name__}() got batch_size as its first argument; find_executable_batch_size passes it. "
                f"Call {function.__name__}({given})"
            )
        while True:
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            # Every process reaches the agreement after each attempt, whatever the attempt did: an
            # out-of-memory error on any rank lowers the size on all of them (trainer/accelerator/oom_agreement.py).
            error: Optional[BaseException] = None
            result: Any = None
            try:
                result = function(batch_size, *args, **kwargs)
                outcome = OK
            except Exception as err:
                outcome = OOM if should_reduce_batch_size(err) else FAILED
                error = err if outcome == FAILED else None
                del err  # its traceback holds the attempt's tensors: free them before retrying
            agreed = agree_on_outcome(outcome)
            if error is not None:
                raise error
            if agreed == FAILED:
                raise RuntimeError(
                    f"find_executable_batch_size: another process raised an error at batch size {batch_size} "
                    "(see its traceback); this process stops too"
                )
            if agreed == OK:
                return result
            release_memory()
            batch_size = _reduced(reduce, batch_size, function)

    return decorator


def _reducer(reduce_batch_size_fn: Optional[Callable[..., int]]) -> Callable[[int], int]:
    """``reduce_batch_size_fn`` as a function of the failed size: Accelerate's default ``int(size * 0.9)``;
    Accelerate's form, without arguments, called as it is; one taking the size called with it."""
    if reduce_batch_size_fn is None:
        return lambda size: int(size * 0.9)
    if not callable(reduce_batch_size_fn):
        raise ConfigurationError(
            f"find_executable_batch_size(reduce_batch_size_fn={reduce_batch_size_fn!r}) must be a function "
            "returning the next batch size (no argument, as Accelerate's, or the size that ran out of memory)"
        )
    try:
        takes_size = bool(inspect.signature(reduce_batch_size_fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: give it the size
        takes_size = True
    if takes_size:
        return reduce_batch_size_fn

    @functools.wraps(reduce_batch_size_fn)
    def without_size(size: int) -> int:
        return reduce_batch_size_fn()

    return without_size


def _reduced(reduce: Callable[[int], int], batch_size: int, function: Callable[..., Any]) -> int:
    """``reduce(batch_size)``, which must be a smaller int: a size that does not go down would be retried forever."""
    smaller = reduce(batch_size)
    if isinstance(smaller, bool) or not isinstance(smaller, int) or smaller >= batch_size:
        name = getattr(reduce, "__name__", repr(reduce))
        raise ConfigurationError(
            f"find_executable_batch_size({function.__name__}): reduce_batch_size_fn {name} turned batch size "
            f"{batch_size}, which ran out of memory, into {smaller!r}; it must return a smaller int, or the same "
            "size is retried forever. Return a smaller size (e.g. lambda b: b // 2), or raise when there is none"
        )
    return smaller


# ---- skip_first_batches ------------------------------------------------------------------------
class _SkipBatches(Sampler):
    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


class _SkipIterable(DataLoader):
    """A loader of an IterableDataset whose next pass skips its first ``skip`` batches (read, not yielded)."""

    skip = 0

    def __iter__(self) -> Any:
        for index, batch in enumerate(super().__iter__()):
            if index >= self.skip:
                yield batch


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader whose pass starts ``num_batches`` into the epoch (Accelerate's): for a prepared loader
    ``Accelerator.skip_first_batches`` (no batch loaded; after ``load_state`` a no-op, see there); for a
    plain DataLoader a new DataLoader that skips them (map-style: without loading them)."""
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader.skip_first_batches(num_batches)
    if not isinstance(dataloader, DataLoader):
        raise ConfigurationError(
            f"skip_first_batches({type(dataloader).__name__}): expected a torch DataLoader or a prepared one"
        )
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ConfigurationError(f"skip_first_batches(num_batches={num_batches!r}) must be an int >= 0")
    from trainforge.strategies.data.loader import loader_kwargs

    kwargs = loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        loader = _SkipIterable(
            dataloader.dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, **kwargs
        )
        loader.skip = num_batches
        return loader
    return DataLoader(dataloader.dataset, batch_sampler=_SkipBatches(dataloader.batch_sampler, num_batches), **kwargs)


# ---- LocalSGD ----------------------------------------------------------------------------------
class LocalSGD:
    """Accelerate's ``LocalSGD``: inside ``with LocalSGD(accelerator, model, local_sgd_steps) as local:``
    gradients are not all-reduced; each process steps its own optimizer, and every ``local_sgd_steps``
    calls of ``local.step()`` (and on leaving the block) the parameters are averaged over the processes.
    ``enabled=False``: plain data-parallel training. One process, DDP or several CPU processes only."""

    def __init__(self, accelerator: Accelerator, model: nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        if accelerator.distributed_type not in (
            DistributedType.NO,
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
        ):
            raise ConfigurationError(
                f"LocalSGD with distributed type {accelerator.distributed_type}: it averages whole parameters "
                "between data-parallel processes, so it works with one process or DDP only"
            )
        if enabled and (
            isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1
        ):
            raise ConfigurationError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}) must be an int >= 1")
        self.accelerator, self.model, self.local_sgd_steps = accelerator, model, local_sgd_steps
        self.enabled = enabled and accelerator.distributed_type != DistributedType.NO
        self.num_steps = 0
        self._no_sync: Any = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._sync_and_average()
            self._no_sync.__exit__(*exc)

    def step(self) -> None:
        """Count one optimizer step; average the parameters every ``local_sgd_steps``."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_average()

    def _sync_and_average(self) -> None:
        self.accelerator.wait_for_everyone()
        with torch.no_grad():
            for param in self.model.parameters():
                param.data = self.accelerator.reduce(param.data, reduction="mean")
