"""MLflowLogger against the embedded SQLite store: read back with MlflowClient after real fits."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import pytest

from tests.callbacks.test_trackers_base import Recorder, StandIn, fit, make_loader, make_module, mlflow_store
from trainforge.callbacks.trackers import MLflowLogger
from trainforge.callbacks.trackers.base import flatten_params
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


@pytest.fixture(scope="module", autouse=True)
def needs_mlflow():
    """Imported here, not at the top: collection would import mlflow in every worker."""
    return pytest.importorskip("mlflow")


@pytest.fixture
def store(tmp_path, tmp_path_factory):
    """The default store location of a run under tmp_path, holding a blank store (see mlflow_store)."""
    return mlflow_store(tmp_path_factory, tmp_path / "mlflow.db")


def client_for(root) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")


def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_fit_logs_params_and_metric_history_to_the_default_sqlite_store(tmp_path, store):
    recorder, logger = Recorder(), MLflowLogger(run_name="tiny", tags={"team": "infra"})
    trainer = fit([recorder, logger], tmp_path, log_every=2)
    client = client_for(tmp_path)
    experiment = client.get_experiment_by_name("trainforge")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [logger.run_id]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny" and run.data.tags["team"] == "infra"
    assert run.info.artifact_uri.startswith((tmp_path / "mlruns").as_uri())
    assert run.data.params == {k: str(v) for k, v in flatten_params(trainer.hparams).items()}
    for key in ("train/loss", "val/loss"):
        assert history(client, run.info.run_id, key) == sorted(recorder.history(key)) != []


def test_resume_from_a_checkpoint_continues_the_same_run(tmp_path, store):
    """A real resume: the checkpoint carries the logger's state; the new logger appends to that run."""
    from trainforge import Trainer

    first, second = MLflowLogger(), MLflowLogger()
    for logger, epochs, ckpt in ((first, 1, None), (second, 2, "last")):
        trainer = Trainer(
            max_epochs=epochs,
            log_every_n_steps=1,
            callbacks=[logger],
            default_root_dir=str(tmp_path),
            enable_progress_bar=False,
        )
        trainer.fit(make_module(), make_loader(), ckpt_path=ckpt)
    assert second.run_id == first.run_id
    client = client_for(tmp_path)
    assert len(client.search_runs([client.get_experiment_by_name("trainforge").experiment_id])) == 1
    # 16 optimizer steps at Lightning's steps (the steps taken before each one's own)
    assert [s for s, _ in history(client, first.run_id, "train/loss")] == list(range(16))
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_state_dict_to_a_new_logger_appends_to_the_same_run(tmp_path, store):
    trainer = StandIn(tmp_path)
    first = MLflowLogger()
    first.on_fit_start(trainer, None)
    first.on_log(trainer, None, {"loss": 1.0}, 1)
    state = first.state_dict()
    first.on_fit_end(trainer, None)
    second = MLflowLogger()
    second.load_state_dict(state)
    second.on_fit_start(StandIn(tmp_path, step=1, hparams={"lr": 0.1, "new": "x"}), None)
    second.on_log(trainer, None, {"loss": 0.5}, 2)
    second.on_fit_end(trainer, None)
    assert second.run_id == state["run_id"]
    run = client_for(tmp_path).get_run(state["run_id"])
    assert history(client_for(tmp_path), state["run_id"], "loss") == [(1, 1.0), (2, 0.5)]
    assert run.data.params == {"lr": "0.1", "model/width": "4", "new": "x"}


def test_exception_marks_the_run_failed_and_checkpoints_are_uploaded(tmp_path, store):
    logger = MLflowLogger(log_checkpoints=True)
    from trainforge import Trainer

    trainer = Trainer(
        max_epochs=3, log_every_n_steps=1, callbacks=[logger], default_root_dir=str(tmp_path), enable_progress_bar=False
    )
    with pytest.raises(RuntimeError, match="on purpose"):
        trainer.fit(make_module(fail_at_step=12), make_loader())
    client = client_for(tmp_path)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FAILED"
    uploaded = [a.path for a in client.list_artifacts(logger.run_id, "checkpoints")]
    assert uploaded == ["checkpoints/epoch=0-step=8"]
    files = {a.path.rsplit("/", 1)[1] for a in client.list_artifacts(logger.run_id, uploaded[0])}
    assert {"model.safetensors", "metadata.json"} <= files


def test_a_replaced_checkpoint_is_uploaded_only_once_the_new_one_is_in_place(tmp_path, store):
    logger, trainer = MLflowLogger(log_checkpoints=True), StandIn(tmp_path)
    ckpt = tmp_path / "checkpoints" / "last"
    ckpt.mkdir(parents=True)
    (ckpt / "weights.txt").write_text("old")
    logger.on_fit_start(trainer, None)
    logger.on_save_checkpoint(trainer, None, {"path": str(ckpt)})  # "last" is about to be replaced
    logger.on_train_batch_end(trainer, None, None, None, 0)
    assert logger.flush(30)
    client = client_for(tmp_path)
    assert client.list_artifacts(logger.run_id) == []  # the old directory was not uploaded
    staging = tmp_path / "checkpoints" / ".last.partial"
    staging.mkdir()
    (staging / "weights.txt").write_text("new")
    shutil.rmtree(ckpt)
    staging.rename(ckpt)
    logger.on_train_batch_end(trainer, None, None, None, 1)
    logger.on_fit_end(trainer, None)
    local = client.download_artifacts(logger.run_id, "checkpoints/last/weights.txt", str(tmp_path / "dl"))
    assert open(local).read() == "new"


def test_params_are_flattened_cleaned_and_truncated(tmp_path, tmp_path_factory):
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    uri = mlflow_store(tmp_path_factory, tmp_path / "other.db")
    hparams = {
        "opt": {"name": "adamw", "betas": (0.9, 0.95)},
        "long": "x" * (MAX_PARAM_VAL_LENGTH + 10),
        "weird key?": 1,
        "none": None,
    }
    logger = MLflowLogger(tracking_uri=uri, experiment_name="exp")
    trainer = StandIn(tmp_path, hparams=hparams)
    logger.on_fit_start(trainer, None)
    logger.on_fit_end(trainer, None)
    params = MlflowClient(uri).get_run(logger.run_id).data.params
    assert params == {
        "opt/name": "adamw",
        "opt/betas": "(0.9, 0.95)",
        "long": "x" * MAX_PARAM_VAL_LENGTH,
        "weird key_": "1",
        "none": "None",
    }
    assert logger.last_report is None  # nothing failed, nothing dropped


def test_two_loggers_in_one_process_do_not_interfere(tmp_path, tmp_path_factory):
    from mlflow.tracking import MlflowClient

    a = MLflowLogger(tracking_uri=mlflow_store(tmp_path_factory, tmp_path / "a.db"), experiment_name="a")
    b = MLflowLogger(tracking_uri=mlflow_store(tmp_path_factory, tmp_path / "b.db"), experiment_name="b")
    recorder = Recorder()
    fit([recorder, a, b], tmp_path, max_epochs=1, val=False)
    for logger, db in ((a, "a.db"), (b, "b.db")):
        client = MlflowClient(f"sqlite:///{tmp_path}/{db}")
        assert history(client, logger.run_id, "train/loss") == recorder.history("train/loss")
    assert a.run_id != b.run_id


def test_bad_arguments_are_rejected_with_the_value():
    with pytest.raises(ConfigurationError, match="experiment_name=''"):
        MLflowLogger(experiment_name="")
    with pytest.raises(ConfigurationError, match=r"tags=\['x'\]"):
        MLflowLogger(tags=["x"])
    # refused at once: an integer URI would fail deep inside MLflow
    for uri in (5000, "", ["http://127.0.0.1:5000"]):
        with pytest.raises(ConfigurationError, match=r"tracking_uri=.* must be a URI string"):
            MLflowLogger(tracking_uri=uri)


def test_experiment_is_the_mlflow_client_during_fit(tmp_path, store):
    """Lightning's ``MLFlowLogger.experiment``: the MlflowClient (with ``logger.run_id``)."""
    from mlflow.tracking import MlflowClient

    from trainforge.callbacks import Callback

    logger, seen = MLflowLogger(), []

    class Grab(Callback):
        def on_train_end(self, trainer, module):
            seen.append(module.logger.experiment)
            module.logger.experiment.set_tag(logger.run_id, "from_experiment", "yes")

    fit([logger, Grab()], tmp_path)
    assert isinstance(seen[0], MlflowClient)
    assert client_for(tmp_path).get_run(logger.run_id).data.tags["from_experiment"] == "yes"


class SlowToOpen(MLflowLogger):
    """The embedded store of a loaded machine: opening it takes longer than the end-of-run flush."""

    def _open(self):
        import time

        time.sleep(2.5 * self.failure_policy.flush_timeout_s)
        super()._open()


def test_a_slow_local_store_keeps_every_value(tmp_path, store):
    from trainforge.callbacks.trackers import FailurePolicy

    recorder = Recorder()
    logger = SlowToOpen(failure_policy=FailurePolicy(flush_timeout_s=0.4, open_wait_s=0))
    fit([recorder, logger], tmp_path, log_every=1)
    assert logger.dropped_values == 0 and logger.last_report is None
    client = client_for(tmp_path)
    for key in ("train/loss", "val/loss"):
        assert history(client, logger.run_id, key) == sorted(recorder.history(key)) != []
    assert client.get_run(logger.run_id).info.status == "FINISHED"
