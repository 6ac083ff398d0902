"""Trackers (CSV, MLflow, W&B offline) in a real 2-process fit (torchrun, DDP on gloo): only rank 0 writes, and values logged
with ``sync_dist=True`` reach the trackers as the mean over ranks.

The test runs this file itself as the training script under ``torch.distributed.run``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import forklaunch, procs

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 240


def main(root: Path) -> None:
    """One rank of the job: fit with three trackers, then dump what this rank saw as JSON."""
    import torch
    from torch import nn

    from tests.callbacks.test_trackers_base import Recorder, make_loader
    from trainforge import Trainer, TrainingModule
    from trainforge.callbacks.trackers import CSVLogger, FailurePolicy, MLflowLogger, WandbLogger

    class RankModule(TrainingModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.local = {}  # step -> this rank's own loss

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.local[self.global_step] = float(loss)  # logged at Lightning's step: the steps before this one
            self.log("train/loss", loss, sync_dist=True)
            self.log("rank/synced", float(self.trainer.global_rank), sync_dist=True)
            self.log("rank/local", float(self.trainer.global_rank))
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    recorder = Recorder()
    # Importing and opening MLflow and W&B together on a busy 2-core machine can outlast the 8 steps and the
    # default 5 s the end of fit waits for pending writes: this test checks what they write, so it waits.
    patient = FailurePolicy(flush_timeout_s=60)
    quiet = {"x_disable_stats": True, "x_disable_meta": True, "disable_git": True, "save_code": False}
    wandb = WandbLogger(offline=True, settings=quiet, failure_policy=patient)
    loggers = [CSVLogger(), MLflowLogger(failure_policy=patient), wandb]
    trainer = Trainer(
        strategy="ddp",
        max_epochs=1,
        log_every_n_steps=1,
        callbacks=[recorder, *loggers],
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    module = RankModule()
    trainer.fit(module, make_loader(64, 4), make_loader(16, 4, seed=1))
    rank = trainer.global_rank
    seen = {
        "rank": rank,
        "world_size": trainer.world_size,
        "local": module.local,
        "logged": recorder.logged,
        "csv": loggers[0].file,
        "mlflow": loggers[1]._run_id,
        "imported_mlflow": "mlflow" in sys.modules,
        "wandb": wandb.save_dir,
        "imported_wandb": "wandb" in sys.modules,
    }
    (root / f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.mark.slow
def test_two_process_fit_only_rank_zero_writes_and_sync_dist_is_the_mean(tmp_path, tmp_path_factory):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    from tests.callbacks.test_trackers_base import mlflow_store
    from tests.callbacks.test_trackers_csv import read_csv
    from tests.callbacks.test_trackers_wandb import history as history_of
    from tests.callbacks.test_trackers_wandb import read_run, run_files

    uri = mlflow_store(tmp_path_factory, tmp_path / "mlflow.db")  # the default store, already migrated
    wandb_env = {f"WANDB_{k}": str(tmp_path / f"wandb-{k.lower()}") for k in ("DIR", "CONFIG_DIR", "CACHE_DIR")}
    env = procs.test_env(MASTER_ADDR="127.0.0.1", WANDB_MODE="offline", WANDB_SILENT="true", **wandb_env)
    forklaunch.launch(__file__, tmp_path, env=env, timeout=LAUNCH_TIMEOUT_S)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2

    # Only rank 0 opened anything; rank 1's trackers never resolved a file or a run.
    assert r0["csv"] and r0["mlflow"] and (r1["csv"], r1["mlflow"]) == (None, None)
    assert r0["imported_mlflow"] and not r1["imported_mlflow"]  # rank 1 never even imported the backend
    assert r0["wandb"] == str(tmp_path) and r1["wandb"] is None and not r1["imported_wandb"]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("trainforge").experiment_id])
    assert [r.info.run_id for r in runs] == [r0["mlflow"]]

    # sync_dist values are the mean over ranks, the same on both ranks; unsynced ones are rank 0's.
    logged = [(step, metrics) for step, metrics in r0["logged"]]
    train = [(s, m) for s, m in logged if "train/loss" in m]

    def synced(log):
        return [(s, m["train/loss"], m["rank/synced"]) for s, m in log if "train/loss" in m]

    assert len(train) == 8 and synced(r1["logged"]) == synced(train)
    for step, metrics in train:
        mean = (r0["local"][str(step)] + r1["local"][str(step)]) / 2
        assert metrics["train/loss"] == pytest.approx(mean, rel=1e-6)
        assert metrics["rank/synced"] == 0.5 and metrics["rank/local"] == 0.0
    assert r0["local"] != r1["local"]  # the ranks saw different data, so the mean is a real reduction

    # What the trackers hold is exactly what rank 0 logged.
    history = sorted((m.step, m.value) for m in client.get_metric_history(r0["mlflow"], "train/loss"))
    assert history == [(s, m["train/loss"]) for s, m in train]
    _, rows = read_csv(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")
    assert [(int(r["step"]), float(r["train/loss"])) for r in rows if r["train/loss"]] == history
    assert len(rows) == len(logged)
    (wandb_file,) = run_files(tmp_path)  # one W&B run, rank 0's, with the same history
    assert history_of(read_run(wandb_file)[2], "train/loss") == history


if __name__ == "__main__":
    main(Path(sys.argv[1]))
