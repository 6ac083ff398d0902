"""The failure policy every tracker shares (``TrackerCallback``), plus helpers the tracker tests share.

Policy tests drive a small tracker whose "backend" is a list that can be told to fail, through a
stand-in trainer with the contract's attributes; end-to-end behaviour against real backends and a
real ``Trainer.fit`` is in the other ``test_trackers_*`` files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge.callbacks.base import Callback
from trainforge.callbacks.trackers import FailurePolicy, TrackerCallback, TrackerWarning
from trainforge.strategies.errors import ConfigurationError

REPO = Path(__file__).resolve().parents[2]


# ---- shared helpers (imported by the other tracker test files) -----------------------------------
class StandIn:
    """The attributes of the Trainer contract a tracker reads."""

    def __init__(self, root: Path, rank: int = 0, hparams: Dict[str, Any] | None = None, step: int = 0):
        self.default_root_dir = str(root)
        self.global_rank, self.world_size = rank, 1
        self.is_global_zero = rank == 0
        self.global_step = step
        self.hparams = hparams if hparams is not None else {"lr": 0.1, "model": {"width": 4}}
        self.stage = "fit"


def tracker_warnings(record) -> List[str]:
    return [str(w.message) for w in record if issubclass(w.category, TrackerWarning)]


class Recorder(Callback):
    """What the LOG event carried, in order: [(step, {name: value})]."""

    def __init__(self):
        self.logged: List = []

    def on_log(self, trainer, module, metrics, step):
        self.logged.append((step, dict(metrics)))

    def history(self, name: str) -> List:
        return [(step, m[name]) for step, m in self.logged if name in m]


_BLANK_DB: Dict[str, Path] = {}


def mlflow_store(tmp_path_factory, dest: Path) -> str:
    """Put an empty, already migrated MLflow SQLite store at ``dest``; return its URI.

    Creating a store runs MLflow's schema migrations (seconds, far more on a busy machine), so one
    blank store is made per test session and copied; the copy is a real store like any other.
    """
    if "db" not in _BLANK_DB:
        from mlflow.tracking import MlflowClient

        blank = tmp_path_factory.mktemp("mlflow-blank") / "mlflow.db"
        MlflowClient(f"sqlite:///{blank}").search_experiments()  # creates the tables
        _BLANK_DB["db"] = blank
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_BLANK_DB["db"], dest)
    return f"sqlite:///{dest}"


def make_module(**kwargs):
    from trainforge import TrainingModule

    class Tiny(TrainingModule):
        def __init__(self, lr: float = 0.05, width: int = 4, fail_at_step: int | None = None, after_step=None):
            super().__init__()
            self.save_hyperparameters("lr", "width")
            self.net = nn.Linear(width, 1)
            self.fail_at_step, self.after_step = fail_at_step, after_step

        def training_step(self, batch, batch_idx):
            if self.fail_at_step is not None and self.global_step >= self.fail_at_step:
                raise RuntimeError("training blew up on purpose")
            if self.after_step is not None:
                self.after_step(self.global_step)
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])

    return Tiny(**kwargs)


def make_loader(n: int = 32, batch_size: int = 4, width: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g)), batch_size=batch_size
    )


def fit(callbacks, root: Path, module=None, max_epochs: int = 2, log_every: int = 1, val: bool = True, **kwargs):
    """A real ``Trainer.fit`` of a tiny regression; returns the trainer."""
    from trainforge import Trainer

    trainer = Trainer(
        max_epochs=max_epochs,
        log_every_n_steps=log_every,
        callbacks=callbacks,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
        **kwargs,
    )
    trainer.fit(module or make_module(), make_loader(), make_loader(16, 8, seed=1) if val else None)
    return trainer


# ---- a tracker with a controllable in-memory backend, for the policy itself -----------------------
class ListTracker(TrackerCallback):
    name = "ListTracker"

    def __init__(self, policy: FailurePolicy | None = None, secret: str | None = None):
        super().__init__(policy)
        self.fail: Exception | None = None
        self.gate: threading.Event | None = None  # when set, backend calls wait for it
        self.attempts = 0
        self.params: Dict[str, Any] = {}
        self.metrics: List = []
        self.status = None
        self.secret = secret

    def _call(self) -> None:
        self.attempts += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail is not None:
            raise self.fail

    def _open(self):
        self._call()

    def _write_params(self, params):
        self._call()
        self.params.update(params)

    def _write_metrics(self, records):
        self._call()
        self.metrics.extend(records)

    def _close(self, status):
        self._call()
        self.status = status

    def _secrets(self):
        return [self.secret] if self.secret else []


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_failure_warns_once_drops_and_counts_and_reports_recovery(tmp_path):
    clock = FakeClock()
    tracker = ListTracker(FailurePolicy(initial_backoff_s=1, max_backoff_s=8, clock=clock))
    trainer = StandIn(tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tracker.on_fit_start(trainer, None)
        tracker.on_log(trainer, None, {"a": 1.0, "b": 2.0}, 1)
        assert tracker.flush(5)
        tracker.fail = OSError("No space left on device")
        for step in range(2, 7):  # the first fails; the rest fall in the back-off window: dropped
            tracker.on_log(trainer, None, {"a": float(step), "b": 0.0}, step)
            assert tracker.flush(5)
        assert tracker.attempts == 4  # open, params, step 1, step 2 only
        assert tracker.dropped_values == 10
        first = tracker_warnings(record)
        assert len(first) == 1 and "ListTracker" in first[0] and "No space left on device" in first[0]
        tracker.fail = None
        clock.now += 1.5  # past the 1 s back-off: the next write is tried and succeeds
        tracker.on_log(trainer, None, {"a": 7.0}, 7)
        tracker.on_fit_end(trainer, None)
    messages = tracker_warnings(record)
    assert len(messages) == 2, messages
    assert "10 metric value(s)" in messages[1] and "recovered" in messages[1] and "did not" not in messages[1]
    assert [s for s, _ in tracker.metrics] == [1, 7]
    assert tracker.params == {"lr": 0.1, "model/width": 4} and tracker.status == "FINISHED"


def test_backoff_doubles_up_to_the_cap_and_never_sleeps(tmp_path):
    clock = FakeClock()
    tracker = ListTracker(FailurePolicy(initial_backoff_s=1, max_backoff_s=4, clock=clock))
    trainer = StandIn(tmp_path)
    tracker.fail = ConnectionError("server down")
    attempt_times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker.on_fit_start(trainer, None)
        assert tracker.flush(5) and tracker.attempts == 1  # the open fails at t=0
        attempt_times.append(0.0)
        for tick in range(40):  # one log every 0.5 s of fake time, 20 s in all
            before = tracker.attempts
            tracker.on_log(trainer, None, {"x": 1.0}, tick)
            assert tracker.flush(5)
            if tracker.attempts > before:
                attempt_times.append(clock.now - 100.0)
            clock.now += 0.5
        tracker.on_fit_end(trainer, None)
    # Attempts at t=0 (open fails), then 1, 2, 4, 4, 4 ... seconds apart.
    gaps = [b - a for a, b in zip(attempt_times, attempt_times[1:])]
    assert gaps[:3] == [1.0, 2.0, 4.0] and set(gaps[3:]) == {4.0}, attempt_times
    assert tracker.last_report.startswith("ListTracker: 40 metric value(s)")
    assert "did not recover" in tracker.last_report


def test_a_blocked_backend_never_blocks_the_training_thread(tmp_path):
    tracker = ListTracker(FailurePolicy(flush_timeout_s=0.5))
    tracker.gate = threading.Event()  # every backend call hangs until the test releases it
    trainer = StandIn(tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tracker.on_fit_start(trainer, None)
        for step in range(50):
            tracker.on_log(trainer, None, {"x": float(step)}, step)
        assert tracker.attempts <= 1 and not tracker.gate.is_set()  # all 50 returned while it hangs
        tracker.on_fit_end(trainer, None)  # waits flush_timeout_s, then gives up
        tracker.gate.set()
    report = tracker_warnings(record)[-1]
    assert "50 metric value(s)" in report and "still pending" in report


class CountingTracker(ListTracker):
    def __init__(self, policy):
        super().__init__(policy)
        self.writes = []  # number of records per backend write

    def _write_metrics(self, records):
        self.writes.append(len(records))
        super()._write_metrics(records)


def test_metric_records_are_written_in_batches_and_a_flush_writes_at_once(tmp_path):
    """Each backend write (and each wake-up of the writer) takes the GIL from the training thread: records
    queued within write_interval_s go out in one write; flush and the end of the run do not wait for it."""
    tracker, trainer = CountingTracker(FailurePolicy(write_interval_s=30)), StandIn(tmp_path)
    tracker.on_fit_start(trainer, None)
    tracker.on_log(trainer, None, {"x": 0.0}, 0)
    assert tracker.flush(timeout=5)  # the first record: written at once
    for step in range(1, 41):
        tracker.on_log(trainer, None, {"x": float(step)}, step)
    time.sleep(0.3)
    assert tracker.writes == [1]  # the next 40 wait for the interval, not one write each
    started = time.monotonic()
    assert tracker.flush(timeout=5) and time.monotonic() - started < 5  # a flush does not wait 30 s
    tracker.on_fit_end(trainer, None)
    assert tracker.writes == [1, 40] and [s for s, _ in tracker.metrics] == list(range(41))
    eager = CountingTracker(FailurePolicy(write_interval_s=0))
    eager.on_fit_start(trainer, None)
    for step in range(3):
        eager.on_log(trainer, None, {"x": float(step)}, step)
        assert eager.flush(timeout=5)
    assert eager.writes == [1, 1, 1]


def test_too_many_pending_records_are_dropped_and_counted(tmp_path):
    tracker = ListTracker(FailurePolicy(max_pending=5, flush_timeout_s=5))
    tracker.gate = threading.Event()
    trainer = StandIn(tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tracker.on_fit_start(trainer, None)  # the params record is pending (1 of 5)
        for step in range(10):
            tracker.on_log(trainer, None, {"x": 1.0, "y": 2.0}, step)
        tracker.gate.set()
        tracker.on_fit_end(trainer, None)
    assert len(tracker.metrics) == 4 and tracker.last_report.startswith("ListTracker: 12 metric value(s)")
    assert any("pending" in m for m in tracker_warnings(record))


def test_messages_never_contain_the_secret(tmp_path):
    secret = "sk-0123456789abcdef"
    tracker = ListTracker(secret=secret)
    tracker.fail = PermissionError(f"invalid api key {secret}")
    trainer = StandIn(tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tracker.on_fit_start(trainer, None)
        tracker.on_log(trainer, None, {"x": 1.0}, 1)
        tracker.on_fit_end(trainer, None)
    messages = tracker_warnings(record)
    assert messages and all(secret not in m for m in messages) and "invalid api key ***" in messages[0]


def test_only_global_zero_writes_and_exceptions_mark_the_run_failed(tmp_path):
    rank1, rank0 = ListTracker(), ListTracker()
    for tracker, trainer in ((rank1, StandIn(tmp_path, rank=1)), (rank0, StandIn(tmp_path))):
        tracker.on_fit_start(trainer, None)
        tracker.on_log(trainer, None, {"x": 1.0}, 1)
        tracker.on_exception(trainer, None, RuntimeError("x"))
        tracker.on_teardown(trainer, None, "fit")
    assert rank1.attempts == 0 and rank1.metrics == [] and rank1.status is None
    assert rank0.metrics == [(1, {"x": 1.0})] and rank0.status == "FAILED"


@pytest.mark.parametrize(
    "bad",
    [
        dict(initial_backoff_s=0),
        dict(flush_timeout_s=-1),
        dict(max_pending=0),
        dict(initial_backoff_s=10, max_backoff_s=1),
        dict(write_interval_s=-1),
        dict(write_interval_s="1"),
    ],
)
def test_bad_policy_is_rejected_with_the_value(bad):
    with pytest.raises(ConfigurationError, match=repr(list(bad.values())[-1])):
        FailurePolicy(**bad)


@pytest.mark.parametrize(
    "module,cls,extra",
    [
        ("mlflow", "MLflowLogger", "mlflow"),
        ("comet_ml", "CometLogger", "comet"),
        ("tensorboard", "TensorBoardLogger", "tensorboard"),
        ("wandb", "WandbLogger", "wandb"),
    ],
)
def test_missing_backend_names_the_pip_extra_at_construction(monkeypatch, module, cls, extra):
    import trainforge.callbacks.trackers as trackers

    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ConfigurationError, match=rf"pip install 'trainforge\[{extra}\]'"):
        getattr(trackers, cls)()


def test_trackers_import_without_any_backend():
    code = (
        "import sys\nfor m in ('mlflow', 'comet_ml', 'tensorboard', 'wandb'): sys.modules[m] = None\n"
        "import trainforge.callbacks.trackers as t\nprint(sorted(t.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MLflowLogger" in out.stdout and "CSVLogger" in out.stdout and "WandbLogger" in out.stdout


@pytest.mark.parametrize(
    "tracker, kwargs, match",
    [
        ("CSVLogger", {"path": 5}, r"CSVLogger\(path=5\): path must be a path \(str or pathlib.Path\) such as 'runs/"),
        ("TensorBoardLogger", {"log_dir": 5}, r"TensorBoardLogger\(log_dir=5\): log_dir must be a path"),
        (
            "CometLogger",
            {"project_name": 5, "offline": True},
            r"CometLogger\(project_name=5\): project_name must be a non-empty string such as 'my-project', or None",
        ),
        ("CometLogger", {"offline_directory": 7, "offline": True}, r"CometLogger\(offline_directory=7\): offline_d"),
    ],
)
def test_a_tracker_location_of_the_wrong_type_is_refused_at_construction(tracker, kwargs, match):
    """Issue 25: an integer where a tracker takes a URI or directory failed deep inside (os.fspath's
    TypeError, or in the tracking library at the first write); MLflowLogger's tracking_uri already did
    (test_trackers_mlflow.py::test_bad_arguments_are_rejected_with_the_value)."""
    import trainforge.callbacks

    if tracker != "CSVLogger":
        pytest.importorskip({"CometLogger": "comet_ml", "TensorBoardLogger": "tensorboard"}[tracker])
    with pytest.raises(ConfigurationError, match=match):
        getattr(trainforge.callbacks, tracker)(**kwargs)
