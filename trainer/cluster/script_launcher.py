"""``Trainer(devices=N)`` from a plain ``python script.py``: this process becomes rank 0 and starts the
N - 1 others by running the same command again, each with its rank's environment (MASTER_ADDR,
MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE), as Lightning's default launcher does.
The copies reach the same ``Trainer(devices=N)``, find themselves launched and train as their rank.

torch.distributed.run is not used here: torchrun starts *every* rank as a new process and its own
process only supervises them, but the process the user started has already run the script up to
``Trainer(...)`` and must itself be rank 0 and carry on (as in Lightning): only the others are new.
What torchrun would give us, we do here: each child is watched, and a child that fails stops the
others and makes rank 0 fail with a ``LaunchError`` holding the child's last output (its traceback),
raised in rank 0's main thread at once (a signal), or when rank 0 exits if it had finished. A main
thread waiting in native code (the rendezvous, a collective with the dead child) runs no signal handler:
then rank 0 prints the child's output and exits with 1 after ``_RAISE_WITHIN_S``. When rank
0 fails itself, the children are stopped at its exit, and a child ends when rank 0 dies (SIGKILL). ``trainforge launch`` (torchrun) remains the
way for several nodes, restarts and scripts that must not be re-run.
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Deque, List, Optional

from trainforge.strategies.environment import ClusterEnvironment, detect_environment, find_free_port
from trainforge.strategies.errors import ConfigurationError, LaunchError
from trainforge.trainer.cluster.stop_signals import STOPPABLE
from trainforge.trainer.cluster.stuck_process import LAUNCHER_PID_ENV

_TAIL_LINES = 60
# A real-time signal tells rank 0's main thread that a child failed: SIGUSR1/SIGUSR2 are stop signals a
# scheduler sends (trainer/cluster/stop_signals.py) and must stay free for them. Absent on Windows and macOS: the
# failure is raised at exit there.
_FAILURE_SIGNAL = getattr(signal, "SIGRTMIN", None)
# Rank 0's main thread raises a child's failure within this long unless it waits in native code.
_RAISE_WITHIN_S = 5.0
# A child that saved and exited on a stop signal (128 + its number, trainer/cluster/stop_signals.py) did not fail.
_STOPPED_CODES = {128 + int(getattr(signal, name)) for name in STOPPABLE if hasattr(signal, name)}


def script_command() -> List[str]:
    """The command that started this process, to start it again (``python -m pkg`` or a script file)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)  # the standard library's module object, not trainforge's
    if spec is not None and spec.name:
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    if sys.argv and sys.argv[0] and os.path.isfile(sys.argv[0]):
        return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    raise ConfigurationError(
        "Trainer(devices=N) with N > 1 starts N - 1 copies of the running script, and this process runs "
        "none (an interactive session, `python -c`, a notebook): use trainforge.notebook_launcher(fn, "
        "num_processes=N), or put the code in a file and run `trainforge launch --nproc-per-node N script.py`"
    )


class _Child:
    def __init__(self, rank: int, command: List[str], env: dict) -> None:
        self.rank = rank
        self.stopped = False  # terminated by rank 0 (its exit code is not a failure of its own)
        self.tail: Deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
        self.reader = threading.Thread(target=self._forward, name=f"trainforge-rank{rank}-stderr", daemon=True)
        self.reader.start()

    def _forward(self) -> None:
        """The child's stderr goes on to ours, line by line; its last lines are kept for the error."""
        stream = self.proc.stderr
        assert stream is not None
        for line in stream:
            self.tail.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def failure(self) -> str:
        self.reader.join(timeout=5)  # the whole traceback
        return (
            f"rank {self.rank} (pid {self.proc.pid}) exited with code {self.proc.returncode}; its last output:\n"
            + "".join(self.tail).rstrip()
        )


class _Launch:
    """The children of this rank 0, watched by a daemon thread."""

    def __init__(self, children: List[_Child]) -> None:
        self.children = children
        self.failure: Optional[str] = None
        self.raised = False
        self.rank0_failed = False
        self.stopping = False

    def start(self) -> None:
        """Watch the children (after rank 0's failure handler is installed: no signal before it)."""
        threading.Thread(target=self._watch, name="trainforge-children", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            for child in self.children:
                code = child.proc.poll()
                failed = code not in (None, 0) and code not in _STOPPED_CODES and not child.stopped
                if failed and self.failure is None and not self.stopping:
                    self.failure = child.failure()
                    self.stop_children()
                    if _FAILURE_SIGNAL is not None and not self.rank0_failed:
                        os.kill(os.getpid(), _FAILURE_SIGNAL)  # raised in rank 0's main thread
                    self._exit_unless_raised()
                    return
            if all(c.proc.poll() is not None for c in self.children):
                return
            time.sleep(0.2)

    def _exit_unless_raised(self) -> None:
        """Rank 0's main thread runs no Python handler while it waits in native code (the rendezvous
        for the dead child, a collective with it): then the failure ends rank 0 from here."""
        deadline = time.monotonic() + _RAISE_WITHIN_S
        while not (self.raised or self.rank0_failed) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not (self.raised or self.rank0_failed):
            self.raised = True
            sys.stderr.write(
                f"trainforge: Trainer(devices={len(self.children) + 1}): {self.failure}\n"
                f"trainforge: rank 0 waits for the failed rank in native code and cannot raise; it exits with 1\n"
            )
            sys.stderr.flush()
            os._exit(1)

    def stop_children(self) -> None:
        self.stopping = True
        for child in self.children:
            if child.proc.poll() is None:
                child.stopped = True
                child.proc.terminate()
        deadline = time.monotonic() + 10
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def raise_failure(self, signum: int, frame: Any) -> None:
        if self.failure is not None and not self.raised:
            self.raised = True
            raise LaunchError(f"Trainer(devices={len(self.children) + 1}): {self.failure}")

    def at_exit(self) -> None:
        """Rank 0 ends: wait for the children, and fail if one did. When rank 0 failed itself, often
        because a child died under a collective (gloo: "Connection closed by peer"), a child that exits
        on its own within a few seconds is reported with its traceback; the others are stopped."""
        if self.rank0_failed:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children):
                time.sleep(0.1)
        else:
            for child in self.children:
                child.proc.wait()
        failed = [c for c in self.children if c.proc.poll() not in (None, 0, *_STOPPED_CODES) and not c.stopped]
        self.stop_children()
        if self.failure is None and failed:
            self.failure = failed[0].failure()
        if self.failure is not None and not self.raised:
            sys.stdout.flush()
            sys.stderr.write(f"trainforge: Trainer(devices={len(self.children) + 1}): {self.failure}\n")
            sys.stderr.flush()
            if not self.rank0_failed:
                os._exit(1)  # the exit status of rank 0 says that the run failed


def launch_script(nprocs: int) -> ClusterEnvironment:
    """Make this process rank 0 of ``nprocs`` on this machine and start the others; its environment."""
    command = script_command()
    shared = {
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": str(find_free_port()),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
    }
    os.environ.update(shared, RANK="0", LOCAL_RANK="0")
    # a child ends when rank 0 dies (trainer/cluster/stuck_process.py watch_launcher), stuck or not
    child_env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
    children = [
        _Child(rank, command, {**child_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(1, nprocs)
    ]
    launch = _Launch(children)
    if _FAILURE_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        signal.signal(_FAILURE_SIGNAL, launch.raise_failure)
    launch.start()
    previous_hook = sys.excepthook

    def excepthook(*args: Any) -> None:
        launch.rank0_failed = True  # its own error: the children are stopped at exit, not waited for
        previous_hook(*args)

    sys.excepthook = excepthook
    atexit.register(launch.at_exit)
    return detect_environment(os.environ)
