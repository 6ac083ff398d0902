"""Workers never outlive the job they belong to (trainer/cluster/stuck_process.py): a worker stuck in a
collective runs no Python signal handler, so a job stopped the way `timeout` and schedulers stop it
(SIGTERM to the launcher, which forwards it, then SIGKILL) left its workers alive as orphans; they now end
with their launcher. A second stop signal, once the first has had its chance, ends a process at once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import procs

# Both ranks wait in gloo for a message the other never sends: native code, no Python handler runs.
STUCK = r"""
import datetime, os, sys, torch, torch.distributed as dist
from trainforge.trainer.cluster.stop_signals import StopSignals
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
stops = StopSignals(("SIGTERM",), where="test", install=True)
os.write(1, f"stuck {os.getpid()}\n".encode())  # one write: the two ranks share the launcher's stdout
dist.recv(torch.zeros(1), src=1 - dist.get_rank())
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _worker_pids(proc: subprocess.Popen, count: int, timeout: float) -> list:
    pids: list = []
    deadline = time.monotonic() + timeout
    while len(pids) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        # two ranks' lines may still interleave where a launcher copies their output: take every pid on the line
        pids += [int(pid) for pid in re.findall(r"stuck (\d+)", line)]
    assert len(pids) == count, f"the workers did not start: {pids}"
    return pids


@contextlib.contextmanager
def _stuck_job(tmp_path):
    """A 2-rank ``trainforge launch`` of STUCK, both ranks waiting in ``recv``: (launcher, worker pids); every
    process is SIGKILLed at the end, whatever the test did."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    proc = subprocess.Popen(
        procs.trainforge_launch(script, nproc=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=procs.test_env(),
        start_new_session=True,
    )
    workers: list = []
    try:
        workers = _worker_pids(proc, 2, timeout=120)
        time.sleep(1)  # both in recv
        yield proc, workers
    finally:
        for pid in [*workers, proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_stuck_in_a_collective_end_when_their_launcher_is_killed(tmp_path):
    with _stuck_job(tmp_path) as (proc, workers):
        os.killpg(proc.pid, signal.SIGTERM)  # forwarded by torchrun; the stuck workers only record it
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), f"workers {workers} outlived their SIGKILLed launcher"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_stop_signal_ends_a_worker_stuck_in_a_collective(tmp_path):
    with _stuck_job(tmp_path) as (proc, workers):
        os.kill(workers[0], signal.SIGTERM)  # recorded by the C-level handler only: the main thread waits in gloo
        time.sleep(1.5)
        assert _alive(workers[0])
        os.kill(workers[0], signal.SIGTERM)  # the second: it was ignored as well
        deadline = time.monotonic() + 15
        while _alive(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(workers[0]), "a worker stuck in a collective outlived a second SIGTERM"
        output, _ = proc.communicate(timeout=60)  # torchrun ends the other rank
        assert "SIGTERM again" in output and "took none: ending now" in output, output[-3000:]


# The main thread takes signals (a Python loop); a repeated signal is either the same request delivered
# twice (sooner than SECOND_SIGNAL_AFTER_S) or an insistence.
SLEEPER = r"""
import time
from trainforge.trainer.cluster.stop_signals import StopSignals
stops = StopSignals(("SIGTERM",), where="test", install=True)
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.02)
    if stops.received is not None:
        print("received", stops.received.name, flush=True)
        break
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.02)
"""


def test_a_second_stop_signal_ends_a_process_the_first_could_not_stop():
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True, env=procs.test_env())
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)  # delivered twice at once (SLURM and the launcher): one request
        assert proc.stdout.readline().strip() == "received SIGTERM"
        time.sleep(0.3)
        assert proc.poll() is None, "a signal delivered twice at once ended the process"
        time.sleep(1.0)  # past SECOND_SIGNAL_AFTER_S
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
