"""Multi-process test runs without paying the interpreter start-up per rank.

Most multi-process tests launch a training script on 2 ranks. Through torchrun each run costs an
agent process and, per rank, a fresh interpreter that imports torch, torch._dynamo (imported by
DistributedDataParallel), torchdata and trainforge: about 5 CPU-seconds per rank before the first
step on this 2-core machine, most of the suite's time. Here the ranks are forked from a server
process started once per pytest worker that has imported those modules already
(tests/helpers/rank_server.py), so a rank starts in milliseconds.

What a rank gets is what torchrun gives a worker: the environment variables of torch elastic
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT,
TORCHELASTIC_RUN_ID, ...; rank 0 hosts the rendezvous store as without an agent store), the
script run as ``__main__`` with its argv, its folder first on sys.path, the requested cwd, the
interpreter's default start method for its own children (DataLoader workers fork), and Python's
exit order (non-daemon threads joined, then atexit handlers; with ``teardown=True`` also the module
teardown and C++ static destructors of ``python script.py``), its exit status the script's. A rank
that fails stops the others, as torchrun's agent does; ``max_restarts`` starts them again as
``--max-restarts`` does.

What it does not give: a fresh interpreter (modules the server preloaded are not re-imported,
so import-time behaviour and ``sys.modules`` shadowing are not exercised) and torchrun's own
failure summary, signal forwarding and restarts. Tests of those (the launcher, preemption through
the launcher, elastic restarts, namespace shadowing) keep launching real ``torchrun`` /
``trainforge launch`` processes through ``procs.torchrun``/``procs.trainforge_launch``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from tests.helpers import procs
from trainforge.strategies.environment import find_free_port

STOP_GRACE_S = 10.0  # how long the other ranks get to exit after one failed, as torchrun's agent waits


class _Server:
    """The rank server of this process (tests/helpers/rank_server.py) and the exits it reported."""

    def __init__(self) -> None:
        env = dict(procs.test_env(), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.rank_server"],
            cwd=procs.REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C to pytest does not reach the server and its ranks
        )
        self.exits: Dict[int, int] = {}
        self.replies: List[dict] = []
        self._pending = b""
        ready = self._reply(time.monotonic() + 300)
        if ready is None or not ready.get("ready") or ready.get("threads") != 1:
            raise RuntimeError(f"the rank server did not start with one thread (forks would copy held locks): {ready}")

    def _receive(self, timeout: float) -> bool:
        """Reads what the server sent within ``timeout``: exits into ``exits``, other messages into
        ``replies``. True if anything came."""
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], max(timeout, 0.0))[0]:
            return False
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not data:
            raise RuntimeError(f"the rank server exited ({self.proc.wait()})")
        self._pending += data
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.exits[message["pid"]] = message["exit"]
            else:
                self.replies.append(message)
        return True

    def _reply(self, deadline: float) -> Optional[dict]:
        while not self.replies and time.monotonic() < deadline:
            self._receive(deadline - time.monotonic())
        return self.replies.pop(0) if self.replies else None

    def start(self, script: str, argv: List[str], env: Dict[str, str], cwd: str, log: str, teardown: bool) -> int:
        assert self.proc.stdin is not None
        request = {"script": script, "argv": argv, "env": env, "cwd": cwd, "log": log, "teardown": teardown}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._reply(time.monotonic() + 60)
        if reply is None or "pid" not in reply:
            raise RuntimeError(f"the rank server did not start {script}: {reply}")
        return int(reply["pid"])

    def poll(self, timeout: float) -> None:
        """Returns when the server said something (an exit), or after ``timeout``."""
        self._receive(timeout)


_server: Optional[_Server] = None


def _rank_server() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    return _server


def rank_env(
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


def launch(
    script: Path | str,
    *args: Any,
    nproc: int = 2,
    timeout: float,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[Path] = None,
    check: bool = True,
    max_restarts: int = 0,
    teardown: bool = False,
) -> subprocess.CompletedProcess:
    """Runs ``script args...`` on ``nproc`` ranks as torchrun would; output of all ranks merged,
    return code 0 when every rank exited 0, else the first failing rank's code. ``check``:
    AssertionError with the output tail unless it is 0. ``nproc=0``: one process without the
    launcher's variables, as ``python script args...`` (what ``run_script`` does).
    ``max_restarts``: as torchrun's ``--max-restarts``: after a rank fails (the others stopped),
    every rank starts again, up to that many times, with TORCHELASTIC_RESTART_COUNT counting the
    restarts (a new rendezvous: a new port). The real agent's restarts are tested once
    (tests/trainer/test_resume.py); tests of what a restarted run does use this. ``teardown``: each
    rank ends with the interpreter's full exit (module teardown, C++ destructors) instead of
    ``os._exit`` after its atexit handlers (tests/helpers/rank_server.py)."""
    server = _rank_server()
    base = env or procs.test_env()
    argv = [str(a) for a in args]
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="forklaunch-") as tmp:
        log = os.path.join(tmp, "output.txt")
        for restart in range(max_restarts + 1):
            port = find_free_port()
            run_id = f"forklaunch-{os.getpid()}-{port}"
            envs = [rank_env(base, r, nproc, port, run_id, restart, max_restarts) for r in range(max(nproc, 1))]
            ranks = [server.start(str(script), argv, e, str(cwd or procs.REPO), log, teardown) for e in envs]
            code, timed_out = _wait(server, ranks, deadline)
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


def _wait(server: _Server, ranks: List[int], deadline: float) -> tuple:
    """Waits for every rank; the first failure stops the rest (SIGTERM, then SIGKILL after
    STOP_GRACE_S). Returns (first non-zero code or 0, whether the deadline passed)."""
    first_failure = 0
    stop_at: Optional[float] = None
    try:
        while any(pid not in server.exits for pid in ranks):
            now = time.monotonic()
            if now >= deadline:
                return first_failure, True
            if stop_at is not None and now >= stop_at:
                _signal_all(server, ranks, signal.SIGKILL)
                stop_at = None
            server.poll(min(1.0, deadline - now))
            for pid in ranks:
                code = server.exits.get(pid, 0)
                if code != 0 and first_failure == 0:
                    first_failure = code if code > 0 else 128 - code
                    _signal_all(server, ranks, signal.SIGTERM)
                    stop_at = time.monotonic() + STOP_GRACE_S
        return first_failure, False
    finally:
        _signal_all(server, ranks, signal.SIGKILL)
        end = time.monotonic() + 5
        while any(pid not in server.exits for pid in ranks) and time.monotonic() < end:
            server.poll(0.1)
        for pid in ranks:
            server.exits.pop(pid, None)


def _signal_all(server: _Server, ranks: List[int], sig: int) -> None:
    """``sig`` to each rank's process group, the ranks that ended included, as torchrun's agent stops its
    workers (what the rank started in its group goes too; DataLoader workers forked while trainforge's
    stop signals are installed have their own group and end with their parent, or by torch's watchdog
    within ~5 s of a SIGKILL, holding the dead rank's gloo sockets open meanwhile, as under torchrun)."""
    for pid in ranks:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # the group is empty, or the rank has not reached os.setsid yet
            if pid not in server.exits:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def run_script(script: Path | str, *args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python script args...`` forked from the forkserver (keyword arguments as ``launch``)."""
    return launch(script, *args, nproc=0, **kwargs)
