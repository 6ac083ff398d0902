"""SLURM auto-requeue (trainer/cluster/slurm_requeue.py) against a real single-node SLURM started by the test
(tests/helpers/slurm.py: munged, slurmctld, slurmd; skipped with the reason where they cannot start).

A batch job submitted with ``sbatch --requeue`` trains (tests/scripts/resume_run.py through ``srun``, as a
user's job script does), gets SIGUSR1 between two periodic checkpoints (``scancel --signal=USR1``: what
``#SBATCH --signal=USR1@90`` sends to the job's steps before the time limit), saves that step, requeues
itself, and SLURM starts it again: the script has no resume flag, the Trainer resumes because SLURM says
the job was restarted, and the job ends with the weights of a run never stopped, bit for bit."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import forklaunch
from tests.helpers.slurm import Slurm, SlurmUnavailable
from tests.trainer.test_resume import assert_same_weights, steps
from trainforge import ConfigurationError, Trainer
from trainforge.trainer.cluster.slurm_requeue import SlurmRequeue, requeue_slurm_job
from trainforge.trainer.cluster.stop_signals import parse_stop_signals

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "resume_run.py"
EVERY, STEPS = 16, 20  # one periodic checkpoint, at 16; the signal comes at step 3, the stop before 16
SETTINGS = ["--ckpt-every", str(EVERY), "--max-steps", str(STEPS)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as why:
        cluster.stop()
        pytest.skip(str(why))
    try:
        yield cluster
    finally:
        cluster.stop()


def job_script(tmp: Path, nproc: int) -> Path:
    train = [str(SCRIPT), "--root", str(tmp / "cut"), "--record", str(tmp / "cut.rec"), *SETTINGS]
    train += ["--step-sleep", "0.1"]
    if nproc > 1:  # one srun task per node, the launcher starts the node's workers (examples/slurm/)
        command = [sys.executable, "-m", "trainforge", "launch", "--nproc-per-node", str(nproc), *train]
    else:
        command = [sys.executable, *train]
    script = tmp / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --job-name=trainforge-requeue\n"
        "#SBATCH --requeue\n"  # JobRequeue=1 makes it the default here; a user's script says it
        "#SBATCH --open-mode=append\n"  # the run after the requeue appends to the same output file
        f"#SBATCH --output={tmp / 'job.out'}\n"
        f"#SBATCH --chdir={ROOT}\n"
        f"#SBATCH --ntasks=1 --cpus-per-task={nproc}\n"
        'echo "trainforge-test: start, SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"\n'
        f"srun {' '.join(command)}\n"
        'echo "trainforge-test: srun exit code $?"\n'
    )
    return script


def wait_until(what: str, ready, slurm: Slurm, job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    state = slurm.job(job)
    out = Path(state.get("StdOut", "/nonexistent"))
    text = out.read_text()[-4000:] if out.exists() else "(no output file)"
    raise AssertionError(f"{what} within {timeout} s; job {job}: {state.get('JobState')}; output:\n{text}")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "2proc-launcher"])
def test_signalled_job_saves_requeues_and_resumes_bit_identically(slurm, tmp_path, nproc):
    job = slurm.run("sbatch", "--parsable", str(job_script(tmp_path, nproc))).stdout.strip().split(";")[0]
    record = tmp_path / f"cut.rec.rank{nproc - 1}.jsonl"
    reached = lambda: record.exists() and len(record.read_text().splitlines()) >= 3  # noqa: E731
    wait_until("the job did not reach step 3", reached, slurm, job, 60)
    slurm.run("scancel", "--signal=USR1", job)  # to every process of the job's steps, as --signal=USR1@90

    def finished() -> bool:
        return slurm.job(job)["JobState"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING")

    wait_until("the job did not finish after its requeue", finished, slurm, job, 90)
    output = (tmp_path / "job.out").read_text()
    state = slurm.job(job)
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0"), output[-4000:]
    stop = int(re.search(r"stopped on SIGUSR1 after step (\d+) on every rank", output).group(1))
    assert 3 <= stop < EVERY, output[-4000:]  # between two periodic checkpoints
    # the requeue ends the batch shell too: srun's report is the last word of the first run (the launcher's
    # code is 143 when SLURM's SIGTERM to the requeued job reaches it while it waits for its workers)
    assert f"requeued SLURM job {job}" in output and "task 0: Exited with exit code 1" in output
    assert "task 0: Exited with exit code 138" in output or nproc > 1
    assert f"SLURM job {job} was started again (SLURM_RESTART_COUNT=1): it resumes from " in output
    assert ", its own newest checkpoint" in output
    assert "trainforge-test: srun exit code 0" in output  # the second run
    assert "Traceback" not in output and "exited unexpectedly" not in output, output[-4000:]

    # the reference: the same run never stopped (forked, as torchrun starts workers)
    forklaunch.launch(SCRIPT, "--root", tmp_path / "full", "--record", tmp_path / "full.rec", *SETTINGS,
                      nproc=nproc if nproc > 1 else 0, timeout=120)  # fmt: skip
    assert_same_weights(tmp_path / "full", tmp_path / "cut")  # torch.equal on every tensor
    # each step once (the second run began at stop + 1), with the same samples and losses as the reference
    assert steps(tmp_path / "full.rec") == steps(tmp_path / "cut.rec")


def test_a_failed_scontrol_is_reported_and_the_job_is_not_requeued(slurm, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    with caplog.at_level("WARNING", logger="trainforge"):
        assert requeue_slurm_job("999999", "/runs/a/checkpoints/epoch=0-step=4") is False
    text = caplog.text
    assert "`scontrol requeue 999999` failed (exit code 1: " in text and "Invalid job id" in text, text
    assert "the job is NOT requeued" in text and "checkpoint /runs/a/checkpoints/epoch=0-step=4 is committed" in text


def test_jobs_slurm_cannot_requeue_are_said_and_left_alone(slurm, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    batch = slurm.run("sbatch", "--parsable", "--no-requeue", "--output=/dev/null", "--wrap", "sleep 60").stdout
    alloc = slurm.run("salloc", "--no-shell", "--ntasks=1", "--job-name=alloc", "--immediate=20").stderr
    jobs = [batch.strip().split(";")[0], re.search(r"Granted job allocation (\d+)", alloc).group(1)]
    try:
        with caplog.at_level("WARNING", logger="trainforge"):
            assert requeue_slurm_job(jobs[0], "ckpt/a") is False and requeue_slurm_job(jobs[1], "ckpt/b") is False
        assert f"SLURM job {jobs[0]} is not requeued: it was submitted with --no-requeue" in caplog.text
        assert f"SLURM job {jobs[1]} is not requeued: it is not a batch job (an interactive" in caplog.text
        assert "checkpoint ckpt/a is committed" in caplog.text and "scontrol requeue" not in caplog.text
        assert slurm.job(jobs[0])["Restarts"] == "0"
    finally:
        slurm.run("scancel", *jobs, check=False)


# ---- without a cluster: what runs where, bad input -------------------------------------------------------


def test_requeue_applies_to_batch_jobs_on_the_requeue_signal_only():
    stops = (__import__("signal").SIGTERM, __import__("signal").SIGUSR1)
    batch = SlurmRequeue(True, "SIGUSR1", stops, {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "train.sbatch"})
    assert batch.job_id == "42" and batch.applies("SIGUSR1") and not batch.applies("SIGTERM")
    array = {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    assert SlurmRequeue(True, "usr1", stops, array).job_id == "40_3"
    for environ in ({}, {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "interactive"}):  # not SLURM; salloc / srun --pty
        assert not SlurmRequeue(True, "SIGUSR1", stops, environ).applies("SIGUSR1")
    assert not SlurmRequeue(False, "SIGUSR1", stops, {"SLURM_JOB_ID": "42"}).applies("SIGUSR1")
    restarted = SlurmRequeue(True, "SIGUSR1", stops, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})
    assert restarted.resume(None, False) == "auto" and batch.resume(None, False) is None
    assert (
        SlurmRequeue(False, "SIGUSR1", stops, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}).resume(None, False)
        is None
    )


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"requeue_signal": "SIGFOO"}, "Trainer(requeue_signal)='SIGFOO': 'SIGFOO' is not a signal a run can stop on"),
        ({"requeue_signal": "SIGKILL"}, "SIGKILL cannot be caught"),
        ({"requeue_signal": None}, "must be one signal name such as 'SIGUSR1'"),
        ({"requeue_signal": ("SIGUSR1", "SIGTERM")}, "must be one signal name"),
        ({"auto_requeue": "yes"}, "Trainer(auto_requeue='yes') must be True"),
    ],
)
def test_bad_requeue_settings_are_refused_before_training(kwargs, named):
    with pytest.raises(ConfigurationError) as err:
        Trainer(max_steps=1, **kwargs)
    assert named in str(err.value)
    if "SIGFOO" in named:
        assert "SIGTERM, SIGINT, SIGUSR1, SIGUSR2" in str(err.value)  # the valid choices


def test_stop_signals_without_the_requeue_signal_are_refused_in_a_slurm_job_only(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    # outside SLURM nothing is requeued: this was refused unless auto_requeue=False was passed too
    Trainer(max_steps=1, stop_signals=("SIGTERM",))
    Trainer(max_steps=1, requeue_signal="SIGUSR2")
    stops = parse_stop_signals(("SIGTERM",), "test")
    with pytest.raises(ConfigurationError) as err:
        SlurmRequeue(True, "SIGUSR1", stops, {"SLURM_JOB_ID": "42"})
    assert "'SIGUSR1' is not one of Trainer(stop_signals)=('SIGTERM',): in this SLURM job" in str(err.value)
    assert "or pass auto_requeue=False" in str(err.value)
    SlurmRequeue(False, "SIGUSR1", stops, {"SLURM_JOB_ID": "42"})


def test_a_malformed_slurm_job_id_is_refused(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "12; rm -rf /")
    with pytest.raises(ConfigurationError, match=r"SLURM_JOB_ID='12; rm -rf /' is not a SLURM job id"):
        Trainer(max_steps=1)
    Trainer(max_steps=1, auto_requeue=False)  # off: the variable is not read
