"""A process forked while stop signals are caught (a DataLoader worker during fit) is in a process group of
its own (trainer/cluster/stop_signals.py), so a signal to the rank's group does not reach it; when the rank is
SIGKILLed, the kernel ends it at once (Linux ``PR_SET_PDEATHSIG``), instead of it holding the rank's
sockets, which the other ranks' collectives wait on, until torch's DataLoader watchdog notices (up to 5 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import procs

# the children sleep far longer than the test waits: only the parent-death signal can end them in time
SCRIPT = r"""
import os, sys, threading, time
from trainforge.trainer.cluster.stop_signals import StopSignals

def child():
    time.sleep(120)
    os._exit(0)

stops = StopSignals(("SIGTERM",), where="test")
forked = []
def fork():
    pid = os.fork()
    if pid == 0:
        child()
    forked.append(pid)

fork()  # while the handlers are installed, from the main thread
stops.install()
fork()
thread = threading.Thread(target=fork)  # installed, but from another thread
thread.start()
thread.join()
print(" ".join(map(str, forked)), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigkilled_ranks_forked_workers_end_with_it():
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True, env=procs.test_env(), start_new_session=True
    )
    children = []
    try:
        before, during, from_thread = children = [int(p) for p in proc.stdout.readline().split()]
        assert os.getpgid(before) == proc.pid  # forked before the handlers: the parent's group, as always
        deadline = time.monotonic() + 10  # a child moves to its own group in its fork hook, as it starts
        while {os.getpgid(during), os.getpgid(from_thread)} != {during, from_thread} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.getpgid(during) == during and os.getpgid(from_thread) == from_thread  # groups of their own
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(during) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(during), "the worker outlived its SIGKILLed parent"
        # a thread's child is left alone (the kernel would signal it when that thread ended); the child
        # forked before the handlers is in the parent's group, which its launcher signals
        assert _alive(from_thread) and _alive(before)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
