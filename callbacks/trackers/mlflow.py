"""``MLflowLogger``: parameters, metrics and (optionally) checkpoints of a run in MLflow.

It talks to MLflow through ``mlflow.tracking.MlflowClient`` with an explicit run id: no global
active run, so two trackers (or two tests) in one process never interfere. Metrics are written with
``log_batch`` (the writer thread merges what queued up meanwhile into one call). The default store is
an embedded SQLite database ``<default_root_dir>/mlflow.db`` with artifacts under
``<default_root_dir>/mlruns``; any tracking URI works, e.g. ``http://127.0.0.1:5000`` of a running
``mlflow server``.

Remote servers: MLflow's HTTP client retries a failed request itself (environment variables
``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, default 7 with back-off factor 2, i.e. about 4 minutes, and
``MLFLOW_HTTP_REQUEST_TIMEOUT``). Those retries happen on the tracker's writer thread, never in the
training loop. Before opening a run on an ``http(s)://`` server, one TCP connection is tried
(``connect_timeout_s``): a server that is down fails at once instead of after minutes of retries,
so the failure policy takes over (nothing waits on it; the end of the run reports what was dropped).

Checkpoints (``log_checkpoints=True``): a checkpoint directory is uploaded as artifacts under
``checkpoints/<name>`` once it is complete. Two ways in, both asynchronous: ``ModelCheckpoint`` (or
the user) calls ``log_checkpoint(path)`` after the directory is in place; and SAVE_CHECKPOINT events
whose checkpoint dict carries the final directory under ``"path"`` are remembered and uploaded at a
later hook, once a new directory stands at that path (checkpoints are written to a temporary
directory and renamed into place, so a new directory there is a complete one). The upload runs on
the writer thread; a checkpoint deleted meanwhile (top-k pruning) is reported by the failure policy.

Resume: ``state_dict`` holds the run id (and which store: this run's local one or the tracking URI); a
resumed fit continues that run when the MLflowLogger of the resumed fit uses the same store.
MLflow parameters cannot change within a run, so on resume only parameters the run lacks are added.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple
from urllib.parse import urlsplit

from trainforge.callbacks.trackers.base import FailurePolicy, MetricRecords, TrackerCallback, require
from trainforge.strategies.errors import ConfigurationError

log = logging.getLogger("trainforge")
LOCAL_STORE = "local"  # how a checkpoint names the default store, <default_root_dir>/mlflow.db of the run

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def mlflow_key(name: str) -> str:
    """A metric/param name MLflow accepts: other characters become ``_``, no empty path segments."""
    key = _BAD_KEY_CHARS.sub("_", str(name))
    parts = ["_" if p in (".", "..") else p for p in key.split("/") if p]
    return "/".join(parts)[:250] or "_"


def _identity(path: str) -> Optional[Tuple[int, int]]:
    """(inode, mtime) of a directory, None when there is none: a directory renamed into place differs."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns) if os.path.isdir(path) else None


def _check_reachable(uri: str, timeout: float) -> None:
    """One TCP connection to an http(s) tracking server; raises ConnectionError at once if it is down."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"cannot connect to the MLflow server {parts.hostname}:{port} ({e})") from None


class MLflowLogger(TrackerCallback):
    """Log to MLflow on the main process. See the module docstring."""

    name = "MLflowLogger"

    def __init__(
        self,
        tracking_uri: Optional[str] = None,
        experiment_name: str = "trainforge",
        run_name: Optional[str] = None,
        run_id: Optional[str] = None,
        tags: Optional[Dict[str, Any]] = None,
        log_checkpoints: bool = False,
        artifact_location: Optional[str] = None,
        failure_policy: Optional[FailurePolicy] = None,
        connect_timeout_s: float = 3.0,
    ) -> None:
        super().__init__(failure_policy)
        require("mlflow", "mlflow", "MLflowLogger")
        if (
            not isinstance(connect_timeout_s, (int, float))
            or isinstance(connect_timeout_s, bool)
            or connect_timeout_s <= 0
        ):
            raise ConfigurationError(
                f"MLflowLogger(connect_timeout_s={connect_timeout_s!r}) must be a positive number of seconds"
            )
        self.connect_timeout_s = float(connect_timeout_s)
        if not isinstance(experiment_name, str) or not experiment_name.strip():
            raise ConfigurationError(f"MLflowLogger(experiment_name={experiment_name!r}) must be a non-empty string")
        if tags is not None and not isinstance(tags, dict):
            raise ConfigurationError(f"MLflowLogger(tags={tags!r}) must be a dict of tag name to value")
        if tracking_uri is not None and (not isinstance(tracking_uri, (str, os.PathLike)) or not str(tracking_uri)):
            raise ConfigurationError(
                f"MLflowLogger(tracking_uri={tracking_uri!r}) must be a URI string such as "
                "'http://127.0.0.1:5000' or 'sqlite:///runs/mlflow.db', or None for this run's "
                "local store"
            )
        self.tracking_uri = os.fspath(tracking_uri) if tracking_uri is not None else None
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.log_checkpoints = bool(log_checkpoints)
        self.artifact_location = artifact_location
        self._run_id = run_id
        self._explicit_run_id = run_id is not None
        self._saved: Dict[str, Any] = {}  # the checkpoint's state: data to check, never a store to follow
        self._uri: Optional[str] = None
        self._experiment_id: Optional[str] = None
        self._client: Any = None  # the MlflowClient, opened lazily (mlflow is optional)
        self._default_artifacts: Optional[str] = None
        self._waiting_checkpoints: Dict[str, Optional[Tuple[int, int]]] = {}

    def __repr__(self) -> str:
        return (
            f"MLflowLogger(tracking_uri={self._uri or self.tracking_uri!r}, "
            f"experiment_name={self.experiment_name!r}, run_id={self._run_id!r})"
        )

    @property
    def run_id(self) -> Optional[str]:
        """The MLflow run id (known once the run was opened on the writer thread)."""
        self._wait_opened(self.failure_policy.flush_timeout_s)
        return self._run_id

    @property
    def resolved_tracking_uri(self) -> Optional[str]:
        return self._uri

    def state_dict(self) -> Dict[str, Any]:
        self._wait_opened()
        store = LOCAL_STORE if self.tracking_uri is None else self._uri
        return {"run_id": self._run_id, "store": store, "experiment_id": self._experiment_id}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not self._explicit_run_id and state_dict.get("run_id"):
            self._saved = dict(state_dict)

    def _continue_saved_run(self) -> None:
        """Continue the checkpoint's run only in the store the user configured now: the default local
        store of this run (a copied run's copy of it), or the same tracking URI. Never the store the
        checkpoint names (``run_paths.py``: a checkpoint's state is data, never an instruction)."""
        saved, self._saved = self._saved, {}
        if not saved:
            return
        store = saved.get("store")
        if store is None:  # checkpoints of older versions kept the URI itself
            store = saved.get("tracking_uri")
            store = LOCAL_STORE if store == self._uri and self.tracking_uri is None else store
        if (store == LOCAL_STORE and self.tracking_uri is None) or (store is not None and store == self.tracking_uri):
            self._run_id = str(saved["run_id"])
            return
        log.warning(
            "trainforge: the checkpoint's MLflow run %r belongs to the store %r, not to the store this "
            "MLflowLogger uses (%s): a new run is started there",
            saved["run_id"],
            store,
            self._uri,
        )

    # --- checkpoints ---
    def log_checkpoint(self, path: str) -> None:
        """Upload a complete checkpoint directory as artifacts (asynchronous; main process only)."""
        if self.log_checkpoints and self._writer is not None:
            self._queue_artifacts(os.path.abspath(path))

    def on_save_checkpoint(self, trainer: TrainerView, module: TrainingModule, checkpoint: Dict[str, Any]) -> None:
        path = checkpoint.get("path") if isinstance(checkpoint, dict) else None
        if self.log_checkpoints and trainer.is_global_zero and isinstance(path, (str, os.PathLike)):
            path = os.path.abspath(path)
            # A directory already there (a checkpoint being replaced) is the old one: wait for the new.
            self._waiting_checkpoints[path] = _identity(path)

    def _poll_checkpoints(self) -> None:
        for path, before in list(self._waiting_checkpoints.items()):
            now = _identity(path)
            if now is not None and now != before:
                del self._waiting_checkpoints[path]
                self.log_checkpoint(path)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._poll_checkpoints()
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._poll_checkpoints()

    def _finish(self, status: str) -> None:
        self._poll_checkpoints()
        self._waiting_checkpoints.clear()  # never completed (or already deleted): nothing to upload
        super()._finish(status)

    # --- backend ---
    def _prepare(self, trainer: TrainerView) -> None:
        root = os.path.abspath(trainer.default_root_dir)
        self._uri = self.tracking_uri or "sqlite:///" + os.path.join(root, "mlflow.db")
        self._continue_saved_run()
        self._default_artifacts = None
        if self.artifact_location is not None:
            self._default_artifacts = self.artifact_location
        elif self.tracking_uri is None:
            self._default_artifacts = Path(root, "mlruns").as_uri()

    def _open(self) -> None:
        uri = self._uri
        assert uri is not None, "the tracking URI is resolved before the run opens"
        _check_reachable(uri, self.connect_timeout_s)
        from mlflow.tracking import MlflowClient

        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(uri[len("sqlite:///") :]) or ".", exist_ok=True)
        client = MlflowClient(tracking_uri=uri)
        self._existing_params: Dict[str, str] = {}
        if self._run_id is not None:
            run = client.get_run(self._run_id)  # raises if the run is not in this store
            self._existing_params = dict(run.data.params)
            self._experiment_id = run.info.experiment_id
            if run.info.status != "RUNNING":
                client.update_run(self._run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                self._experiment_id = client.create_experiment(self.experiment_name, self._default_artifacts)
            else:
                if experiment.lifecycle_stage == "deleted":
                    client.restore_experiment(experiment.experiment_id)
                self._experiment_id = experiment.experiment_id
            run = client.create_run(self._experiment_id, tags=self.tags, run_name=self.run_name)
            self._run_id = run.info.run_id
        self._client = client

    def _backend(self) -> Any:
        return self._client  # the MlflowClient once opened (Lightning's MLFlowLogger.experiment)

    def _store_is_local(self) -> bool:
        # sqlite:///..., file:... or a plain folder: the end of the run waits for every value
        uri = self._uri or ""
        return uri.startswith(("sqlite:", "file:")) or "://" not in uri

    def _resend_hint(self) -> str:
        return (
            f"to log them to MLflow run {self._run_id} once the server is back: "
            f"MlflowClient(tracking_uri={self._uri!r}).log_batch({self._run_id!r}, metrics=[Metric(key, value, "
            "timestamp_ms, step) for each line's metrics]) (mlflow.tracking.MlflowClient, mlflow.entities.Metric)"
        )

    def _write_params(self, params: Dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        entries = {}
        for key, value in params.items():
            name = mlflow_key(key)
            if name not in self._existing_params:  # values of a run's params are immutable
                entries[name] = str(value)[:MAX_PARAM_VAL_LENGTH]
        items = [Param(k, v) for k, v in entries.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self._run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)
        self._existing_params.update(entries)

    def _write_metrics(self, records: MetricRecords) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for step, values in records for k, v in values.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH], synchronous=True)

    def _write_artifacts(self, path: str) -> None:
        self._client.log_artifacts(self._run_id, path, artifact_path=f"checkpoints/{os.path.basename(path)}")

    def _close(self, status: str) -> None:
        self._client.set_terminated(self._run_id, status=status)
