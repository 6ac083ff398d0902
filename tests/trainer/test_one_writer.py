"""One writer per run directory, end to end (real processes): a second fit started on a run that another process
is writing stops with an error before it writes anything, on every rank of its job, and the first run's
checkpoints are all its own; the run is free again once the first process ends, however it ends. The same for
the Accelerator's automatically named checkpoints of one project_dir."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import forklaunch, procs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "one_writer_run.py"


def start_holding(root: Path) -> subprocess.Popen:
    """A run of 8 steps that stops after step 2 (its checkpoint written) until ``<root>.go`` exists."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(root), "8", "0.1", "hold"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=procs.test_env(),
    )
    deadline = time.monotonic() + 120
    while not Path(f"{root}.at2").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    return proc


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def run(root: Path, steps: int, lr: float) -> subprocess.CompletedProcess:
    return procs.run([sys.executable, str(SCRIPT), str(root), str(steps), str(lr)], timeout=180, check=False)


def test_a_second_process_on_a_run_in_progress_stops_before_writing_and_names_the_holder(tmp_path):
    root = tmp_path / "run"
    run_dir = root / "lightning_logs" / "version_0"  # the logger's version: resume="auto" goes on in the newest
    holder = start_holding(root)
    try:
        before = snapshot(run_dir / "checkpoints")
        second = run(root, 16, 0.2)
        assert second.returncode == 3, second.stdout
        assert f"{run_dir / 'checkpoints'} is in use by another process" in second.stdout
        assert f"pid {holder.pid}" in second.stdout and "resume='auto'" in second.stdout
        assert snapshot(run_dir / "checkpoints") == before
    finally:
        Path(f"{root}.go").touch()
        out = holder.communicate(timeout=180)[0]
    assert holder.returncode == 0 and "done 8" in out, out
    # the first run's metrics and status are its own, whole
    with open(run_dir / "metrics.csv", newline="") as f:
        assert [row["step"] for row in csv.DictReader(f)] == [str(s) for s in range(8)]  # Lightning's steps
    assert (run_dir / "status.txt").read_text().strip() == "FINISHED"
    # the first run ended: its run is free to be continued
    third = run(root, 10, 0.1)
    assert third.returncode == 0 and "done 10" in third.stdout, third.stdout


def test_every_rank_of_a_second_job_stops_with_the_error_and_none_waits(tmp_path):
    root = tmp_path / "run"
    holder = start_holding(root)
    try:
        job = forklaunch.launch(SCRIPT, root, 16, 0.2, nproc=2, timeout=180, check=False)
    finally:
        Path(f"{root}.go").touch()
        holder.communicate(timeout=180)
    assert job.returncode == 3, job.stdout
    assert job.stdout.count("refused:") == 2, job.stdout


def test_a_run_whose_writer_was_killed_can_be_resumed_at_once(tmp_path):
    root = tmp_path / "run"
    holder = start_holding(root)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    resumed = run(root, 6, 0.1)
    assert resumed.returncode == 0 and "done 6" in resumed.stdout, resumed.stdout


ACCELERATOR = """
import sys, torch
from trainforge import Accelerator
from trainforge.strategies.errors import CheckpointError
acc = Accelerator(project_dir=sys.argv[1], automatic_checkpoint_naming=True)
model, opt = acc.prepare(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
try:
    acc.save_state()
except CheckpointError as e:
    print("refused:", e, flush=True)
    sys.exit(3)
print("saved", flush=True)
if sys.argv[2:] == ["hold"]:
    sys.stdin.readline()
    acc.end_training()
    print("ended", flush=True)
    sys.stdin.readline()
"""


def test_accelerator_project_checkpoints_have_one_writer_until_end_training(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", ACCELERATOR, str(tmp_path), "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=procs.test_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "saved"
        second = procs.run([sys.executable, "-c", ACCELERATOR, str(tmp_path)], timeout=120, check=False)
        assert second.returncode == 3 and f"pid {holder.pid}" in second.stdout, second.stdout
        assert sorted(os.listdir(tmp_path / "checkpoints")) == [".trainforge-run.lock", "checkpoint_0"]
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "ended"
        # end_training gave the project back while the process lives on
        after = procs.run([sys.executable, "-c", ACCELERATOR, str(tmp_path)], timeout=120, check=False)
        assert after.returncode == 0, after.stdout
        assert (tmp_path / "checkpoints" / "checkpoint_1").is_dir()
    finally:
        holder.communicate("\n", timeout=120)
