"""Checkpoints under real SIGKILLs and real 2-process (gloo) saves."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.helpers import forklaunch
from trainforge.strategies.checkpoint.io import (
    CheckpointWriter,
    load_object,
    load_tensors,
    read_latest_pointer,
    resolve_checkpoint,
    verify_checkpoint,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TRIALS = 12


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line from an unbuffered binary stdout, or AssertionError after ``timeout`` seconds."""
    out = b""
    deadline = time.monotonic() + timeout
    while not out.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(left, 0))
        chunk = os.read(proc.stdout.fileno(), 1) if ready else b""
        if not chunk:
            raise AssertionError(f"no line from {proc.args} within {timeout}s (got {out!r}, rc={proc.poll()})")
        out += chunk
    return out.decode().strip()


def _check_resume_point(root: Path, log: Path) -> bool:
    """What a restart would resume from is complete, loads, and is not older than what was reported."""
    reported = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("saved ")]
    assert "Traceback" not in log.read_text(), log.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kill must never leave a committed checkpoint that fails to verify
        path = resolve_checkpoint(root, "last", missing_ok=True)
    if path is None:
        assert not reported, f"saves {reported} were reported complete but nothing resolves under {root}"
        return False
    step = verify_checkpoint(path)["step"]
    assert step >= max(reported, default=0), (path, step, reported)
    tensors = load_tensors(path)
    assert float(tensors["weight"][0]) == step and float(tensors["bias"][-1]) == step
    assert tensors["tied"] is tensors["weight"]
    assert load_object(path, "optimizer")["step"] == step == load_object(path, "rng/rank-00000")["step"]
    return any(p.name.endswith(".partial") for p in root.iterdir())


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork server needs os.fork")
def test_sigkill_during_save_never_loses_the_last_reported_checkpoint(tmp_path):
    rng = random.Random(20240611)
    server = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "ckpt_save_loop.py"), "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=0,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert _readline(server, 60) == "ready"
        killed_mid_write = 0
        for trial in range(TRIALS):
            root, log = tmp_path / f"trial{trial}", tmp_path / f"trial{trial}.log"
            mode = "overwrite" if trial % 3 == 2 else "unique"
            server.stdin.write(f"{root} 3 {mode} {log}\n".encode())
            pid = int(_readline(server, 10).split()[1])
            time.sleep(rng.uniform(0.05, 1.2))
            os.kill(pid, signal.SIGKILL)
            server.stdin.write(f"reap {pid}\n".encode())
            status = int(_readline(server, 10).split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, log.read_text())
            killed_mid_write += _check_resume_point(root, log)
            # The next save after the crash cleans every leftover (partials, aside copies, temp pointer).
            w = CheckpointWriter(root / "after-crash")
            w.save_object("progress", {"trial": trial})
            w.finalize({"step": 10**6})
            assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []
            assert resolve_checkpoint(root, "last") == root / "after-crash"
        # The kills must have landed inside saves, or this test proved nothing.
        assert killed_mid_write >= 1, "no kill landed while a checkpoint was being written"
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.mark.slow
def test_two_process_save_with_per_rank_files(tmp_path):
    root = tmp_path / "ckpts"
    output = forklaunch.launch(SCRIPTS / "ckpt_two_ranks.py", root, nproc=2, timeout=180).stdout  # as torchrun forks
    assert "rank 0 ok" in output and "rank 1 ok" in output
    for step, name in ((2, "step-2"), (4, "last")):
        meta = verify_checkpoint(root / name)
        assert meta["step"] == step and meta["world_size"] == 2 and meta["strategy"] == "ddp"
        assert set(meta["files"]) == {
            "model.safetensors",
            "rng/rank-00000.pt",
            "rng/rank-00001.pt",
            "shards/__0_0.distcp",
            "shards/__1_0.distcp",
        }
        for rank in (0, 1):
            obj = load_object(root / name, f"rng/rank-{rank:05d}")
            assert obj["rank"] == rank and obj["step"] == step
            assert (root / name / "shards" / f"__{rank}_0.distcp").read_bytes()[:2] == bytes([rank, step])
    assert read_latest_pointer(root) == "last"
    assert not (root / "clash").exists()  # the refused save was never committed
    assert sorted(p.name for p in root.iterdir()) == [".clash.partial", "last", "latest", "step-1", "step-2"]
