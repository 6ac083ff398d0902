"""Runs the documentation's code blocks (tests/test_docs_examples.py), all of them in one process.

    python -m tests.helpers.docs_runner SPEC.json RESULTS.json

SPEC.json is a list of ``{"id", "kind": "python" | "bash", "code", "dir", "timeout", "launch"}``. Importing torch
and trainforge takes seconds on a loaded 2-core machine, and a block runs in a fraction of that; so this
process imports them once, then forks one child per python block: the child starts from a fresh
``__main__`` namespace in the block's own empty directory, as ``python example.py`` there would, and its
exit status is the block's (an uncaught exception prints its traceback and exits 1, ``sys.exit(n)``
exits n, atexit handlers run); with ``"launch": N`` it runs as N such children, the ranks of a job, with
the variables ``trainforge launch --nproc-per-node N`` gives its workers (a multi-process example; the first
rank that fails ends the others). Nothing here runs torch code before a fork (no thread pools to inherit).
A bash block runs under ``bash -e -o pipefail`` in its directory, where ``python3``/``python`` are
this interpreter and stdin is empty; its ``trainforge`` command is the console script's ``main`` run in
a child forked from this process (``.bin/trainforge`` hands over its arguments, directory, environment
and standard streams through a Unix socket and exits with the child's code): the CLI's own processes
cost what the command does, not torch's and transformers' imports again. ``XDG_CONFIG_HOME`` is the block directory's ``.config`` (where
``trainforge config`` writes, never the user's). Each block's output (stdout and stderr together) is
``<dir>/output.txt``; RESULTS.json maps each id to ``{"exit": code, "seconds": wall time}`` (exit -9: killed after its timeout).
"""

from __future__ import annotations

import ast
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from tests.helpers.forklaunch import rank_env
from tests.helpers.rank_server import exit_after
from trainforge.strategies.environment import find_free_port

# what the blocks' fits import (torch imports dynamo, sympy and torch.distributed's parts lazily): seconds each
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "trainforge",
    "trainforge.callbacks",
    "trainforge.utils",
    # the model pages' blocks (empty init, big-model inference, PEFT adapters): ~3.5 s per block otherwise
    "transformers",
    "transformers.models.llama.modeling_llama",
    "peft",
)
CAUGHT = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)


def _child(block: Dict, out_fd: int, env: Optional[Dict[str, str]] = None) -> None:
    """In the forked child: become ``python example.py`` in the block's directory (``env``: this
    environment, e.g. a rank's); never returns."""
    os.setpgid(0, 0)  # its own group: a timeout kills what it started too
    for sig in CAUGHT:  # as in a new process (pytest or this runner may have handlers)
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.chdir(block["dir"])
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.environ["XDG_CONFIG_HOME"] = str(Path(block["dir"]) / ".config")
    sys.argv = ["example.py"]
    sys.path[0] = block["dir"]
    main = types.ModuleType("__main__")  # what pickle and dataclasses look classes up in
    main.__file__ = str(Path(block["dir"]) / "example.py")
    sys.modules["__main__"] = main
    exit_after(lambda: exec(compile(block["code"], block["id"], "exec"), main.__dict__))


def run_python(block: Dict, out_fd: int) -> int:
    return _run_forked(block, out_fd, [None])


def run_launched(block: Dict, out_fd: int) -> int:
    """``launch: N``: N ranks forked with the variables ``trainforge launch --nproc-per-node N`` gives its
    workers (tests/helpers/forklaunch.py's; the launcher itself is tested in tests/trainer/test_cli.py)."""
    port, nproc = find_free_port(), block["launch"]
    envs = [rank_env(dict(os.environ), r, nproc, port, f"docs-{port}") for r in range(nproc)]
    return _run_forked(block, out_fd, envs)


def _run_forked(block: Dict, out_fd: int, envs: List[Optional[Dict[str, str]]]) -> int:
    """One forked child per environment; the first failure's code (the others killed then, as a
    launcher stops a job whose rank failed), else 0; -9 after the block's timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for env in envs:
        pid = os.fork()
        if pid == 0:
            _child(block, out_fd, env)
        pids.append(pid)
    deadline, running, failed = time.monotonic() + block["timeout"], set(pids), 0
    while running:
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                failed = failed or os.waitstatus_to_exitcode(status)
        if running and (failed or time.monotonic() > deadline):
            _kill_groups(running)
            for pid in running:
                os.waitpid(pid, 0)
            return failed or -9
        time.sleep(0.02)
    return failed


def _kill_groups(pids: Iterable[int]) -> None:
    """SIGKILL to each child's process group (each child made its own): what it started dies with it."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(command: List[str], block: Dict, out_fd: int, env: Dict[str, str]) -> int:
    proc = subprocess.Popen(
        command,
        cwd=block["dir"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out_fd,
        stderr=out_fd,
        start_new_session=True,
    )
    deadline, commands = time.monotonic() + block["timeout"], {}
    while proc.poll() is None or commands:
        if time.monotonic() > deadline:
            _kill_groups([proc.pid, *commands])
            proc.wait()
            for pid in commands:
                os.waitpid(pid, 0)
            return -9
        _serve_commands(commands)
    return proc.returncode


LISTENER: socket.socket  # where .bin/trainforge connects (main() opens it)
SHIM = """#!{python}
import os, socket, sys
connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
connection.connect({address!r})
request = repr((sys.argv[1:], os.getcwd(), dict(os.environ))).encode()
socket.send_fds(connection, [request], [0, 1, 2])
sys.exit(int(connection.recv(16) or b"1"))
"""


def _serve_commands(commands: Dict[int, socket.socket]) -> None:
    """Starts the ``trainforge`` commands asked for (a forked child each) and answers those that ended."""
    readable, _, _ = select.select([LISTENER], [], [], 0.02)
    if readable:
        connection, _ = LISTENER.accept()
        request, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        argv, cwd, env = ast.literal_eval(request.decode())
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _command(argv, cwd, env, fds)
        for fd in fds:
            os.close(fd)
        commands[pid] = connection
    for pid in list(commands):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            connection = commands.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            connection.send(str(128 - code if code < 0 else code).encode())  # killed by a signal: as a shell says
            connection.close()


def _command(argv: List[str], cwd: str, env: Dict[str, str], fds: List[int]) -> None:
    """In the forked child: ``trainforge ARGV...`` as the console script runs it; never returns."""
    os.setpgid(0, 0)
    for sig in CAUGHT:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["trainforge", *argv]
    from trainforge.trainer.cli.main import main as cli

    exit_after(lambda: sys.exit(cli()))


def run_bash(block: Dict, out_fd: int) -> int:
    bin_dir = Path(block["dir"]) / ".bin"  # python3 and python: this interpreter
    bin_dir.mkdir(exist_ok=True)
    for name in ("python3", "python"):
        link = bin_dir / name
        if not link.exists():
            link.symlink_to(sys.executable)
    shim = bin_dir / "trainforge"
    shim.write_text(SHIM.format(python=sys.executable, address=LISTENER.getsockname()))
    shim.chmod(0o755)
    path = os.pathsep.join((str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]))
    # XDG_CONFIG_HOME: `trainforge config` writes there, not into the user's ~/.config
    env = dict(os.environ, PATH=path, XDG_CONFIG_HOME=str(Path(block["dir"]) / ".config"))
    return _wait(["bash", "-e", "-o", "pipefail", "-c", block["code"]], block, out_fd, env)


def main(spec_path: str, results_path: str) -> None:
    global LISTENER
    where = tempfile.mkdtemp(prefix="docs-runner-")  # a short path: a socket's is 108 bytes at most
    LISTENER = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    LISTENER.bind(os.path.join(where, "cli.sock"))
    LISTENER.listen(4)
    try:  # not atexit: the forked children run this process's exit handlers
        run_blocks(spec_path, results_path)
    finally:
        LISTENER.close()
        shutil.rmtree(where, ignore_errors=True)


def run_blocks(spec_path: str, results_path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    gc.collect()
    gc.freeze()  # a block's collections then leave the preloaded objects, shared with this process, unwritten
    # a fork copies only the forking thread: a thread started by an import (an OpenMP pool when
    # OMP_NUM_THREADS is not 1) would leave its locks held in every child
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    assert threads == 1, f"the docs runner must fork from one thread; its imports started {threads - 1} more"
    results = {}
    for block in json.loads(Path(spec_path).read_text()):
        start = time.monotonic()
        with open(Path(block["dir"]) / "output.txt", "wb") as out:
            run = run_bash if block["kind"] == "bash" else run_launched if block.get("launch") else run_python
            exit_code = run(block, out.fileno())
        results[block["id"]] = {"exit": exit_code, "seconds": round(time.monotonic() - start, 2)}
        Path(results_path).write_text(json.dumps(results, indent=1))  # what finished, if the run is cut short


if __name__ == "__main__":
    main(*sys.argv[1:3])
