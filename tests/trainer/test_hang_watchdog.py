"""Hangs are diagnosed, not waited out (strategies/watchdog.py, callbacks/hang_watchdog.py): 2 real gloo
processes through `trainforge launch` where rank 1 stalls inside training_step (the launcher's summary of
the hung ranks is part of what is tested); a slow validation that is no hang; stragglers logged (2 ranks
forked by tests/helpers/forklaunch.py: the log line is the callback's, not the launcher's); bad input
refused. tests/scripts/hang_run.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import forklaunch, procs
from trainforge import ConfigurationError, Trainer, TrainingModule
from trainforge.callbacks import HangWatchdog
from trainforge.strategies.watchdog import HANG_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "hang_run.py"


@pytest.mark.slow
def test_a_rank_that_stalls_ends_the_job_with_every_ranks_stacks(tmp_path):
    start = time.monotonic()
    out = procs.run(procs.trainforge_launch(SCRIPT, "hang", tmp_path), timeout=90, check=False)
    wall = time.monotonic() - start
    assert wall < 60, out.stdout[-4000:]
    assert out.returncode == HANG_EXIT_CODE, out.stdout[-6000:]
    stalled = (tmp_path / "hang" / "rank1.txt").read_text()
    waiting = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "rank 1" in stalled and "global step 3" in stalled, stalled
    assert "in training_step" in stalled, stalled  # the frame it is stuck in
    assert "in backward" in waiting and "in training_step" not in waiting, waiting  # in the gradient all-reduce
    assert "in backward (global step 3)" in waiting, waiting  # its last progress: batch 3's forward
    assert "behind: rank(s) [1]" in out.stdout, out.stdout[-4000:]  # the launcher's summary
    assert "rank1.txt" in out.stdout and "rank0.txt" in out.stdout, out.stdout[-4000:]


@pytest.mark.slow
def test_a_rank_far_slower_than_the_median_is_logged_with_its_host(tmp_path):
    out = forklaunch.launch(SCRIPT, "straggler", tmp_path, nproc=2, timeout=120)
    assert "straggler: rank 1 on " in out.stdout, out.stdout[-4000:]
    assert "straggler: rank 0" not in out.stdout, out.stdout[-4000:]


class SlowValidation(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        time.sleep(0.4)  # each batch well under the timeout; the validation (2 s) far above it

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_validation_longer_than_the_timeout_with_short_batches_does_not_fire(tmp_path):
    data = TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
    trainer = Trainer(
        max_steps=3,  # one validation (after step 2), mid-fit: the watchdog is armed before and after it
        hang_timeout=1.0,
        val_check_interval=2,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(SlowValidation(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    assert trainer.global_step == 3
    assert not (tmp_path / "hang").exists()


@pytest.mark.parametrize("value", [0, -5, "30", True, float("nan"), float("inf")])
def test_bad_hang_timeout_is_refused_naming_the_value_and_the_fix(value):
    with pytest.raises(ConfigurationError) as info:
        Trainer(hang_timeout=value)
    message = str(info.value)
    assert f"hang_timeout={value!r}" in message and "None (off)" in message and "positive number of seconds" in message


@pytest.mark.parametrize("value", [1e12, 7 * 24 * 3600 + 1])
def test_a_hang_timeout_too_long_to_wait_is_refused_up_front(value):
    # 1e12: the watchdog thread died of an OverflowError in its first wait and the fit ran unwatched
    with pytest.raises(ConfigurationError, match=rf"hang_timeout={value!r}\) is more than a week .* or None to turn"):
        Trainer(hang_timeout=value)
    with pytest.raises(ConfigurationError, match=r"HangWatchdog\(timeout=1000000000000.0\) is more than a week"):
        HangWatchdog(1e12)
    Trainer(hang_timeout=7 * 24 * 3600, max_steps=1, logger=False)  # a week is still taken


def test_hang_timeout_and_a_hang_watchdog_callback_are_not_both_given():
    with pytest.raises(ConfigurationError, match="give one of them"):
        Trainer(hang_timeout=10, callbacks=[HangWatchdog(10)])
    with pytest.raises(ConfigurationError, match="straggler_every=0"):
        HangWatchdog(10, straggler_every=0)
    with pytest.raises(ConfigurationError, match="straggler_factor=0.5"):
        HangWatchdog(10, straggler_factor=0.5)


def test_a_hang_report_never_overwrites_an_existing_file(tmp_path):
    """<root>/hang/rank0.txt may be a user's file or an earlier run's report: the new one goes beside it."""
    from trainforge.strategies.files import open_new

    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "rank0.txt").write_text("the user's notes\n")
    script = tmp_path / "stall.py"
    script.write_text(
        "import os, sys, time\n"
        "os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what comes back is stderr alone\n"
        "from trainforge.strategies.watchdog import ProgressWatchdog\n"
        "w = ProgressWatchdog(0.5, sys.argv[1], rank=0, grace_s=0)\n"
        "w.start()\n"
        "time.sleep(30)\n"
    )
    out = forklaunch.run_script(script, hang, timeout=60, cwd=tmp_path, check=False)  # a process, torch preloaded
    stderr = out.stdout
    assert out.returncode == 124, stderr[-2000:]
    assert (hang / "rank0.txt").read_text() == "the user's notes\n"
    assert "made no progress" in (hang / "rank0-1.txt").read_text() and str(hang / "rank0-1.txt") in stderr
    f, path = open_new(hang / "rank0.txt")
    f.close()
    assert path == hang / "rank0-2.txt"
