"""What Accelerate users call to control processes, on the ``Accelerator`` (a mixin): run on the
main process first, functions for one process, objects gathered, gradient sync skipped.

All of it goes through the strategy's collectives, so it behaves the same on one process (a no-op)
and on many."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy
    from trainforge.trainer.cluster.stop_signals import StopSignals


class ProcessControl:
    """Mixed into ``Accelerator`` (uses ``strategy``, ``process_index``, ``num_processes``...)."""

    if TYPE_CHECKING:  # the Accelerator's, for the type checker
        strategy: Strategy
        stop_signals: StopSignals
        process_index: int
        num_processes: int
        is_main_process: bool
        is_local_main_process: bool

        def wait_for_everyone(self) -> None: ...

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. to build a cache), then the others."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
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
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_local_main_process else None

        return wrapper

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
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

    def no_sync(self, model: nn.Module) -> Any:
        """Skip the gradient all-reduce in the backward passes inside (accumulate by hand)."""
        return self.strategy.no_backward_sync(model, enabled=True)

    def trigger_sync_in_backward(self, model: nn.Module) -> Any:
        """The forward and backward inside all-reduce gradients even within ``no_sync`` (the
        gradients accumulated locally so far are synced with them)."""
        return self.strategy.force_backward_sync(model)

    @property
    def stop_requested(self) -> Optional[str]:
        """With ``Accelerator(stop_signals=("SIGTERM", "SIGUSR1"))``: the signal's name once every process
        is to stop here, else None. Read it once per optimizer step, on every process at the same point
        (after ``optimizer.step()``): each read exchanges this process's flag with the others, one read
        late, never waited for. Then save and exit with ``stop_exit_code``::

            if accelerator.stop_requested:
                accelerator.save_state(ckpt_dir)       # committed when it returns
                sys.exit(accelerator.stop_exit_code)   # 128 + the signal number (143 for SIGTERM)

        ``load_state(ckpt_dir)`` then continues the run exactly (``trainer/cluster/stop_signals.py``)."""
        return self.stop_signals.poll(self.strategy)

    @property
    def stop_exit_code(self) -> Optional[int]:
        """128 + the number of the signal ``stop_requested`` named; None before."""
        return self.stop_signals.exit_code
