"""CSVLogger: file content read back after a real fit; new columns, resume, rotation, disk failure."""

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
    return [{"step": str(step), **{k: repr(v) for k, v in metrics.items()}} for step, metrics in recorder.logged]


def test_fit_writes_every_logged_value_with_a_header_that_grows(tmp_path):
    recorder, logger = Recorder(), CSVLogger()
    trainer = fit([recorder, logger], tmp_path, log_every=2)
    assert logger.file == str(tmp_path / "metrics.csv")
    header, rows = read_csv(logger.file)
    # val/loss first appears after train/loss had rows: the header was extended, old rows kept.
    assert header == ["step", "train/loss", "val/loss"]
    expected = [{**dict.fromkeys(header, ""), **r} for r in logged_rows(recorder)]
    assert rows == expected and len(rows) == len(recorder.logged) > 4
    assert [float(r["val/loss"]) for r in rows if r["val/loss"]] == [v for _, v in recorder.history("val/loss")]
    assert yaml.safe_load((tmp_path / "hparams.yaml").read_text()) == yaml.safe_load(yaml.safe_dump(trainer.hparams))
    assert (tmp_path / "status.txt").read_text().strip() == "FINISHED"


def test_trainer_installs_csv_by_default_and_validate_appends_to_the_same_file(tmp_path):
    recorder = Recorder()
    trainer = fit([recorder], tmp_path, max_epochs=1)
    assert [type(c).__name__ for c in trainer.callbacks].count("CSVLogger") == 1
    header, rows = read_csv(tmp_path / "metrics.csv")
    assert header == ["step", "train/loss", "val/loss"] and len(rows) == len(recorder.logged) > 1
    trainer.validate(trainer.module, make_loader(16, 8, seed=2))  # the same logger: the same run
    _, after = read_csv(tmp_path / "metrics.csv")
    assert after[:-1] == rows and float(after[-1]["val/loss"]) == recorder.logged[-1][1]["val/loss"]
    assert not (tmp_path / "metrics.1.csv").exists()


def test_a_new_run_keeps_the_previous_file_and_a_failed_fit_is_marked(tmp_path):
    fit([CSVLogger()], tmp_path, max_epochs=1, val=False)
    first = (tmp_path / "metrics.csv").read_text()
    with pytest.raises(RuntimeError, match="on purpose"):
        fit([CSVLogger()], tmp_path, module=make_module(fail_at_step=3), val=False)
    assert (tmp_path / "metrics.1.csv").read_text() == first
    _, rows = read_csv(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert (tmp_path / "status.txt").read_text().strip() == "FAILED"


def test_resume_continues_the_same_file_without_the_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "logs" / "m.csv"
    first = CSVLogger(str(path))
    trainer = StandIn(tmp_path)
    first.on_fit_start(trainer, None)
    for step in range(1, 7):
        first.on_log(trainer, None, {"loss": step / 10}, step)
    state = first.state_dict()
    first.on_exception(trainer, None, RuntimeError("crash"))  # the process died after step 6

    # The resumed run configures the same file (where it writes comes from the run, not from the
    # checkpoint: tests/callbacks/test_tracker_run_paths.py); its root may be elsewhere.
    resumed = CSVLogger(str(path))
    resumed.load_state_dict(state)
    trainer = StandIn(tmp_path / "elsewhere", step=4)  # resuming the checkpoint of step 4
    resumed.on_fit_start(trainer, None)
    for step in range(5, 8):
        resumed.on_log(trainer, None, {"loss": step / 10, "acc": 0.5}, step)
    resumed.on_fit_end(trainer, None)
    header, rows = read_csv(path)
    assert header == ["step", "loss", "acc"]
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
    assert path.read_bytes() == before and other.file == str(tmp_path / "other" / "metrics.csv")


def test_disk_failure_does_not_stop_training_and_the_logger_recovers(tmp_path):
    logdir, saved = tmp_path / "logs", tmp_path / "saved"
    clock = FakeClock()
    logger = CSVLogger(str(logdir / "metrics.csv"), failure_policy=FailurePolicy(clock=clock))
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
    assert written == [1, 2, 3] + list(range(7, 17))  # steps 4-6 failed or fell in the back-off
    assert [float(r["train/loss"]) for r in rows] == [v for s, v in recorder.history("train/loss") if s in written]
    assert "CSVLogger: 3 metric value(s)" in messages[1] and "recovered" in messages[1]


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

    # the file of another trainforge run, which is still writing it
    other = "step,train/loss\n" + "".join(f"{s},0.5\n" for s in range(1, 9))
    claim([str(tmp_path / "metrics.csv")])
    (tmp_path / "metrics.csv").write_text(other)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CSV, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=procs.test_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        logger = CSVLogger()
        if resumed:
            # a resume at step 0 would drop every row after it from the file it writes
            logger.load_state_dict({"resumed": True})
        fit([logger], tmp_path, max_epochs=1, val=False)
    finally:
        holder.communicate("\n", timeout=30)
    assert (tmp_path / "metrics.csv").read_text() == other
    assert not (tmp_path / "metrics.1.csv").exists()
    assert logger.file == str(tmp_path / "csv_logger.1" / "metrics.csv")
    _, rows = read_csv(logger.file)
    assert rows and rows[0]["step"] == "1"
    assert "another process is writing" in caplog.text
