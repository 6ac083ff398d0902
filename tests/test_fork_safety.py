"""Forking after a gloo backward must not hang the child (trainforge/strategies/clean_exit.py says why).

A gloo worker releasing a backward's Python object takes CPython's HEAD_LOCK without the GIL; a fork
at that moment gives a child stuck forever in PyOS_AfterFork_Child (CPython 3.11.7). The strategies
install a before-fork hook (``clean_exit.register``) that waits until no gloo worker is runnable. The
natural hang is rare (1 child in ~32,000 forks in scripts/fork_stress.py's loaded runs), so these tests check
that the hook is there, runs on every fork and sees the real gloo workers; scripts/fork_stress.py
counts hangs."""

from __future__ import annotations

import os

import pytest

from tests.helpers import procs
from trainforge.strategies import clean_exit

STEPS = 6
FORK_AFTER_BACKWARD = f"""
import torch
from torch import nn
from torch.utils.data import DataLoader
from trainforge import Accelerator
from trainforge.strategies import clean_exit

acc = Accelerator()  # starts the gloo group; the strategy registers clean_exit
assert clean_exit._fork_hook, "the strategy did not install the before-fork hook"
seen = []
real_states = clean_exit._gloo_worker_states


def counting_states():
    states = real_states()
    seen.append(len(states))
    return states


clean_exit._gloo_worker_states = counting_states  # the hook looks it up on every fork
torch.manual_seed(0)
model = acc.prepare(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]))
for step in range({STEPS}):
    acc.backward(model(torch.randn(4, 16)).sum())  # gloo all-reduces inside the backward
    for batch in DataLoader(list(range(8)), batch_size=4, num_workers=2, timeout=30):  # 2 forks, at once
        pass
assert len(seen) >= 2 * {STEPS}, f"the before-fork hook ran {{len(seen)}} times for {{2 * {STEPS}}} forks"
assert max(seen) > 0, "the before-fork hook found no gloo worker thread (renamed in this torch?)"
print("FORKS-OK", len(seen), max(seen), flush=True)
"""


@pytest.fixture
def fresh_registration(monkeypatch):
    """clean_exit as in a process where nothing registered yet; what register() installs is recorded,
    not installed (neither atexit handlers nor fork hooks can be removed again)."""
    installed = {"atexit": [], "fork": []}
    monkeypatch.setattr(clean_exit, "_registered", False)
    monkeypatch.setattr(clean_exit, "_fork_hook", False)
    monkeypatch.setattr(clean_exit, "_at_exit", [])
    monkeypatch.setattr(clean_exit.atexit, "register", lambda fn: installed["atexit"].append(fn))
    monkeypatch.setattr(clean_exit.os, "register_at_fork", lambda **hooks: installed["fork"].append(hooks))
    return installed


def test_register_installs_the_before_fork_hook_once(fresh_registration):
    clean_exit.register()
    clean_exit.register(lambda: None)
    clean_exit.register()
    assert fresh_registration["fork"] == [
        {"before": clean_exit._before_fork, "after_in_child": clean_exit._after_fork_in_child}
    ]
    assert fresh_registration["atexit"] == [clean_exit._exit_handler]


def test_before_fork_without_gloo_workers_never_sleeps(monkeypatch):
    # this test process starts no process group: a fork must cost no wait
    def no_sleep(seconds):
        raise AssertionError(f"the before-fork hook slept {seconds} s with no gloo worker")

    monkeypatch.setattr(clean_exit.time, "sleep", no_sleep)
    assert clean_exit._gloo_worker_states() == []
    clean_exit._before_fork()


def test_before_fork_waits_for_a_runnable_gloo_worker_then_gives_up(monkeypatch):
    states = iter([["R", "S"], ["R", "S"], ["S", "S"]])
    slept = []
    monkeypatch.setattr(clean_exit, "_gloo_worker_states", lambda: next(states))
    monkeypatch.setattr(clean_exit.time, "sleep", slept.append)
    clean_exit._before_fork()
    assert slept == [clean_exit._POLL_S, clean_exit._POLL_S]  # until none is runnable

    monkeypatch.setattr(clean_exit, "_gloo_worker_states", lambda: ["R"])  # busy for good: bounded
    monkeypatch.setattr(clean_exit, "_FORK_DRAIN_LIMIT_S", 0.05)
    monkeypatch.setattr(clean_exit.time, "sleep", lambda s: None)
    clean_exit._before_fork()


def test_before_fork_never_raises(monkeypatch):
    def broken():
        raise OSError("no /proc")

    monkeypatch.setattr(clean_exit, "_gloo_worker_states", broken)
    clean_exit._before_fork()  # a hook that raised would only print, but it must not stop the fork either


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads gloo worker threads from Linux /proc")
@pytest.mark.slow
def test_dataloader_workers_forked_after_gloo_backward_start(tmp_path):
    script = tmp_path / "fork_after_backward.py"
    script.write_text(FORK_AFTER_BACKWARD)
    out = procs.run(procs.torchrun(script), timeout=120, check=False)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}"
    assert out.stdout.count("FORKS-OK") == 2, out.stdout[-3000:]
