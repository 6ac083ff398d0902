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

Forking (DataLoader workers, ``num_workers > 0``) needs the same care. A CI run hung with rank 1 waiting
forever in ``StatefulDataLoader._reset`` for a worker that never ran its target; gdb on that worker::

    #6  PyThread_acquire_lock_timed
    #8  _PyThreadState_DeleteExcept (Python/pystate.c:1163)    <- HEAD_LOCK(runtime)
    #9  _PyEval_ReInitThreads (Python/ceval.c:488)
    #10 PyOS_AfterFork_Child (Modules/posixmodule.c:607)

The same gloo worker release is the culprit. It runs through pybind11's ``gil_scoped_acquire``, whose
``PyThreadState_New`` (the worker has no thread state) takes CPython's runtime ``HEAD_LOCK`` *before*
the GIL (gdb: ``runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState -> SafePyObject decref ->
gil_scoped_acquire -> PyThreadState_New``). So the worker can hold ``HEAD_LOCK`` while the main thread,
holding the GIL, forks; CPython 3.11.7's child then takes ``HEAD_LOCK`` before it re-initialises it
and waits forever (CPython gh-112275: fixed in 3.12, backported to 3.11 after 3.11.7). Raw PyTorch does
it, no trainforge code: ``scripts/fork_stress.py --seconds 25 --load 2`` (2 gloo ranks, DDP,
``os.fork()`` after every backward, 2 busy processes on the 2-core machine), 18 launches, had 1 child
of 32,396 stuck with exactly that backtrace; right after a backward a gloo worker was still runnable
before ~40% of the forks. A before-fork hook (:func:`_before_fork`, installed by :func:`register`)
waits, at most ``_FORK_DRAIN_LIMIT_S``, until no gloo worker is runnable: ``HEAD_LOCK`` is held only
for a list update inside ``PyThreadState_New``, by a running (or preempted, still runnable) thread; a
worker asleep on its queue or waiting for the GIL holds none, so the usual fork (workers idle) costs
one ``/proc`` read per gloo worker thread and no sleep, and a process with no gloo worker reads little
more than its thread list; a process that never registered has no hook. Measured on the loaded 2-core
machine: ~0.15 ms with 2 idle gloo workers, ~0.03 ms with none, and one or a few 5 ms sleeps when a
worker is still finishing (fork + exit + wait of such a process: 17-32 ms there). With the hook
(``--mode trainforge``), 18 launches, 22,642 forks: none stuck. The natural hang is too rare for
that count to prove the fix (1 in ~32,000 forks); tests/test_fork_safety.py checks the hook instead.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable, Dict, List, Union

_DRAIN_LIMIT_S = 2.0
_FORK_DRAIN_LIMIT_S = 0.25  # a worker busy for longer (a long collective of another thread) is not in HEAD_LOCK
_POLL_S = 0.005
_GLOO_WORKER = "pt_gloo_runloop"
_registered = False
_fork_hook = False
_lock = threading.Lock()
_at_exit: List[Callable[[], None]] = []
# thread id -> is it a gloo worker (see _gloo_worker_states; thread ids are not reused soon)
_known_threads: Dict[str, Union[bool, float]] = {}
_UNNAMED_S = 1.0


def _gloo_workers() -> List[str]:
    """The scheduler state ('R' runnable, 'S' sleeping, ...) of each gloo worker thread of this process
    (Linux /proc; elsewhere an empty list)."""
    states: List[str] = []
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
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name == _GLOO_WORKER:
            states.append(stat[stat.rindex(")") + 2])
    return states


def _gloo_worker_states() -> List[str]:
    """What :func:`_gloo_workers` says, cheaper, for the before-fork hook (it runs on every fork): the
    thread list, then the stat of the gloo workers only. A thread's name is read once, except while it
    still has the process's name: a new thread has it until it names itself (gloo workers do at once),
    so it is read again until it is ``_UNNAMED_S`` old (many threads keep it: Python's, OpenMP's)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    alive = set(tids)
    for tid in [t for t in list(_known_threads) if t not in alive]:
        _known_threads.pop(tid, None)
    _known_threads.setdefault(str(os.getpid()), False)  # the main thread is no gloo worker
    states, process_name = [], None
    for tid in tids:
        gloo = _known_threads.get(tid)
        if gloo is False:
            continue
        try:
            if gloo is not True:  # None: never seen; a float: when first seen with the process's name
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().rstrip("\n")
                if name != _GLOO_WORKER:
                    if process_name is None:
                        with open("/proc/self/comm") as f:
                            process_name = f.read().rstrip("\n")
                    now = time.monotonic()
                    if name != process_name or (gloo is not None and now - gloo > _UNNAMED_S):
                        _known_threads[tid] = False
                    elif gloo is None:
                        _known_threads[tid] = now
                    continue
                _known_threads[tid] = True
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        states.append(stat[stat.rindex(")") + 2])
    return states


def _before_fork() -> None:
    """``os.register_at_fork(before=...)``: no fork while a gloo worker may hold CPython's HEAD_LOCK.

    Returns at once when no gloo worker is runnable (the usual case: they sleep on their queues);
    else gives the GIL away, ``_POLL_S`` at a time, until none is or ``_FORK_DRAIN_LIMIT_S`` passed."""
    try:
        if not any(state in "RD" for state in _gloo_worker_states()):
            return
        deadline = time.monotonic() + _FORK_DRAIN_LIMIT_S
        while time.monotonic() < deadline:
            time.sleep(_POLL_S)
            if not any(state in "RD" for state in _gloo_worker_states()):
                return
    except Exception:
        # never make a fork fail
        pass


def _after_fork_in_child() -> None:
    _known_threads.clear()  # the child has one thread


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
        except Exception as exc:
            # at exit, one failing teardown must not skip the drain
            print(f"trainforge: process-group teardown at exit failed: {exc!r}", file=sys.stderr)
    drain_gloo_workers()


def _install_fork_hook() -> None:
    """Install the before-fork drain once per process (a forked child inherits it: not again there)."""
    global _fork_hook
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_hook = True


def register(stop: Callable[[], None] | None = None) -> None:
    """Make this process end cleanly: ``stop`` (e.g. destroying a process group this process started)
    runs at exit, then the gloo workers are drained; and make every later fork wait until no gloo
    worker is runnable (:func:`_before_fork`). Idempotent; safe from any strategy."""
    global _registered
    with _lock:
        if stop is not None:
            _at_exit.append(stop)
        if not _registered:
            atexit.register(_exit_handler)
            _registered = True
        _install_fork_hook()
