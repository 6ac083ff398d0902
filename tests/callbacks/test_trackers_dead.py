"""A dead tracker costs the loop nothing: real MLflow and Comet clients pointed at a closed port of
127.0.0.1 (nothing listens; nothing outside this machine is contacted), checkpoints saved every step.

Before the fix every save waited 30 s for the run to open and the end of fit 30 s more."""

from __future__ import annotations

import re
import socket
import time
import warnings

import pytest

from tests.callbacks.test_trackers_base import fit, tracker_warnings
from trainforge.callbacks import ModelCheckpoint
from trainforge.callbacks.trackers import FailurePolicy
from trainforge.strategies.errors import ConfigurationError


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connections are refused


def timed(cls):
    """``cls`` recording the seconds the training thread spends in its save hook and its end of run."""

    class Timed(cls):
        save_s, finish_s, saves = 0.0, 0.0, 0

        def state_dict(self):
            start = time.monotonic()
            try:
                return super().state_dict()
            finally:
                self.save_s += time.monotonic() - start
                self.saves += 1

        def _finish(self, status):
            start = time.monotonic()
            try:
                return super()._finish(status)
            finally:
                self.finish_s += time.monotonic() - start

    return Timed


def _fit(tmp_path, tracker):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit([tracker, ModelCheckpoint(every_n_steps=1, save_top_k=0, keep_last_k=1)], tmp_path, max_epochs=2)
    assert tracker.saves >= 16  # a checkpoint at every step
    return tracker_warnings(record)


def test_dead_mlflow_server_costs_the_loop_nothing(tmp_path):
    pytest.importorskip("mlflow")
    from trainforge.callbacks.trackers import MLflowLogger

    tracker = timed(MLflowLogger)(
        tracking_uri=f"http://127.0.0.1:{closed_port()}", failure_policy=FailurePolicy(flush_timeout_s=1.0)
    )
    messages = _fit(tmp_path, tracker)
    # the connection is refused at once: no save waits, and the end of the run has nothing to wait for
    assert tracker.save_s < 1.0 and tracker.finish_s < 1.0, (tracker.save_s, tracker.finish_s)
    assert any("cannot connect to the MLflow server" in m for m in messages), messages
    report = tracker.last_report
    assert report and "dropped" in report and "did not recover" in report
    assert int(re.search(r"(\d+) metric value", report).group(1)) > 0


def test_dead_comet_server_is_bounded_by_the_policy(tmp_path, monkeypatch):
    pytest.importorskip("comet_ml")
    from trainforge.callbacks.trackers import CometLogger

    monkeypatch.setenv("COMET_URL_OVERRIDE", f"http://127.0.0.1:{closed_port()}/clientlib/")
    monkeypatch.setenv("COMET_API_KEY", "not-a-real-key-0123456789")
    tracker = timed(CometLogger)(failure_policy=FailurePolicy(flush_timeout_s=1.0, open_wait_s=0.5))
    _fit(tmp_path, tracker)
    # at most one open wait (0.5 s) over all saves, and the bounded final flush, whatever Comet does
    assert tracker.save_s < 0.5 + 0.5 and tracker.finish_s < 1.0 + 0.5, (tracker.save_s, tracker.finish_s)
    assert tracker.last_report and "dropped" in tracker.last_report


@pytest.mark.parametrize("bad", [{"open_wait_s": -1}, {"open_wait_s": "2"}, {"flush_timeout_s": 0}])
def test_bad_wait_settings_name_the_value(bad):
    with pytest.raises(ConfigurationError, match=repr(list(bad.values())[0])):
        FailurePolicy(**bad)


def test_what_a_dead_server_could_not_take_is_kept_in_a_file_the_report_names(tmp_path):
    pytest.importorskip("mlflow")
    import json

    from trainforge.callbacks.trackers import MLflowLogger

    tracker = timed(MLflowLogger)(
        tracking_uri=f"http://127.0.0.1:{closed_port()}", failure_policy=FailurePolicy(flush_timeout_s=1.0)
    )
    _fit(tmp_path, tracker)
    assert tracker.finish_s < 3.0
    report = tracker.last_report
    spill = re.search(r"kept in (\S+\.jsonl)", report).group(1)
    assert spill.startswith(str(tmp_path)) and "log_batch" in report
    lines = [json.loads(line) for line in open(spill)]
    dropped = int(re.search(r"(\d+) metric value", report).group(1))
    assert sum(len(line["metrics"]) for line in lines) == dropped > 0
    assert all(isinstance(line["step"], int) for line in lines)


def test_a_spill_file_never_appends_to_a_file_it_did_not_create(tmp_path, monkeypatch):
    """Dropped values go to a file this call creates: a file already standing at the name is left as it is."""
    import os
    import time

    from trainforge.callbacks.trackers.base import _new_spill_file

    monkeypatch.setattr(time, "strftime", lambda fmt: "20261128-000000")
    theirs = tmp_path / f"mlflow-unsent-20261128-000000-{os.getpid()}.jsonl"
    theirs.write_text("someone else's\n")
    path = _new_spill_file(str(tmp_path), "mlflow")
    assert path == str(tmp_path / f"mlflow-unsent-20261128-000000-{os.getpid()}-1.jsonl")
    assert theirs.read_text() == "someone else's\n"
    assert _new_spill_file(str(tmp_path), "mlflow").endswith("-2.jsonl")
