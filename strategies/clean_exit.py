"""Every finished multi-process run exits 0: an orderly end at interpreter exit that users never call.

The cause, found under gdb (``thread apply all bt`` on a worker that aborted): torch stashes a
``contextvars.Context`` in the thread-local state for the length of every backward
(``torch/autograd/graph.py``, ``_engine_run_backward``; present in torch 2.13.0 and 2.14.1). Every gloo
collective started inside a backward (DDP's bucket all-reduce, FSDP's reduce-scatter, DeepSpeed's
gradient reduction, pipeline sends and receives) copies that state into its work object. The gloo worker
thread (``pt_gloo_runloop``) drops the work only after the caller has seen its result, and dropping it
releases the Context, which needs the GIL. When the main thread has meanwhile reached interpreter
finalization, CPython ends the worker with ``pthread_exit``; the unwind crosses a ``noexcept``
destructor and the process dies with "terminate called without an active exception" (SIGABRT, the
launcher reports exit code -6)::

    pt_gloo_runloop: runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState -> SafePyObject decref
                     -> gil_scoped_acquire -> take_gil -> PyThread_exit_thread -> std::terminate

Raw PyTorch does the same, with no trainforge code (3-4 runs of 10 abort on torch 2.13.0 under
``python -m torch.distributed.run --nproc-per-node 2``; with one plain ``dist.all_reduce`` instead of
DDP, none)::

    import torch, torch.distributed as dist, torch.nn as nn
    dist.init_process_group("gloo")
    m = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    for _ in range(5):
        m(torch.randn(8, 4)).sum().backward()
    dist.destroy_process_group()

``destroy_process_group`` does not help: the DDP reducer (and FSDP's, DeepSpeed's state) keeps the
group and its worker threads alive until finalization. The workaround: an ``atexit`` handler, which runs
before finalization while other threads may still take the GIL, gives the GIL away until no gloo worker
thread is runnable (bounded: at most ``_DRAIN_LIMIT_S``), so every such release happens first.
The strategies register it when they start or join a process group (:func:`register`).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable, List

_DRAIN_LIMIT_S = 2.0
_POLL_S = 0.005
_GLOO_WORKER = "pt_gloo_runloop"
_registered = False
_lock = threading.Lock()
_at_exit: List[Callable[[], None]] = []


def _gloo_workers() -> List[str]:
    """The scheduler state ('R' runnable, 'S' sleeping, ...) of each gloo worker thread of this process
    (Linux /proc; elsewhere an empty list)."""
    states = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        if name == _GLOO_WORKER:
            states.append(stat[stat.rindex(")") + 2])
    return states


def drain_gloo_workers(limit_s: float = _DRAIN_LIMIT_S) -> bool:
    """Release the GIL until no gloo worker thread is runnable; True when they all went idle in time.

    A worker waiting for the GIL takes it during the first sleep; one not yet scheduled shows as
    runnable and is waited for. Without /proc (not Linux) one short sleep is all it can do."""
    if not sys.platform.startswith("linux"):
        time.sleep(10 * _POLL_S)
        return True
    if not _gloo_workers():
        return True  # no gloo group in this process (NCCL, one process): nothing to wait for
    deadline = time.monotonic() + limit_s
    time.sleep(_POLL_S)
    while "R" in _gloo_workers():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _exit_handler() -> None:
    for stop in reversed(_at_exit):
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - at exit, one failing teardown must not skip the drain
            print(f"trainforge: process-group teardown at exit failed: {exc!r}", file=sys.stderr)
    drain_gloo_workers()


def register(stop: Callable[[], None] | None = None) -> None:
    """Make this process end cleanly: ``stop`` (e.g. destroying a process group this process started)
    runs at exit, then the gloo workers are drained. Idempotent; safe from any strategy."""
    global _registered
    with _lock:
        if stop is not None:
            _at_exit.append(stop)
        if not _registered:
            atexit.register(_exit_handler)
            _registered = True
