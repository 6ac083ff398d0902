"""A checkpoint's tracker state is data, never an instruction (callbacks/trackers/run_paths.py): a
copied run writes only inside its copy, a checkpoint naming another project's file or another MLflow
server is not followed, and a tracker never overwrites or moves a file trainforge did not write."""

from __future__ import annotations

import csv
import http.server
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from tests.callbacks.test_trackers_base import make_loader, make_module
from trainforge import Trainer
from trainforge.callbacks import ModelCheckpoint
from trainforge.callbacks.trackers import CSVLogger, FailurePolicy
from trainforge.callbacks.trackers.run_paths import OWNED_LIST, resolve_in_run, run_relative
from trainforge.strategies.checkpoint.verify import file_crc32, metadata_checksum
from trainforge.strategies.errors import ConfigurationError


def fit(root: Path, callbacks, max_epochs: int, ckpt_path=None) -> Trainer:
    trainer = Trainer(
        default_root_dir=str(root),
        max_epochs=max_epochs,
        log_every_n_steps=1,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    trainer.fit(make_module(), make_loader(16), ckpt_path=ckpt_path)
    return trainer


def steps(csv_path: Path) -> list:
    with open(csv_path, newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def files_of(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def version(root: Path, n: int = 0) -> Path:
    """A file logger's folder of a run (Lightning's layout): ``<root>/lightning_logs/version_<n>``."""
    return root / "lightning_logs" / f"version_{n}"


def edit_callback_state(ckpt: Path, key: str, state: dict) -> None:
    """What an attacker can do to a checkpoint of plain data: change a callback's state and reseal the
    manifest so that it verifies."""
    trainer_state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    trainer_state["callbacks"][key] = state
    torch.save(trainer_state, ckpt / "trainer_state.pt")
    meta = json.loads((ckpt / "metadata.json").read_text())
    for rel in meta["files"]:
        size, crc = file_crc32(str(ckpt / rel))
        meta["files"][rel] = {"size": size, "crc32": crc}
    meta["checksum"] = metadata_checksum(meta)
    (ckpt / "metadata.json").write_text(json.dumps(meta))


def test_paths_restored_from_a_checkpoint_stay_inside_the_run(tmp_path):
    root = tmp_path / "run"
    assert run_relative(str(root / "tb" / "v0"), str(root)) == os.path.join("tb", "v0")
    assert run_relative(str(tmp_path / "other" / "m.csv"), str(root)) is None
    assert resolve_in_run(os.path.join("tb", "v0"), str(root)) == str(root / "tb" / "v0")
    assert resolve_in_run(str(root / "tb"), str(root)) == str(root / "tb")  # absolute, inside: kept
    for outside in (os.path.join("..", "other", "m.csv"), str(tmp_path / "other"), "/etc/passwd", "", None, 3):
        assert resolve_in_run(outside, str(root)) is None, outside


def test_a_copied_run_resumed_writes_only_inside_its_copy(tmp_path):
    run_a, branch = tmp_path / "run_a", tmp_path / "run_a_branch"
    fit(run_a, [CSVLogger(), ModelCheckpoint(save_top_k=-1)], max_epochs=3)
    original = files_of(run_a)
    assert steps(version(run_a) / "metrics.csv")[-1] == 11  # the last of 12 steps, at Lightning's step
    assert {"hparams.yaml", "status.txt"} <= {os.path.basename(name) for name in original}
    shutil.copytree(run_a, branch)
    fit(
        branch,
        [CSVLogger(), ModelCheckpoint(save_top_k=-1)],
        max_epochs=2,
        ckpt_path=str(version(branch) / "checkpoints" / "epoch=0-step=4"),
    )
    assert files_of(run_a) == original  # not a byte of the original run changed
    # a checkpoint path (not "last"): a new version of the copy, as Lightning; resumed at 4, ran to 8
    after = steps(version(branch, 1) / "metrics.csv")
    assert after == [4, 5, 6, 7]


def test_a_checkpoint_naming_another_projects_metrics_file_is_not_followed(tmp_path):
    victim = tmp_path / "other_project"
    fit(victim, [CSVLogger()], max_epochs=3)
    before = files_of(victim)
    downloaded = tmp_path / "downloaded"
    fit(downloaded, [CSVLogger(), ModelCheckpoint(save_top_k=-1)], max_epochs=1)
    checkpoints = version(downloaded) / "checkpoints"
    ckpt = checkpoints / (checkpoints / "latest").read_text().strip()
    for key in ("path", "file"):
        edit_callback_state(ckpt, "CSVLogger", {key: str(version(victim) / "metrics.csv"), "resumed": True})
        mine = tmp_path / f"mine_{key}"
        fit(mine, [CSVLogger()], max_epochs=2, ckpt_path=str(ckpt))
        assert files_of(victim) == before
        assert steps(version(mine) / "metrics.csv") == [4, 5, 6, 7]


class _FakeMLflowServer(http.server.BaseHTTPRequestHandler):
    hits: list = []

    def _answer(self):
        self.hits.append((self.command, self.path))
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_mlflow_state_naming_another_server_is_not_followed_and_a_copy_continues_its_run(tmp_path, caplog):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from trainforge.callbacks.trackers import MLflowLogger

    server = http.server.HTTPServer(("127.0.0.1", 0), _FakeMLflowServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        downloaded = tmp_path / "downloaded"
        first = MLflowLogger(failure_policy=FailurePolicy(open_wait_s=120))  # the run id is in the checkpoint
        fit(downloaded, [first, ModelCheckpoint(save_top_k=-1)], max_epochs=1)
        ckpt = downloaded / "checkpoints" / (downloaded / "checkpoints" / "latest").read_text().strip()
        # a copy of the run continues the same run id, in the copy's own local store
        copy = tmp_path / "copy"
        shutil.copytree(downloaded, copy)
        resumed = MLflowLogger()
        fit(copy, [resumed], max_epochs=2, ckpt_path=str(copy / "checkpoints" / ckpt.name))
        assert resumed.run_id == first.run_id
        history = MlflowClient(f"sqlite:///{copy / 'mlflow.db'}").get_metric_history(first.run_id, "train/loss")
        assert max(m.step for m in history) == 7  # the last of 8 steps, at Lightning's step
        # a checkpoint that names another server: nothing reaches it; a new run in the local store
        url = f"http://127.0.0.1:{server.server_address[1]}"
        edit_callback_state(ckpt, "MLflowLogger", {"run_id": "r1", "tracking_uri": url, "experiment_id": "0"})
        mine = MLflowLogger()
        with caplog.at_level(logging.WARNING, logger="trainforge"):
            fit(tmp_path / "mine", [mine], max_epochs=2, ckpt_path=str(ckpt))
        assert _FakeMLflowServer.hits == []
        assert mine.run_id not in (None, "r1") and mine.resolved_tracking_uri.startswith("sqlite:///")
        assert "'r1' belongs to the store" in caplog.text
    finally:
        server.shutdown()


def test_csvlogger_path_beside_the_users_own_files_is_refused_before_training(tmp_path):
    exp = tmp_path / "experiment"
    exp.mkdir()
    (exp / "hparams.yaml").write_text("lr: 0.1   # my hand-written config\n")
    (exp / "status.txt").write_text("my notes: run 3 diverged\n")
    (exp / "results.csv").write_text("model,accuracy\nbaseline,0.91\n")
    before = files_of(exp)
    with pytest.raises(ConfigurationError, match=r"hparams\.yaml.*status\.txt.*trainforge did not write"):
        CSVLogger(path=str(exp / "metrics.csv"))
    with pytest.raises(ConfigurationError, match=r"results\.csv"):
        CSVLogger(path=str(exp / "results.csv"))
    assert files_of(exp) == before


def test_a_version_folder_holding_the_users_files_gets_a_subfolder_and_the_users_files_stay(tmp_path, caplog):
    folder = version(tmp_path)
    folder.mkdir(parents=True)
    (folder / "hparams.yaml").write_text("mine: true\n")
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        first = CSVLogger(version=0)
        fit(tmp_path, [first], max_epochs=1)
    assert first.file == str(folder / "csv_logger" / "metrics.csv") and "leaves" in caplog.text
    assert (folder / "hparams.yaml").read_text() == "mine: true\n"
    assert json.loads((folder / "csv_logger" / OWNED_LIST).read_text()) == [
        "metrics.csv",
        "hparams.yaml",
        "status.txt",
    ]
    fit(tmp_path, [CSVLogger(version=0)], max_epochs=1)  # the version again: its own file started afresh
    assert (folder / "hparams.yaml").read_text() == "mine: true\n" and not list(tmp_path.rglob("metrics.1.csv"))
    assert steps(folder / "csv_logger" / "metrics.csv") == [0, 1, 2, 3]
    # without a version, a folder of the user's is never written into: the next version is the logger's own
    other = CSVLogger()
    fit(tmp_path, [other], max_epochs=1)
    assert other.log_dir == str(version(tmp_path, 1)) and (folder / "hparams.yaml").read_text() == "mine: true\n"


def test_model_checkpoint_paths_of_a_copied_run_point_into_the_copy(tmp_path, caplog):
    run_a, branch = tmp_path / "run_a", tmp_path / "run_a_branch"
    fit(run_a, [ModelCheckpoint(save_top_k=2, monitor="train/loss")], max_epochs=2)
    original = sorted(p.name for p in (version(run_a) / "checkpoints").iterdir())
    shutil.copytree(run_a, branch)
    resumed = ModelCheckpoint(save_top_k=2, monitor="train/loss")
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        fit(branch, [resumed], max_epochs=4, ckpt_path="last")
    assert sorted(p.name for p in (version(run_a) / "checkpoints").iterdir()) == original  # the original: untouched
    kept = [Path(p) for p in resumed.best_k_models]
    # "last": the newest version of the copy goes on, with its checkpoints
    assert len(kept) == 2 and all(p.parent == version(branch) / "checkpoints" and p.is_dir() for p in kept)
    assert "not pruning" not in caplog.text  # pruning found the copy's own checkpoints
