"""Multi-process test runs without paying the interpreter start-up per rank.

Most multi-process tests launch a training script on 2 ranks. Through torchrun each run costs an
agent process and, per rank, a fresh interpreter that imports torch, torch._dynamo (imported by
DistributedDataParallel), torchdata and trainforge: about 5 CPU-seconds per rank before the first
step on this 2-core machine, most of the suite's time. Here the ranks are forked from
multiprocessing's *forkserver*, a process started once per pytest worker that has imported those
modules already (``multiprocessing.set_forkserver_preload``), so a rank starts in milliseconds.

What a rank gets is what torchrun gives a worker: the environment variables of torch elastic
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT,
TORCHELASTIC_RUN_ID, ...; rank 0 hosts the rendezvous store as without an agent store), the
script run as ``__main__`` with its argv, its folder first on sys.path, the requested cwd, and an
interpreter exit as Python's (non-daemon threads joined, then atexit handlers), its exit status
the script's. A rank that fails stops the others, as torchrun's agent does.

What it does not give: a fresh interpreter (modules the forkserver preloaded are not re-imported,
so import-time behaviour and ``sys.modules`` shadowing are not exercised) and torchrun's own
failure summary or signal forwarding. Tests of those (the launcher, clean interpreter exit,
preemption, namespace shadowing) keep launching real ``torchrun`` / ``trainforge launch``
processes through ``procs.torchrun``/``procs.trainforge_launch``.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from tests.helpers import procs
from trainforge.strategies.environment import temporary_environ

# Imported once in the forkserver. Only third-party modules: their import-time reads of the
# environment (thread counts) are the same for every test. trainforge itself is imported by each
# rank, so an edited source file is always what runs.
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "torch._dynamo",
    "torchdata.stateful_dataloader",
    "safetensors.torch",
    "tqdm",
    "yaml",
    "psutil",
]
STOP_GRACE_S = 10.0  # how long the other ranks get to exit after one failed, as torchrun's agent waits

_context: Optional[Any] = None


def _forkserver() -> Any:
    """multiprocessing's forkserver context, started with one OpenMP/BLAS thread: a process is
    forked only while it has a single thread, and torch reads the thread count when it loads."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        one_thread = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with temporary_environ(one_thread):
            from multiprocessing import forkserver

            forkserver.ensure_running()
        _context = ctx
    return _context


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(
    base: Dict[str, str], rank: int, nproc: int, port: int, run_id: str, restart: int = 0, max_restarts: int = 0
) -> Dict[str, str]:
    env = dict(base)
    if nproc == 0:  # run_script: a plain `python script.py`, no launcher variables
        return env
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT=str(restart),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
    )
    return env


def _rank_main(script: str, argv: Sequence[str], env: Dict[str, str], cwd: str, log: str) -> None:
    """Runs in the forked rank: becomes ``python script argv...`` as far as the script can tell."""
    os.setsid()  # its own process group: the test kills the rank with its DataLoader workers
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [str(Path(script).resolve().parent), *extra]
    sys.argv = [script, *argv]
    if env.get("PYTHONWARNINGS"):  # read by the interpreter at start-up, which this process skipped
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # multiprocessing made "forkserver" this process's default start method (a child inherits the
    # method that started it). A torchrun worker has the interpreter's default: DataLoader workers
    # and other children must start as they would there (fork on Linux before Python 3.14), not
    # through the forkserver, which re-imports the script's __main__ in each of them (~1.3 s each).
    multiprocessing.set_start_method(None, force=True)
    code: Any = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    # Python's own exit order: wait for non-daemon threads, then the atexit handlers.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


def launch(
    script: Path | str,
    *args: Any,
    nproc: int = 2,
    timeout: float,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[Path] = None,
    check: bool = True,
    max_restarts: int = 0,
) -> subprocess.CompletedProcess:
    """Runs ``script args...`` on ``nproc`` ranks as torchrun would; output of all ranks merged,
    return code 0 when every rank exited 0, else the first failing rank's code. ``check``:
    AssertionError with the output tail unless it is 0. ``nproc=0``: one process without the
    launcher's variables, as ``python script args...`` (what ``run_script`` does).
    ``max_restarts``: as torchrun's ``--max-restarts``: after a rank fails (the others stopped),
    every rank starts again, up to that many times, with TORCHELASTIC_RESTART_COUNT counting the
    restarts (a new rendezvous: a new port). The real agent's restarts are tested once
    (tests/trainer/test_resume.py); tests of what a restarted run does use this."""
    ctx = _forkserver()
    base = env or procs.test_env()
    argv = [str(a) for a in args]
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="forklaunch-") as tmp:
        log = os.path.join(tmp, "output.txt")
        for restart in range(max_restarts + 1):
            port = _free_port()
            run_id = f"forklaunch-{os.getpid()}-{port}"
            envs = [_rank_env(base, r, nproc, port, run_id, restart, max_restarts) for r in range(max(nproc, 1))]
            ranks = [
                ctx.Process(
                    target=_rank_main, args=(str(script), argv, e, str(cwd or procs.REPO), log), name=f"rank{r}"
                )
                for r, e in enumerate(envs)
            ]
            for rank in ranks:
                rank.start()
            code, timed_out = _wait(ranks, deadline)
            if code == 0 or timed_out:
                break
            if restart < max_restarts:
                with open(log, "a") as out:
                    out.write(
                        f"forklaunch: a rank exited with {code}; restarting every rank ({restart + 1}/{max_restarts})\n"
                    )
        output = Path(log).read_text(errors="replace") if os.path.exists(log) else ""
    command = f"forklaunch({script}, {' '.join(argv)}, nproc={nproc})"
    if timed_out:
        raise AssertionError(f"{command} timed out after {timeout}s:\n{output[-6000:]}")
    if check and code != 0:
        raise AssertionError(f"{command} exited with {code}:\n{output[-6000:]}")
    return subprocess.CompletedProcess(command, code, output, "")


def _wait(ranks: list, deadline: float) -> tuple:
    """Waits for every rank; the first failure stops the rest (SIGTERM, then SIGKILL after
    STOP_GRACE_S). Returns (first non-zero code or 0, whether the deadline passed)."""
    first_failure = 0
    stop_at: Optional[float] = None
    try:
        while any(r.exitcode is None for r in ranks):
            now = time.monotonic()
            if now >= deadline:
                return first_failure, True
            if stop_at is not None and now >= stop_at:
                _signal_all(ranks, signal.SIGKILL)
                stop_at = None
            alive = [r.sentinel for r in ranks if r.exitcode is None]
            multiprocessing.connection.wait(alive, timeout=min(1.0, deadline - now))
            for rank in ranks:
                if rank.exitcode not in (None, 0) and first_failure == 0:
                    first_failure = rank.exitcode if rank.exitcode > 0 else 128 - rank.exitcode
                    _signal_all(ranks, signal.SIGTERM)
                    stop_at = time.monotonic() + STOP_GRACE_S
        return first_failure, False
    finally:
        _signal_all(ranks, signal.SIGKILL)
        for rank in ranks:
            rank.join(5)


def _signal_all(ranks: list, sig: int) -> None:
    """``sig`` to each live rank's process group (the rank and its DataLoader workers)."""
    for rank in ranks:
        if rank.exitcode is None and rank.pid is not None:
            try:
                os.killpg(rank.pid, sig)
            except ProcessLookupError:  # not yet its own group leader (os.setsid not reached)
                try:
                    os.kill(rank.pid, sig)
                except ProcessLookupError:
                    pass


def run_script(script: Path | str, *args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python script args...`` forked from the forkserver (keyword arguments as ``launch``)."""
    return launch(script, *args, nproc=0, **kwargs)
