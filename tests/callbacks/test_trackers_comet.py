"""CometLogger offline: the archive written by a real fit holds the metrics and parameters; the API
key never shows up anywhere."""

from __future__ import annotations

import json
import logging
import warnings
import zipfile
from pathlib import Path

import pytest

from tests.callbacks.test_trackers_base import Recorder, StandIn, fit, tracker_warnings
from trainforge.callbacks.trackers import CometLogger
from trainforge.callbacks.trackers.base import flatten_params
from trainforge.strategies.errors import ConfigurationError

SECRET = "tfk-SENTINEL-0123456789abcdefXYZ"


@pytest.fixture(scope="module", autouse=True)
def needs_comet_ml():
    """Imported here, not at the top: collection would import comet_ml (and IPython) in every worker."""
    return pytest.importorskip("comet_ml")


def read_archive(path: Path):
    """(metrics [(name, step, value)], params {name: value}, others {name: value}, raw text)."""
    with zipfile.ZipFile(path) as archive:
        raw = "".join(archive.read(n).decode("utf-8", "replace") for n in archive.namelist())
        messages = [json.loads(line) for line in archive.read("messages.json").decode().splitlines() if line]
    metrics, params, others = [], {}, {}
    for msg in messages:
        payload = msg["payload"]
        if msg["type"] == "metric_msg":
            m = payload["metric"]
            metrics.append((m["metricName"], m["step"], m["metricValue"]))
        elif msg["type"] == "parameter_msg" and payload["param"]["source"] == "manual":
            params[payload["param"]["paramName"]] = payload["param"]["paramValue"]
        elif msg["type"] == "log_other":
            others[payload["key"]] = payload["value"]
    return metrics, params, others, raw


def test_offline_fit_writes_an_archive_with_the_metrics_and_params(tmp_path, monkeypatch):
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    recorder, logger = Recorder(), CometLogger(project_name="tiny")
    assert logger.offline  # no key anywhere: offline is the default
    trainer = fit([recorder, logger], tmp_path, log_every=2)
    archives = list((tmp_path / "comet").glob("*.zip"))
    assert [a.stem for a in archives] == [logger.experiment_key]
    metrics, params, _, _ = read_archive(archives[0])
    for name in ("train/loss", "val/loss"):
        assert sorted((s, v) for n, s, v in metrics if n == name) == sorted(recorder.history(name)) != []
    expected = flatten_params(trainer.hparams)
    assert {k: params[k] for k in expected} == dict(expected)


def test_the_api_key_is_never_shown(tmp_path, monkeypatch, capfd, caplog):
    monkeypatch.setenv("COMET_API_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    logger = CometLogger(offline=True, offline_directory=str(tmp_path / "archives"))
    online = CometLogger(project_name="p")
    assert not online.offline and logger.offline  # a key selects online mode unless offline=True
    trainer = StandIn(tmp_path, hparams={"lr": 0.1, "token": SECRET})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        logger.on_fit_start(trainer, None)
        logger.on_log(trainer, None, {"loss": 0.5}, 1)
        state = logger.state_dict()
        logger.on_exception(trainer, None, RuntimeError("x"))
    (archive,) = (tmp_path / "archives").glob("*.zip")
    metrics, params, others, raw = read_archive(archive)
    assert ("loss", 1, 0.5) in metrics and params["token"] == "***" and others["trainforge_status"] == "FAILED"
    captured = capfd.readouterr()
    shown = [
        repr(logger),
        repr(online),
        str(state),
        raw,
        captured.out,
        captured.err,
        caplog.text,
        *tracker_warnings(record),
    ]
    assert "api_key=<set>" in repr(online)
    assert all(SECRET not in text for text in shown)


def test_resume_continues_the_same_experiment_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    first = CometLogger()
    trainer = StandIn(tmp_path)
    first.on_fit_start(trainer, None)
    first.on_log(trainer, None, {"loss": 1.0}, 1)
    state = first.state_dict()
    first.on_fit_end(trainer, None)
    second = CometLogger()
    second.load_state_dict(state)
    second.on_fit_start(StandIn(tmp_path, step=1), None)
    second.on_log(trainer, None, {"loss": 0.5}, 2)
    second.on_fit_end(trainer, None)
    assert second.experiment_key == first.experiment_key
    archives = sorted((tmp_path / "comet").glob("*.zip"), key=lambda p: len(p.name))
    assert len(archives) == 2 and all(a.name.startswith(first.experiment_key) for a in archives)
    steps = [[(s, v) for n, s, v in read_archive(a)[0] if n == "loss"] for a in archives]
    assert steps == [[(1, 1.0)], [(2, 0.5)]]


def test_online_without_a_key_is_a_configuration_error(monkeypatch):
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match=r"offline=False.*COMET_API_KEY"):
        CometLogger(offline=False)
