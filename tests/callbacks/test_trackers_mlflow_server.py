"""MLflowLogger against a real ``mlflow server`` process on 127.0.0.1, healthy and killed mid-run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings

import pytest

from tests.callbacks.test_trackers_base import Recorder, fit, make_module, mlflow_store, tracker_warnings
from trainforge.callbacks.trackers import FailurePolicy, MLflowLogger
from trainforge.callbacks.trackers.base import flatten_params

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 90  # ~10 s on an idle machine; a busy shared one is much slower


@pytest.fixture(scope="module", autouse=True)
def needs_mlflow():
    """Imported here, not at the top: collection would import mlflow in every worker."""
    return pytest.importorskip("mlflow")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlflow server`` with its SQLite backend in ``root``, on a free port of 127.0.0.1."""

    def __init__(self, root, tmp_path_factory):
        self.root = root
        self.backend = mlflow_store(tmp_path_factory, root / "server.db")  # already migrated: faster start
        self.url, self.proc = "", None

    def start(self) -> None:
        port = free_port()
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no background job workers
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            self.backend,
            "--default-artifact-root",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ]
        with open(self.root / "server.log", "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(
                    f"mlflow server did not answer /health within {START_TIMEOUT_S}s:\n"
                    f"{(self.root / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.25)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the uvicorn worker it started
        if self.proc is not None:
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def _servers():
    started = []
    try:
        yield started
    finally:
        for server in started:
            server.kill()


@pytest.fixture
def server(_servers, tmp_path_factory):
    """A running server, shared by the tests of this file until one of them kills it (starting one
    takes seconds)."""
    if not _servers or not _servers[-1].alive:
        _servers.append(Server(tmp_path_factory.mktemp("mlflow-server"), tmp_path_factory))
        _servers[-1].start()
    return _servers[-1]


@pytest.fixture
def fail_fast(monkeypatch):
    """MLflow's own HTTP retries (7, about 4 minutes) would hold each write to a dead server that long
    on the writer thread; the tracker's failure policy does the retrying, so switch them off."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def test_fit_logs_to_a_real_tracking_server(tmp_path, server, fail_fast):
    from mlflow.tracking import MlflowClient

    recorder, logger = Recorder(), MLflowLogger(tracking_uri=server.url, experiment_name="served")
    trainer = fit([recorder, logger], tmp_path, max_epochs=1)
    client = MlflowClient(tracking_uri=server.url)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and logger.last_report is None
    assert run.data.params == {k: str(v) for k, v in flatten_params(trainer.hparams).items()}
    for key in ("train/loss", "val/loss"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, key))
        assert got == sorted(recorder.history(key)) != []


def test_server_killed_mid_run_training_finishes_and_the_drop_is_reported(tmp_path, server, fail_fast):
    from mlflow.tracking import MlflowClient

    policy = FailurePolicy(initial_backoff_s=0.2, flush_timeout_s=15)
    logger = MLflowLogger(tracking_uri=server.url, failure_policy=policy)
    recorder = Recorder()

    def kill_at_step_5(step):
        if step == 5:
            assert logger.flush(30)  # steps 1-5 are on the server
            server.kill()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit([recorder, logger], tmp_path, module=make_module(after_step=kill_at_step_5))
    assert trainer.global_step == 16  # training went on to the end
    messages = tracker_warnings(record)
    assert len(messages) == 2, messages
    assert messages[0].startswith("MLflowLogger: writing to the tracker failed") and server.url in messages[0]
    # What reached the server, read from its database directly (the server is gone).
    store = MlflowClient(tracking_uri=server.backend)
    written = {
        (key, m.step, m.value)
        for key in ("train/loss", "val/loss", "epoch")
        for m in store.get_metric_history(logger.run_id, key)
    }
    logged = {(key, step, value) for step, metrics in recorder.logged for key, value in metrics.items()}
    # optimizer steps 1-5, logged at Lightning's steps 0-4
    assert written == {x for x in logged if x[1] <= 4} and written
    dropped = sum(len(metrics) for step, metrics in recorder.logged if step > 4)  # every value after the kill
    assert dropped > 10 and f"MLflowLogger: {dropped} metric value(s)" in messages[1]
    assert "did not recover" in messages[1]
    assert store.get_run(logger.run_id).info.status == "RUNNING"  # could not be closed
