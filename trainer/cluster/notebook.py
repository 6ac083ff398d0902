"""``notebook_launcher``: run a function on N local processes from a notebook (or any script).

The processes are *forked* (``torch.multiprocessing.start_processes(start_method="fork")``), so
functions and objects defined in a notebook work without being picklable; the price is that CUDA
must not be initialised in the parent before the fork (a forked child cannot use it).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainforge.strategies.environment import find_free_port, port_is_free, temporary_environ
from trainforge.strategies.errors import ConfigurationError, LaunchError

MASTER_ADDR = "127.0.0.1"


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int = 1,
    master_port: Optional[int] = None,
    timeout: Optional[float] = None,
) -> None:
    """Calls ``function(*args)`` on ``num_processes`` forked processes, ranks 0..N-1, and waits.

    Each process gets MASTER_ADDR=127.0.0.1, MASTER_PORT (``master_port``, else a free one), RANK,
    WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, so ``init_process_group(init_method="env://")``
    (or a Trainer/Accelerator) works inside ``function``. Output goes to this process's
    stdout/stderr. Returns None: results must be saved by ``function`` (files, a checkpoint).
    ``num_processes=1`` calls ``function`` here. A failing process stops the others and raises
    ``LaunchError`` naming its rank, with its traceback; so does exceeding ``timeout`` seconds.
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ConfigurationError(f"num_processes={num_processes!r} must be an integer >= 1")
    # a string would be spread into characters, one argument each
    # (tests/trainer/test_nothing_to_train.py, test_notebook_launcher_refuses_args_that_are_not_a_tuple)
    if not isinstance(args, (tuple, list)):
        raise ConfigurationError(
            f"args={args!r} must be a tuple (or list) of the function's arguments, e.g. "
            f"args=({args!r},) to pass it as one argument"
        )
    if num_processes == 1:
        function(*args)
        return
    if torch.cuda.is_initialized():
        raise LaunchError(
            "CUDA was already initialised in this process, so forked processes cannot "
            "use it. Restart the kernel and call notebook_launcher before anything "
            "touches CUDA (model.cuda(), torch.cuda.* calls, Accelerator()/Trainer())"
        )
    if dist.is_available() and dist.is_initialized():
        raise LaunchError(
            "a torch.distributed process group already exists in this process; call "
            "notebook_launcher from a process that is not itself distributed"
        )
    if master_port is not None and not port_is_free(master_port):
        raise LaunchError(
            f"master_port={master_port} is already in use on this machine; pass another "
            "port or master_port=None to pick a free one"
        )
    env = {
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(master_port or find_free_port(MASTER_ADDR)),
        "WORLD_SIZE": str(num_processes),
        "LOCAL_WORLD_SIZE": str(num_processes),
    }
    with temporary_environ(env):
        context = mp.start_processes(
            _run_rank, args=(function, tuple(args)), nprocs=num_processes, join=False, start_method="fork"
        )
        _join(context, num_processes, timeout)
    return


def _run_rank(index: int, function: Callable[..., Any], args: tuple) -> None:
    """Runs in each forked child: rank variables, then the function."""
    os.environ.update({"RANK": str(index), "LOCAL_RANK": str(index)})
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does for several processes per node: one thread each, so N processes do not
        # oversubscribe the CPU; it also keeps the child off the OpenMP pool inherited by fork.
        torch.set_num_threads(1)
    function(*args)


def _join(context: mp.ProcessContext, num_processes: int, timeout: Optional[float]) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not context.join(timeout=0.5):
            if deadline is not None and time.monotonic() > deadline:
                _stop(context)
                raise LaunchError(
                    f"notebook_launcher: the {num_processes} processes did not finish "
                    f"within timeout={timeout} s and were stopped"
                )
    except mp.ProcessRaisedException as error:
        raise LaunchError(
            f"rank {error.error_index} of {num_processes} failed in notebook_launcher "
            f"(the other ranks were stopped):{error.msg}"
        ) from None
    except mp.ProcessExitedException as error:
        how = f"signal {error.signal_name}" if error.signal_name else f"exit code {error.exit_code}"
        raise LaunchError(
            f"rank {error.error_index} of {num_processes} ended with {how} in "
            "notebook_launcher (the other ranks were stopped)"
        ) from None


def _stop(context: mp.ProcessContext) -> None:
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
