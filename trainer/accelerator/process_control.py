"""The processes of a run, seen through its strategy: who is the main process, running a block on it
first, functions for one process, objects gathered, inputs split between processes.

The Accelerator builds one on its strategy and its ``main_process_first``, ``on_main_process``, ...
call it; Accelerate's ``PartialState`` (``trainer/compat/accelerate/state.py``) is one built on a
strategy of its own. Everything goes through the strategy's collectives, so it behaves the same on
one process (a no-op) and on many."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy


class ProcessControl:
    """The processes of ``strategy`` (its environment set up): topology, ordering and per-process calls."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    @property
    def device(self) -> torch.device:
        return self.strategy.root_device

    @property
    def process_index(self) -> int:
        return self.strategy.global_rank

    @property
    def local_process_index(self) -> int:
        return self.strategy.local_rank

    @property
    def num_processes(self) -> int:
        return self.strategy.world_size

    @property
    def is_main_process(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def is_local_main_process(self) -> bool:
        return self.strategy.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.strategy.global_rank == self.strategy.world_size - 1

    def wait_for_everyone(self) -> None:
        self.strategy.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. to build a cache), then the others."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """The main process of each node runs the block first, then the node's others."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the function runs on the main process only (elsewhere it returns None)."""
        return self.on_process(function, process_index=0)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the function runs on each node's main process only (elsewhere it returns None)."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_local_main_process else None

        return wrapper

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the function runs on the last process only (elsewhere it returns None)."""
        return self.on_process(function, process_index=self.num_processes - 1)

    def on_process(self, function: Optional[Callable[..., Any]] = None, process_index: int = 0) -> Any:
        """Decorator: the function runs on process ``process_index`` only (``@acc.on_process(process_index=1)``)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.process_index == process_index else None

        return wrapper

    def gather_object(self, obj: Any) -> List[Any]:
        """Picklable objects from every process: lists are concatenated in rank order, other objects
        become a list with one item per process (Accelerate's ``gather_object``)."""
        parts = self.strategy.all_gather_object(obj)
        if isinstance(obj, (list, tuple)):
            return [item for part in parts for item in part]
        return list(parts)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's share of ``inputs`` (a list, tuple, dict of lists, or tensor), as Accelerate."""
        from trainforge.strategies.data.loader import split_between_processes

        yield split_between_processes(inputs, self.process_index, self.num_processes, apply_padding=apply_padding)
