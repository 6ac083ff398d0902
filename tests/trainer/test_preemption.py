"""A stop request saves and exits cleanly (trainer/cluster/stop_signals.py): a signal sent with os.kill to a real
process between two periodic checkpoints makes every rank stop at one step, save it, and exit with
128 + the signal number; resume="auto" then ends with the weights of a run never stopped, bit for bit.
1 process through `trainforge launch` (SIGTERM to the launcher, which forwards it; DataLoader workers
on) and 2 processes (SIGUSR1 to rank 1 only). CPU, gloo, tests/scripts/resume_run.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import forklaunch, procs
from tests.trainer.test_resume import assert_same_weights, steps
from trainforge import Accelerator, ConfigurationError, Trainer
from trainforge.trainer.cluster.stop_signals import StopSignals, TrainingStopped

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "resume_run.py"
EVERY, STEPS = 16, 20  # one periodic checkpoint, at 16; the signal lands at step 3-4, the stop before 16


def start(cmd: list) -> subprocess.Popen:
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env=procs.test_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"timed out:\n{proc.communicate()[0][-4000:]}") from None


def wait_for_step(record: Path, rank: int, step: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    path = record.parent / f"{record.name}.rank{rank}.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}:\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"rank {rank} did not reach step {step} in {timeout} s")


def command(tmp: Path, name: str, *args: str, nproc: int, launcher: bool) -> list:
    script = [str(SCRIPT), "--root", str(tmp / name), "--record", str(tmp / f"{name}.rec")]
    script += ["--ckpt-every", str(EVERY), "--max-steps", str(STEPS)]
    if launcher or nproc > 1:
        return procs.trainforge_launch(script[0], *script[1:], *args, nproc=nproc)
    return [sys.executable, *script, *args]


def forked(tmp: Path, name: str, *args: str, nproc: int) -> None:
    script = command(tmp, name, *args, nproc=1, launcher=False)[1:]
    forklaunch.launch(*script, nproc=nproc if nproc > 1 else 0, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, sig, target",
    [(1, signal.SIGTERM, "launcher"), (2, signal.SIGUSR1, "rank 1")],
    ids=["1proc-SIGTERM-to-launcher", "2proc-SIGUSR1-to-rank1"],
)
def test_signal_saves_the_step_exits_with_its_code_and_resumes_bit_identically(tmp_path, nproc, sig, target):
    # 50 ms steps: rank 0 spaces the exchanges ~5 steps apart (EXCHANGE_EVERY_S), the ranks still agree
    cut_args = ("--step-sleep", "0.05", "--pid-file", str(tmp_path / "pid"))
    cut = start(command(tmp_path, "cut", *cut_args, nproc=nproc, launcher=True))
    wait_for_step(tmp_path / "cut.rec", nproc - 1, 3, cut)
    os.kill(cut.pid if target == "launcher" else int((tmp_path / "pid.rank1").read_text()), sig)
    output = finish(cut)
    assert cut.returncode == 128 + sig, output[-4000:]  # 143 SIGTERM, 138 SIGUSR1: the launcher's too
    recorded = steps(tmp_path / "cut.rec")
    stop = max(recorded)
    assert 3 <= stop < EVERY, output[-3000:]  # between two periodic checkpoints
    assert all(len(losses) == nproc for _, losses in recorded.values()), output[-3000:]  # every rank at `stop`
    ckpts = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir())
    assert ckpts == [f"epoch=0-step={stop}", "latest"], (ckpts, output[-3000:])
    assert f"stopped on {sig.name} after step {stop}" in output
    assert "exited unexpectedly" not in output and "killed by signal" not in output  # DataLoader workers lived

    # the resume and the reference run (never stopped): forked as torchrun starts workers
    forked(tmp_path, "cut", "--resume", nproc=nproc)
    forked(tmp_path, "full", nproc=nproc)
    assert min(steps(tmp_path / "cut.rec")) == 1 and stop + 1 in steps(tmp_path / "cut.rec")
    assert_same_weights(tmp_path / "full", tmp_path / "cut")
    assert steps(tmp_path / "full.rec") == steps(tmp_path / "cut.rec")  # the same samples and losses per step


# ---- in this process: handlers, Ctrl-C twice, the Accelerator's loop, bad input ----------------------------


def test_second_ctrl_c_aborts_at_once_and_handlers_are_given_back():
    before = signal.getsignal(signal.SIGINT)
    stops = StopSignals(("SIGINT", "SIGTERM"), "test")
    with pytest.raises(KeyboardInterrupt), stops.catching(0):
        os.kill(os.getpid(), signal.SIGINT)  # the first: recorded, training goes on
        time.sleep(0.01)
        assert stops.received == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)  # the second: now
        time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_of_someone_else_is_left_in_place():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        stops = StopSignals("SIGUSR1", "test")
        with stops.catching(0):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)
        assert seen == [signal.SIGUSR1] and stops.received is None
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _accelerator_run(stop_at=None, resume_from=None, save_to=None):
    """A user's loop: 10 steps of a small model on one process; SIGTERM to itself at ``stop_at``."""
    torch.manual_seed(0)
    acc = Accelerator(stop_signals=("SIGTERM", "SIGUSR1"))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.randn(80, 4), torch.randn(80, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        start = 0
        if resume_from is not None:
            acc.load_state(resume_from)
            start = int((Path(resume_from) / "step.txt").read_text())
            loader = acc.skip_first_batches(loader, start)
        for step, (x, y) in enumerate(loader, start=start + 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if acc.stop_requested:
                acc.save_state(save_to)
                (Path(save_to) / "step.txt").write_text(str(step))
                return acc.stop_exit_code, step, None
        return 0, None, {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    finally:
        acc.stop_signals.uninstall()


def test_accelerator_loop_checks_stop_requested_saves_and_continues_exactly(tmp_path):
    _, _, reference = _accelerator_run()
    code, step, _ = _accelerator_run(stop_at=4, save_to=str(tmp_path / "ckpt"))
    assert (code, step) == (143, 4)  # one process: the step the signal came in
    code, _, resumed = _accelerator_run(resume_from=str(tmp_path / "ckpt"))
    assert code == 0 and resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)


def test_trainer_raises_training_stopped_after_the_stop_step_checkpoint(tmp_path):
    from tests.helpers.models import make_net
    from trainforge import TrainingModule
    from trainforge.callbacks import Callback

    class Model(TrainingModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class SignalAt(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

    trainer = Trainer(
        max_steps=10, callbacks=[SignalAt()], default_root_dir=str(tmp_path), enable_progress_bar=False, logger=False
    )
    loader = torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=4)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.fit(Model(), loader)
    assert (stopped.value.code, stopped.value.step, trainer.global_step) == (138, 4, 4)
    assert Path(stopped.value.checkpoint).name == "epoch=0-step=4"
    assert (tmp_path / "checkpoints" / "epoch=0-step=4").is_dir()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


# SIGTERM during the last step's BATCH_END: after the last poll, so no step is left to stop at
AFTER_THE_LAST_STEP = r"""
import os, signal, sys, torch
from tests.helpers.models import make_net
from trainforge import Trainer, TrainingModule
from trainforge.callbacks import Callback

class Model(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()
    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

class SignalAtTheEnd(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

trainer = Trainer(
    max_steps=4, callbacks=[SignalAtTheEnd()], default_root_dir=sys.argv[1], enable_progress_bar=False, logger=False
)
trainer.fit(Model(), torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=4))
print("after fit: step", trainer.global_step, flush=True)
"""


def test_a_signal_after_the_last_step_leaves_a_finished_run_finished(tmp_path):
    out = procs.run([sys.executable, "-c", AFTER_THE_LAST_STEP, str(tmp_path)], timeout=120, check=False)
    # it was delivered after fit: the finished run died of SIGTERM (143), as if it had been cut
    assert out.returncode == 0, out.stdout[-2000:]
    assert "after fit: step 4" in out.stdout and "SIGTERM came after the last step; the run is complete" in out.stdout
    assert (tmp_path / "checkpoints" / "epoch=0-step=4").is_dir()


@pytest.mark.parametrize(
    "value, named",
    [
        (("SIGTERM", "SIGFOO"), "'SIGFOO' is not a signal"),
        (("SIGKILL",), "SIGKILL cannot be caught"),
        ("SIGSTOP", "SIGSTOP cannot be caught"),
        (9, "SIGKILL cannot be caught"),
        ((3.5,), "3.5 is not a signal"),
        (object(), "must be signal names"),
    ],
)
def test_bad_stop_signals_are_refused_before_training(value, named):
    for build in (
        lambda: Trainer(max_steps=1, stop_signals=value),
        lambda: StopSignals(value, "Accelerator(stop_signals)"),
    ):
        with pytest.raises(ConfigurationError) as err:
            build()
        message = str(err.value)
        assert named in message and "SIGTERM, SIGINT, SIGUSR1" in message and "None catches none" in message


def test_signal_names_are_accepted_in_any_spelling():
    stops = StopSignals("sigterm, USR1", "test")
    assert stops.signals == (signal.SIGTERM, signal.SIGUSR1)
    assert StopSignals([signal.SIGINT, 15], "test").signals == (signal.SIGINT, signal.SIGTERM)
    assert StopSignals(None, "test").signals == () == StopSignals((), "test").signals


def test_launcher_forwards_slurm_signals_and_passes_the_grace_period(monkeypatch):
    import torch.distributed.run as torchrun

    from trainforge.trainer.cli import launch
    from trainforge.trainer.cli.launch_settings import flags_given

    parsed = torchrun.parse_args(launch.torchrun_argv({"shutdown_timeout": 90}, "train.py", []))
    assert {"SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"} <= set(parsed.signals_to_handle.split(","))
    assert parsed.shutdown_timeout == 90
    args = type("Args", (), {"shutdown_timeout": "-1"})()
    with pytest.raises(ConfigurationError, match=r"--shutdown-timeout='-1' must be an integer >= 0"):
        flags_given(args)
    monkeypatch.setattr(launch, "torchrun_accepts", lambda option: False)  # a torch before 2.12
    with pytest.raises(ConfigurationError, match="lacks .torch >= 2.12 has it.*leave --shutdown-timeout out"):
        launch.check_shutdown_timeout({"shutdown_timeout": 90})
    launch.check_shutdown_timeout({})  # not asked for: fine on any torch


def test_a_save_longer_than_the_launchers_stop_grace_is_said_once(tmp_path, monkeypatch):
    """`trainforge launch` exports how long workers have after a forwarded stop signal (--shutdown-timeout,
    else torchrun's 30 s); a checkpoint that takes longer to save would be cut on a stop."""
    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge.callbacks import ModelCheckpoint
    from trainforge.strategies.environment import STOP_GRACE_ENV

    def fit(root):
        checkpoints = ModelCheckpoint(every_n_steps=1)
        trainer = Trainer(max_steps=3, callbacks=[checkpoints], default_root_dir=str(root), enable_progress_bar=False)
        trainer.fit(Regressor(make_net()), torch.utils.data.DataLoader(regression_data(), batch_size=4))

    monkeypatch.setenv(STOP_GRACE_ENV, "0.000001")  # any save is longer
    with pytest.warns(UserWarning, match=r"took [0-9.]+ s, longer than the 1e-06 s .*--shutdown-timeout") as caught:
        fit(tmp_path / "short")
    assert sum("longer than the" in str(w.message) for w in caught) == 1  # three saves, said once
    monkeypatch.setenv(STOP_GRACE_ENV, "3600")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*longer than the")
        fit(tmp_path / "long")


def test_the_launcher_exports_the_stop_grace_to_its_workers(tmp_path):
    from trainforge.trainer.cli.launch import torchrun_accepts

    if not torchrun_accepts("shutdown_timeout"):
        pytest.skip("this torch's torchrun has no --shutdown-timeout (torch >= 2.12)")
    script = tmp_path / "grace.py"
    script.write_text("import os\nprint('grace', os.environ.get('TRAINFORGE_STOP_GRACE_S'), flush=True)\n")
    out = procs.run(procs.trainforge_launch(script, nproc=1, launch_args=["--shutdown-timeout", "7"]), timeout=120)
    assert "grace 7" in out.stdout, out.stdout[-2000:]
