"""CSVLogger: file content read back after a real fit; new columns, resume, new versions, disk failure.
Lightning's layout and format against recorded Lightning output: tests/callbacks/test_lightning_loggers.py."""

from __future__ import annotations

import csv
import warnings

import pytest
import yaml

from tests.callbacks.test_trackers_base import (
    FakeClock,
    Recorder,
    StandIn,
    fit,
    make_loader,
    make_module,
    tracker_warnings,
)
from trainforge.callbacks.trackers import CSVLogger, FailurePolicy


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def logged_rows(recorder):
    """The LOG events as Lightning's ExperimentWriter writes them: the epoch an int, the values' repr."""
    return [
        {"step": str(step), **{k: str(int(v)) if k == "epoch" else repr(v) for k, v in metrics.items()}}
        for step, metrics in recorder.logged
    ]


def test_fit_writes_every_logged_value_with_a_header_that_grows(tmp_path):
    recorder, logger = Recorder(), CSVLogger()
    fit([recorder, logger], tmp_path, log_every=2)
    version_0 = tmp_path / "lightning_logs" / "version_0"
    assert logger.file == str(version_0 / "metrics.csv") and logger.log_dir == str(version_0)
    header, rows = read_csv(logger.file)
    # val/loss first appears after train/loss had rows: the header was extended (sorted), old rows kept.
    assert header == ["epoch", "step", "train/loss", "val/loss"]
    expected = [{**dict.fromkeys(header, ""), **r} for r in logged_rows(recorder)]
    assert rows == expected and len(rows) == len(recorder.logged) > 4
    assert [float(r["val/loss"]) for r in rows if r["val/loss"]] == [v for _, v in recorder.history("val/loss")]
    # Lightning's hparams.yaml: the module's hyperparameters (not the Trainer's settings)
    assert yaml.safe_load((version_0 / "hparams.yaml").read_text()) == {"lr": 0.05, "width": 4}
    assert (version_0 / "status.txt").read_text().strip() == "FINISHED"


def test_validate_after_fit_appends_to_the_same_file(tmp_path):
    recorder, logger = Recorder(), CSVLogger()
    trainer = fit([recorder, logger], tmp_path, max_epochs=1)
    header, rows = read_csv(logger.file)
    assert header == ["epoch", "step", "train/loss", "val/loss"] and len(rows) == len(recorder.logged) > 1
    trainer.validate(trainer.module, make_loader(16, 8, seed=2))  # the same logger: the same run
    _, after = read_csv(logger.file)
    assert after[:-1] == rows and float(after[-1]["val/loss"]) == recorder.logged[-1][1]["val/loss"]
    assert after[-1]["step"] == str(trainer.global_step)  # outside fit, Lightning's step is global_step
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]


def test_a_new_run_gets_a_new_version_and_a_failed_fit_is_marked(tmp_path):
    fit([CSVLogger()], tmp_path, max_epochs=1, val=False)
    first = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    with pytest.raises(RuntimeError, match="on purpose"):
        fit([CSVLogger()], tmp_path, module=make_module(fail_at_step=3), val=False)
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text() == first
    version_1 = tmp_path / "lightning_logs" / "version_1"
    _, rows = read_csv(version_1 / "metrics.csv")
    assert [r["step"] for r in rows] == ["0", "1", "2"]  # optimizer steps 1, 2, 3 at Lightning's steps
    assert (version_1 / "status.txt").read_text().strip() == "FAILED"
    assert not list(tmp_path.rglob("metrics.1.csv"))


def test_a_version_given_again_starts_its_file_afresh_as_lightning(tmp_path, caplog):
    fit([CSVLogger(version=0)], tmp_path, max_epochs=2, val=False)
    fit([CSVLogger(version=0)], tmp_path, max_epochs=1, val=False)
    _, rows = read_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    assert {r["epoch"] for r in rows} == {"0"} and "holds the metrics of an earlier run" in caplog.text


def test_resume_continues_the_same_file_without_the_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "logs" / "m.csv"
    first = CSVLogger(path=str(path))
    trainer = StandIn(tmp_path)
    first.on_fit_start(trainer, None)
    for step in range(1, 7):
        first.on_log(trainer, None, {"loss": step / 10}, step)
    state = first.state_dict()
    first.on_exception(trainer, None, RuntimeError("crash"))  # the process died after step 6

    # The resumed run configures the same file (where it writes comes from the run, not from the
    # checkpoint: tests/callbacks/test_tracker_run_paths.py); its root may be elsewhere.
    resumed = CSVLogger(path=str(path))
    resumed.load_state_dict(state)
    trainer = StandIn(tmp_path / "elsewhere", step=4)  # resuming the checkpoint of step 4
    resumed.on_fit_start(trainer, None)
    for step in range(5, 8):
        resumed.on_log(trainer, None, {"loss": step / 10, "acc": 0.5}, step)
    resumed.on_fit_end(trainer, None)
    header, rows = read_csv(path)
    assert header == ["acc", "loss", "step"]
    assert [(r["step"], r["loss"], r["acc"]) for r in rows] == [
        ("1", "0.1", ""),
        ("2", "0.2", ""),
        ("3", "0.3", ""),
        ("4", "0.4", ""),
        ("5", "0.5", "0.5"),
        ("6", "0.6", "0.5"),
        ("7", "0.7", "0.5"),
    ]
    # without a path, a resume elsewhere writes into its own run and leaves this file alone
    before = path.read_bytes()
    other = CSVLogger()
    other.load_state_dict(state)
    other.on_fit_start(StandIn(tmp_path / "other", step=4), None)
    other.on_fit_end(StandIn(tmp_path / "other", step=4), None)
    assert path.read_bytes() == before
    assert other.file == str(tmp_path / "other" / "lightning_logs" / "version_0" / "metrics.csv")


def test_disk_failure_does_not_stop_training_and_the_logger_recovers(tmp_path):
    logdir, saved = tmp_path / "logs", tmp_path / "saved"
    clock = FakeClock()
    logger = CSVLogger(path=str(logdir / "metrics.csv"), failure_policy=FailurePolicy(clock=clock))
    recorder = Recorder()

    def disk_trouble(step):  # called in training_step with the number of optimizer steps done
        if step == 3:  # the log directory becomes a file: every write raises NotADirectoryError
            logger.flush()
            logdir.rename(saved)
            logdir.write_text("not a directory")
        if step == 6:  # the disk is back; the back-off (1 s) has passed
            logger.flush()
            logdir.unlink()
            saved.rename(logdir)
            clock.now += 1.5

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit([recorder, logger], tmp_path, module=make_module(after_step=disk_trouble), val=False)
    messages = tracker_warnings(record)
    assert len(messages) == 2 and "CSVLogger" in messages[0] and "NotADirectoryError" in messages[0]
    _, rows = read_csv(logdir / "metrics.csv")
    written = [int(r["step"]) for r in rows]
    # optimizer steps 4-6 (Lightning's steps 3-5) failed or fell in the back-off
    assert written == [0, 1, 2] + list(range(6, 16))
    assert [float(r["train/loss"]) for r in rows] == [v for s, v in recorder.history("train/loss") if s in written]
    assert "CSVLogger: 6 metric value(s)" in messages[1]  # train/loss and epoch, 3 steps and "recovered" in messages[1]


HOLD_CSV = """
import sys
from trainforge.strategies.checkpoint.run_lock import acquire_run_lock
acquire_run_lock(sys.argv[1], name=".metrics.csv.lock")
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("resumed", [False, True])
def test_a_metrics_file_another_process_is_writing_is_never_moved_or_cut(tmp_path, resumed, caplog):
    import subprocess
    import sys

    from tests.helpers import procs
    from trainforge.callbacks.trackers.run_paths import claim

    # the file of another trainforge run (the version given again), which is still writing it
    held = tmp_path / "lightning_logs" / "version_0"
    other = "step,train/loss\n" + "".join(f"{s},0.5\n" for s in range(1, 9))
    claim([str(held / "metrics.csv")])
    (held / "metrics.csv").write_text(other)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CSV, str(held)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=procs.test_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        logger = CSVLogger(version=0)
        if resumed:
            # a resume at step 0 would drop every row after it from the file it writes
            logger.load_state_dict({"resumed": True})
        fit([logger], tmp_path, max_epochs=1, val=False)
    finally:
        holder.communicate("\n", timeout=30)
    assert (held / "metrics.csv").read_text() == other
    assert not list(tmp_path.rglob("metrics.1.csv"))
    assert logger.file == str(held / "csv_logger.1" / "metrics.csv")
    _, rows = read_csv(logger.file)
    assert rows and rows[0]["step"] == "0"
    assert "another process is writing" in caplog.text
