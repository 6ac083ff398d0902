"""WandbLogger, offline only (``WANDB_MODE=offline``; the dead-server test points wandb at a closed port
of 127.0.0.1): a real fit's run file holds the config and the metric history, a resumed fit continues
the same run id, a dead server costs the loop no more than the failure policy allows, bad arguments are
refused before training.

The run file (``offline-run-*/run-<id>.wandb``) is read with wandb's own protobuf classes: a 7-byte
header, then LevelDB-log records (32 KiB blocks; crc32, length, type) each holding one ``Record``.
"""

from __future__ import annotations

import json
import re
import struct
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from tests.callbacks.test_trackers_base import Recorder, fit, make_loader, make_module, tracker_warnings
from tests.callbacks.test_trackers_dead import closed_port, timed
from trainforge.callbacks import ModelCheckpoint
from trainforge.callbacks.trackers import FailurePolicy, TrackerWarning, WandbLogger
from trainforge.callbacks.trackers.base import flatten_params
from trainforge.callbacks.trackers.experiment import NO_EXPERIMENT
from trainforge.strategies.errors import ConfigurationError

# what a test run needs of wandb: no system metrics, no code or git capture
QUIET = {"x_disable_stats": True, "x_disable_meta": True, "disable_git": True, "save_code": False}
# the first wandb.init of a process starts wandb's service: seconds on a busy machine, more than the
# default 5 s the end of a run waits for pending writes (the dead-server test keeps the default bounds)
PATIENT = FailurePolicy(flush_timeout_s=60)


@pytest.fixture(scope="module", autouse=True)
def needs_wandb():
    """Imported here, not at the top: collection would import wandb in every worker."""
    return pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def offline_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-default"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def read_run(path: Path, wait_s: float = 30.0) -> Tuple[str, Dict[str, object], List[Dict[str, float]]]:
    """(run id, config {key: value}, history rows) of one finished ``.wandb`` file. Offline,
    ``run.finish()`` returns before wandb's service has written the file out: wait for its exit record."""
    deadline = time.monotonic() + wait_s
    while True:
        run_id, config, rows, ended = parse_run(path)
        if ended is not None or time.monotonic() > deadline:
            return run_id, config, rows
        time.sleep(0.05)


def parse_run(path: Path) -> Tuple[str, Dict[str, object], List[Dict[str, float]], Optional[int]]:
    """As ``read_run``, plus the run's exit code (None while it has none)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, ended = path.read_bytes(), 32768, None
    if len(data) < 7:  # not written out yet
        return "", {}, [], None
    assert data[:4] == b":W&B", data[:7]
    pos, buf, run_id, config, rows = 7, b"", "", {}, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind not in (1, 4):  # FIRST/MIDDLE: the record goes on in the next block
            continue
        record = pb.Record()
        record.ParseFromString(buf)
        buf = b""
        which = record.WhichOneof("record_type")
        if which == "run":
            run_id = record.run.run_id
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif which == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif which == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        if which == "exit":
            ended = record.exit.exit_code
    return run_id, config, rows, ended


def run_files(save_dir: Path) -> List[Path]:
    return sorted((save_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def fit_from(callbacks, root: Path, max_epochs: int, ckpt_path=None) -> None:
    from trainforge import Trainer

    trainer = Trainer(
        default_root_dir=str(root),
        max_epochs=max_epochs,
        log_every_n_steps=1,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    trainer.fit(make_module(), make_loader(16), ckpt_path=ckpt_path)


def history(rows: List[Dict[str, float]], name: str) -> List[Tuple[int, float]]:
    return [(int(r["trainer/global_step"]), r[name]) for r in rows if name in r]


def test_offline_fit_writes_the_config_and_the_metric_history(tmp_path):
    recorder, logger = (
        Recorder(),
        WandbLogger(project="tiny", name="first", offline=True, settings=QUIET, failure_policy=PATIENT),
    )
    trainer = fit([recorder, logger], tmp_path, log_every=2)
    files = run_files(tmp_path)  # save_dir "." is the run's default_root_dir
    assert len(files) == 1 and logger.version and files[0].name == f"run-{logger.version}.wandb"
    run_id, config, rows = read_run(files[0])
    assert run_id == logger.version and logger.save_dir == str(tmp_path)
    expected = flatten_params(trainer.hparams)
    assert expected and {k: config[k] for k in expected} == expected
    for name in ("train/loss", "val/loss"):
        assert sorted(history(rows, name)) == sorted(recorder.history(name)) != []
    with pytest.warns(TrackerWarning, match="the backend is not open"):
        assert logger.experiment is NO_EXPERIMENT  # the run was finished with the fit


def test_resume_continues_the_same_run_and_a_foreign_state_starts_a_new_one(tmp_path, caplog):
    def tracker():
        return WandbLogger(project="tiny", settings=QUIET, failure_policy=PATIENT)

    first = tracker()
    fit_from([first, ModelCheckpoint(save_top_k=-1)], tmp_path, max_epochs=1)
    ckpt = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
    resumed, recorder = tracker(), Recorder()
    fit_from([recorder, resumed, ModelCheckpoint(save_top_k=-1)], tmp_path, max_epochs=2, ckpt_path=str(ckpt))
    assert resumed.version == first.version
    files = run_files(tmp_path)
    assert len(files) == 2 and {read_run(f)[0] for f in files} == {first.version}  # `wandb sync` appends them
    _, _, rows = read_run(max(files, key=lambda f: f.parent.name))
    # the second file continues after the checkpoint of step 4 (its next step is Lightning's step 4)
    assert min(s for s, _ in history(rows, "train/loss")) == 4

    other = WandbLogger(
        project="another", settings=QUIET, failure_policy=PATIENT
    )  # the checkpoint's run belongs to project "tiny"
    fit_from([other], tmp_path / "other", max_epochs=1, ckpt_path=str(ckpt))
    assert other.version != first.version and "is not continued" in caplog.text


def test_a_save_dir_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    steps = Recorder()
    # accepted, and the whole run logged nothing
    with pytest.raises(
        ConfigurationError, match=r"WandbLogger\(save_dir='notes.txt'\): .*notes.txt is a file, not a folder"
    ):
        fit([steps, WandbLogger(save_dir="notes.txt", settings=QUIET, failure_policy=PATIENT)], tmp_path)
    assert not steps.history("train/loss")


def test_a_fit_that_raises_ends_its_run_as_failed(tmp_path):
    logger = WandbLogger(settings=QUIET, failure_policy=PATIENT)
    with pytest.raises(RuntimeError, match="on purpose"):
        fit([logger], tmp_path, module=make_module(fail_at_step=2), val=False)
    (file,) = run_files(tmp_path)
    read_run(file)
    assert parse_run(file)[3] == 1


def test_the_tracker_draws_nothing_from_the_runs_random_generators(tmp_path):
    """Exact resume: the run id comes from ``secrets``, and wandb (offline) uses no global RNG."""
    import random

    import numpy as np
    import torch

    from trainforge import seed_everything

    def after(callbacks, root):
        seed_everything(0)
        module = make_module()
        fit(callbacks, root, module=module, max_epochs=1, val=False)
        return random.random(), float(np.random.rand()), float(torch.rand(1)), module.net.weight.tolist()

    with_wandb = after([WandbLogger(settings=QUIET, failure_policy=PATIENT)], tmp_path / "a")
    assert with_wandb == after([], tmp_path / "b")


def test_a_run_id_from_a_checkpoint_is_data(tmp_path):
    logger = WandbLogger(project="tiny", settings=QUIET, failure_policy=PATIENT)
    logger.load_state_dict({"id": "../../elsewhere", "project": "tiny"})
    fit([logger], tmp_path, max_epochs=1, val=False)
    assert logger.version and logger.version != "../../elsewhere"
    assert [f.parent.parent.parent for f in run_files(tmp_path)] == [tmp_path]


def test_a_run_of_the_users_is_logged_to_with_the_prefix_and_left_open(tmp_path):
    import wandb

    run = wandb.init(project="mine", dir=str(tmp_path), mode="offline", reinit="create_new", settings=QUIET)
    logger = WandbLogger(experiment=run, prefix="tf", failure_policy=PATIENT)
    recorder = Recorder()
    fit([recorder, logger], tmp_path / "fit", max_epochs=1)
    assert logger.version == run.id
    run.log({"user/after_fit": 1.0})  # the user's run is still open: the user finishes it
    run.finish()
    (file,) = run_files(tmp_path)
    rows = read_run(file)[2]
    assert history(rows, "tf-train/loss") == recorder.history("train/loss") != []
    assert any("user/after_fit" in r for r in rows)


def test_a_dead_server_is_bounded_by_the_policy_and_the_key_never_shows(tmp_path, monkeypatch):
    key = "0123456789abcdef0123456789abcdefSECRET99"
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    tracker = timed(WandbLogger)(settings=QUIET, failure_policy=FailurePolicy(flush_timeout_s=1.0, open_wait_s=0.5))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit([tracker, ModelCheckpoint(every_n_steps=1, save_top_k=0, keep_last_k=1)], tmp_path)
    messages = tracker_warnings(record)
    assert tracker.saves >= 16 and tracker.save_s < 1.0 and tracker.finish_s < 1.5, (tracker.save_s, tracker.finish_s)
    assert any("cannot connect to the W&B server 127.0.0.1" in m for m in messages), messages
    report = tracker.last_report
    assert report and "did not recover" in report and int(re.search(r"(\d+) metric value", report).group(1)) > 0
    assert not any(key in m for m in messages) and key not in repr(tracker)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"log_model": True}, r"log_model=True\) is not supported.*MLflowLogger\(log_checkpoints=True\)"),
        ({"log_model": "all"}, r"log_model='all'\) is not supported"),
        ({"anonymous": True}, r"anonymous=True\) is not supported"),
        ({"project": 3}, r"project=3\): project must be a non-empty string"),
        ({"save_dir": 3}, r"save_dir=3\): save_dir must be a path"),
        ({"save_dir": "a", "dir": "b"}, r"save_dir='a', dir='b'\): they are the same setting"),
        ({"version": "x1", "id": "x2"}, r"version='x1', id='x2'\): they are the same setting"),
        ({"id": "a/b"}, r"a W&B run id holds letters"),
        ({"offline": "yes"}, r"offline='yes'\) must be True or False"),
        ({"prefix": None}, r"prefix=None\) must be a string"),
        ({"entitty": "me"}, r"WandbLogger\(entitty=...\): not an argument.*entity, notes"),
        ({"resume": "must"}, r"'resume' is set by WandbLogger from version=/id="),
        ({"settings": 1}, r"settings=1\) must be a dict or a wandb.Settings"),
        ({"mode": "dryrun-ish"}, r"mode='dryrun-ish'\) must be 'online', 'offline'"),
        ({"experiment": object()}, r"must be a wandb Run"),
    ],
)
def test_bad_arguments_are_refused_before_training(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        WandbLogger(**kwargs)


def test_the_init_keywords_passed_on_are_wandb_inits():
    import inspect

    import wandb

    from trainforge.callbacks.trackers.wandb import INIT_KWARGS

    assert set(INIT_KWARGS) <= set(inspect.signature(wandb.init).parameters)


def test_accelerator_log_with_wandb(tmp_path):
    from trainforge import Accelerator

    acc = Accelerator(cpu=True, log_with="wandb", project_dir=str(tmp_path))
    acc.init_trackers(
        "acc-project",
        config={"lr": 0.5},
        init_kwargs={"wandb": {"settings": QUIET, "tags": ["t"], "failure_policy": PATIENT}},
    )
    for step in range(3):
        acc.log({"loss": 1.0 / (step + 1)}, step=step)
    tracker = acc.get_tracker("wandb")
    assert tracker.experiment.id == tracker.version  # the wandb Run, while the run lasts
    acc.end_training()
    assert isinstance(tracker, WandbLogger) and tracker.project == "acc-project"
    (file,) = run_files(tmp_path)  # the logging directory is the Accelerator's project_dir
    run_id, config, rows = read_run(file)
    assert run_id == tracker.version and config["lr"] == 0.5
    assert history(rows, "loss") == [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]


def test_accelerator_log_passes_a_group_to_wandb_as_a_nested_dict(tmp_path):
    """Accelerate's WandBTracker calls ``run.log(values)`` with the group as it is: W&B gets the nested dict
    and stores it as nested keys (["glue", "accuracy"]; shown as glue.accuracy). Before issue 38 the group was dropped."""
    from trainforge import Accelerator

    acc = Accelerator(cpu=True, log_with="wandb", project_dir=str(tmp_path))
    acc.init_trackers("acc-project", init_kwargs={"wandb": {"settings": QUIET, "failure_policy": PATIENT}})
    acc.log({"glue": {"accuracy": 0.75, "f1": 0.5}, "train_loss": 1.0}, step=2)
    acc.end_training()
    (file,) = run_files(tmp_path)
    _, _, rows = read_run(file)
    (row,) = rows  # wandb stores a nested dict as nested keys (parse_run joins them with "/")
    assert (row["glue/accuracy"], row["glue/f1"], row["train_loss"], row["trainer/global_step"]) == (0.75, 0.5, 1, 2)
