"""Profiling: ``Trainer(profiler=...)`` (which ``HookProfiler`` callback to install, and the wrapping of
every hook at the Trainer's one dispatch point) and ``Accelerator.profile()`` with Accelerate's
``ProfileKwargs``. The profilers themselves are callbacks (``callbacks/profiler.py``)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.profiler import ProfilerActivity

from trainforge.callbacks.base import Callback
from trainforge.callbacks.profiler import HookProfiler, PyTorchProfiler, SimpleProfiler, profiler_schedule
from trainforge.strategies.errors import ConfigurationError

PROFILER_CHOICES = (None, "simple", "pytorch")
_ACTIVITIES = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}


def resolve_profiler(profiler: Any) -> Optional[HookProfiler]:
    """``Trainer(profiler=)``: None, "simple" (``SimpleProfiler``), "pytorch" (``PyTorchProfiler``) or an
    instance of either."""
    if profiler is None or isinstance(profiler, HookProfiler):
        return profiler
    if profiler == "simple":
        return SimpleProfiler()
    if profiler == "pytorch":
        return PyTorchProfiler()
    if profiler == "advanced":
        raise ConfigurationError(
            "Trainer(profiler='advanced') (Lightning's cProfile profiler) is not in trainforge: use "
            "profiler='simple' (each hook's time per step), profiler=PyTorchProfiler(with_stack=True) "
            "(Python stacks in the trace), or run cProfile around trainer.fit yourself"
        )
    raise ConfigurationError(
        f"Trainer(profiler={profiler!r}) is not one of: None, 'simple', 'pytorch', or a PyTorchProfiler/"
        "SimpleProfiler instance (from trainforge.callbacks); e.g. profiler='simple' for a per-hook time table"
    )


def with_profiler(profiler: Any, callbacks: List[Callback]) -> List[Callback]:
    """The callbacks with the resolved profiler first (its loop ranges then enclose the other hooks)."""
    resolved = resolve_profiler(profiler)
    if resolved is None or any(cb is resolved for cb in callbacks):
        return callbacks
    return [resolved, *callbacks]


def instrument(
    targets: Sequence[Tuple[str, Callable[..., None]]], callbacks: Sequence[Callback]
) -> List[Callable[..., None]]:
    """One event's hooks, named ``<Class>.<hook>``, wrapped by every profiler among ``callbacks`` (not the
    profilers' own hooks). No profiler: the hooks unchanged, so dispatch costs nothing more."""
    profilers = [cb for cb in callbacks if isinstance(cb, HookProfiler)]
    if not profilers:
        return [hook for _, hook in targets]
    hooks = []
    for name, hook in targets:
        if not name.startswith(tuple(f"{type(p).__name__}." for p in profilers)):
            for profiler in profilers:
                hook = profiler.wrap(name, hook)
        hooks.append(hook)
    return hooks


def reset_profilers(callbacks: Sequence[Callback]) -> None:
    for cb in callbacks:
        if isinstance(cb, HookProfiler):
            cb.reset()


@dataclass
class ProfileKwargs:
    """Accelerate's ``ProfileKwargs`` for ``Accelerator.profile()`` (also in ``kwargs_handlers``).
    ``schedule_option``: dict of wait/warmup/active/repeat/skip_first (then call ``prof.step()`` per step);
    ``output_trace_dir``: a Chrome trace ``profile_<process_index>.json`` is written there at the end."""

    activities: Optional[List[Any]] = None  # "cpu", "cuda" or torch.profiler.ProfilerActivity
    schedule_option: Optional[Dict[str, int]] = None
    on_trace_ready: Optional[Callable[..., Any]] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.schedule_option is not None:
            if not isinstance(self.schedule_option, dict):
                raise ConfigurationError(
                    f"ProfileKwargs(schedule_option={self.schedule_option!r}) must be a dict, "
                    "e.g. dict(wait=1, warmup=1, active=2)"
                )
            profiler_schedule("ProfileKwargs(schedule_option)", **self.schedule_option)
        for activity in self.activities or []:
            if not isinstance(activity, ProfilerActivity) and activity not in _ACTIVITIES:
                raise ConfigurationError(
                    f"ProfileKwargs(activities=[{activity!r}]): each is one of 'cpu', 'cuda' or a "
                    "torch.profiler.ProfilerActivity"
                )
        if self.on_trace_ready is not None and not callable(self.on_trace_ready):
            raise ConfigurationError(f"ProfileKwargs(on_trace_ready={self.on_trace_ready!r}) must be callable")

    def build(self) -> torch.profiler.profile:
        activities = [a if isinstance(a, ProfilerActivity) else _ACTIVITIES[a] for a in self.activities or []]
        if not activities:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        return torch.profiler.profile(
            activities=activities,
            schedule=profiler_schedule("ProfileKwargs(schedule_option)", **(self.schedule_option or {})),
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


class Profiling:
    """``Accelerator.profile()`` (Accelerate's context manager), a part the Accelerator builds with its
    process's index (the trace's file name) and its barrier (every process's trace is written on exit)."""

    def __init__(self, process_index: int, wait_for_everyone: Callable[[], None]) -> None:
        self.process_index, self.wait_for_everyone = process_index, wait_for_everyone

    @contextlib.contextmanager
    def profile(
        self, profile_handler: Optional[ProfileKwargs], default: Optional[ProfileKwargs]
    ) -> Iterator[torch.profiler.profile]:
        """Profile the block; yields the ``torch.profiler.profile``. The handler is ``profile_handler``, else
        ``default`` (the ``ProfileKwargs`` in ``kwargs_handlers``), else the defaults (CPU, and CUDA when present)."""
        if profile_handler is not None and not isinstance(profile_handler, ProfileKwargs):
            raise ConfigurationError(
                f"Accelerator.profile(profile_handler={profile_handler!r}) must be a "
                "trainforge.utils.ProfileKwargs(...) or None"
            )
        handler = profile_handler or default or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json"))
        self.wait_for_everyone()
