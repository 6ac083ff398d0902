"""``Accelerator.log`` with a group of metrics (``{"glue": {"accuracy": 0.8}}``, as transformers' run_glue_no_trainer
logs) and ``init_trackers(config=...)``: written per tracker as Accelerate 1.15 writes them (issue 38, item 4).

Accelerate 1.15, recorded (system python, ``Accelerator(log_with="tensorboard", project_dir=d)``,
``init_trackers("proj", config={"lr": 0.1, "bs": 16, "name": "x", "flag": True})``,
``log({"glue": {"accuracy": 0.8, "f1": 0.7}, "train_loss": 1.0, "t": torch.tensor(2.0)}, step=3)``):
``d/proj/events.*`` holds ``train_loss`` and ``t`` at step 3; ``d/proj/glue_accuracy/events.*`` and
``d/proj/glue_f1/events.*`` hold the tag ``glue`` at step 3 (SummaryWriter.add_scalars); the hyperparameters are
an HParams session in ``d/proj/<time>/`` (``add_hparams``). trainforge writes them in ``d/proj`` itself, the run
the metrics are in. Comet gets the group's names unprefixed (``log_metrics(group)``), W&B the nested dict
(test_trackers_wandb.py); MLflow, which Accelerate gives only numbers (it drops the group with a warning), and
the CSV file get ``glue/accuracy``."""

from __future__ import annotations

import csv
import json
import zipfile

import pytest
import torch
import yaml

from tests.callbacks.test_trackers_base import mlflow_store
from trainforge import Accelerator

VALUES = {"glue": {"accuracy": 0.8, "f1": 0.7}, "train_loss": 1.0, "t": torch.tensor(2.0)}
CONFIG = {"lr": 0.1, "bs": 16, "name": "x", "flag": True}


def events(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_and_csv_write_a_group_as_accelerate(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = Accelerator(cpu=True, log_with=["tensorboard", "csv"], project_dir=str(tmp_path))
    acc.init_trackers("proj", config=CONFIG)
    acc.log(VALUES, step=3)
    acc.end_training()
    proj = tmp_path / "proj"
    assert sorted(p.name for p in proj.iterdir() if p.is_dir()) == ["glue_accuracy", "glue_f1"]
    main = events(proj)
    assert [(e.step, e.value) for e in main.Scalars("train_loss")] == [(3, 1.0)]
    assert [(e.step, e.value) for e in main.Scalars("t")] == [(3, 2.0)]
    for name, value in (("accuracy", 0.8), ("f1", 0.7)):
        group = events(proj / f"glue_{name}")
        assert group.Tags()["scalars"] == ["glue"]
        assert [(e.step, e.value) for e in group.Scalars("glue")] == [(3, pytest.approx(value))]
    start = plugin_data_pb2.HParamsPluginData.FromString(
        main.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info.hparams
    assert {k: v.number_value for k, v in start.items() if k in ("lr", "bs")} == {"lr": 0.1, "bs": 16}
    assert start["name"].string_value == "x" and start["flag"].number_value == 1  # torch writes a bool as 1
    (row,) = csv.DictReader(open(proj / "metrics.csv"))
    assert row == {"step": "3", "glue/accuracy": "0.8", "glue/f1": "0.7", "train_loss": "1.0", "t": "2.0"}
    assert yaml.safe_load(open(proj / "hparams.yaml")) == CONFIG


def test_mlflow_gets_the_group_flattened_and_the_config_as_params(tmp_path, tmp_path_factory):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = mlflow_store(tmp_path_factory, tmp_path / "mlflow.db")
    acc = Accelerator(cpu=True, log_with="mlflow", project_dir=str(tmp_path))
    acc.init_trackers("proj", config=CONFIG)
    acc.log(VALUES, step=3)
    acc.end_training()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.data.params == {k: str(v) for k, v in CONFIG.items()}
    assert run.data.metrics == pytest.approx({"glue/accuracy": 0.8, "glue/f1": 0.7, "train_loss": 1.0, "t": 2.0})


def test_comet_logs_the_groups_names_unprefixed_as_accelerate(tmp_path, monkeypatch):
    pytest.importorskip("comet_ml")
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # an offline archive goes to the working directory's comet/
    acc = Accelerator(cpu=True, log_with="comet_ml", project_dir=str(tmp_path))
    acc.init_trackers("proj", config=CONFIG, init_kwargs={"comet_ml": {"offline_directory": str(tmp_path / "c")}})
    acc.log(VALUES, step=3)
    acc.end_training()
    (archive,) = (tmp_path / "c").glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines() if line]
    metrics = {
        m["payload"]["metric"]["metricName"]: (m["payload"]["metric"]["step"], m["payload"]["metric"]["metricValue"])
        for m in messages
        if m["type"] == "metric_msg"
    }
    assert {k: (s, float(v)) for k, (s, v) in metrics.items() if k in ("accuracy", "f1", "train_loss", "t")} == {
        "accuracy": (3, pytest.approx(0.8)),
        "f1": (3, pytest.approx(0.7)),
        "train_loss": (3, 1.0),
        "t": (3, 2.0),
    }
    params = {
        m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"]
        for m in messages
        if m["type"] == "parameter_msg" and m["payload"]["param"]["source"] == "manual"
    }
    assert {k: params[k] for k in CONFIG} == {"lr": 0.1, "bs": 16, "name": "x", "flag": True}


def test_a_value_in_a_group_that_is_not_a_number_is_counted_as_dropped(tmp_path):
    acc = Accelerator(cpu=True, log_with="csv", project_dir=str(tmp_path))
    acc.init_trackers("proj")
    acc.log({"glue": {"accuracy": 0.5, "note": "best"}}, step=1)
    with pytest.warns(UserWarning, match=r"CSVLogger: 0 metric value\(s\).*and 1 other record"):
        acc.end_training()
    (row,) = csv.DictReader(open(tmp_path / "proj" / "metrics.csv"))
    assert row == {"step": "1", "glue/accuracy": "0.5"}
