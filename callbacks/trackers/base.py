"""``TrackerCallback``: what every experiment tracker shares, above all its failure policy.

A tracker is a callback. It writes on the main process only (``trainer.is_global_zero``): the
hyperparameters (``trainer.hparams``) when the run starts (FIT_START, or the first LOG of a
validate/test run), the metrics of every LOG event, and it finishes the run at FIT_END/TEARDOWN
(status FINISHED) or on EXCEPTION (status FAILED). Its ``state_dict`` holds what a resumed fit needs
to continue the same run.

Hooks never call the backend themselves: they queue records, and one daemon writer thread per tracker
makes the backend calls in order. A slow or dead backend (MLflow's HTTP client alone retries a dead
server for about four minutes by default) therefore never stalls the training loop. Metric records
are written in batches, at most every ``write_interval_s`` (1 s; 0: at once), and queuing one does not
wake the writer: each wake-up and each write takes the GIL from the training thread (measured on a
small CPU model: a write per ``log_every_n_steps=50`` cost the loop ~55 us per step, 12 %). A flush,
the hyperparameters and the end of the run are written at once.

Failure policy (``FailurePolicy``), the same for every tracker:

- any exception from a backend call is caught; training goes on. The first one emits one
  ``TrackerWarning`` naming the tracker and the error (shown from the training thread at the next hook);
- after a failure the backend is not called again until a back-off delay has passed (1, 2, 4, ... s,
  capped at 60 s, reset by a success). A failed call is dropped, never retried inline or slept on;
  metric values that arrive during the back-off are dropped too, and all dropped values are counted;
- hyperparameters are kept and retried with the next attempt (three attempts at most);
- when the run finishes, pending writes get ``flush_timeout_s`` (5 s by default), and more of it as long
  as they progress: a backend that stores on this machine's disk (a file or SQLite store: CSV, TensorBoard,
  MLflow's default) is waited for until everything is written (a slow disk is not an outage), another one
  as long as a backend call completed during the last ``flush_timeout_s``; one that made no progress for
  that long (an unreachable server) is given up. Then one ``TrackerWarning`` reports how many metric values
  were dropped and whether the tracker recovered;
- every dropped metric value is kept in ``<default_root_dir>/<tracker>-unsent-<time>-<pid>.jsonl`` (one
  JSON object per line: ``step`` and ``metrics``), named by the report, to be logged again later;
- a checkpoint save never waits for the queue. It waits at most ``open_wait_s`` (2 s; 0: never), once
  per run, for the tracker's run to be opened so the checkpoint can name it for a resumed fit; a run
  that never opened (a dead server) is not "closed" at the end either.

Subclasses implement the backend calls (run on the writer thread): ``_open``, ``_write_params``,
``_write_metrics``, ``_close`` and optionally ``_write_artifacts``; ``_prepare`` runs on the training
thread at start to read what they need from the trainer (paths, step), without I/O.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from trainforge.callbacks.base import Callback
from trainforge.callbacks.trackers.experiment import experiment_or_stand_in
from trainforge.callbacks.trackers.writer import BackendWriter
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover - type hints only, see docs/ARCHITECTURE.md "Floors"
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

MetricRecords = List[Tuple[int, Dict[str, Any]]]  # float values; a dict of floats if keeps_groups
log = logging.getLogger("trainforge")


class TrackerWarning(UserWarning):
    """A tracker could not write; training continued."""


@dataclass(frozen=True)
class FailurePolicy:
    """How a tracker behaves when its backend fails (see the module docstring)."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    flush_timeout_s: float = 5.0
    open_wait_s: float = 2.0  # once per run, at the first checkpoint save: see the module docstring
    write_interval_s: float = 1.0  # metric records are written in batches at most this often (0: at once)
    max_pending: int = 10_000  # records queued; beyond this new metric records are dropped
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        for name in ("initial_backoff_s", "max_backoff_s", "flush_timeout_s", "max_pending"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigurationError(f"FailurePolicy({name}={value!r}) must be a positive number")
        for name in ("open_wait_s", "write_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"FailurePolicy({name}={value!r}) must be a number >= 0 (seconds)")
        if self.max_backoff_s < self.initial_backoff_s:
            raise ConfigurationError(
                f"FailurePolicy(max_backoff_s={self.max_backoff_s!r}) must be >= "
                f"initial_backoff_s={self.initial_backoff_s!r}"
            )


def require(package: str, extra: str, tracker: str) -> None:
    """Check at construction that an optional backend is installed, or raise a ConfigurationError
    naming the pip extra. The import itself happens later, on the writer thread of the process that
    writes (rank 0): the other ranks never pay for importing a tracking library."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken module entry
        found = False
    if not found:
        raise ConfigurationError(
            f"{tracker} needs the optional package {package!r}, which is not installed. "
            f"Install it with: pip install 'trainforge[{extra}]'"
        )


def check_text(value: Any, tracker: str, arg: str, example: str, path: bool = False) -> Optional[str]:
    """A tracker argument naming something (a URI, a directory, a project): None, or a non-empty string
    (``path=True``: or an ``os.PathLike``). Anything else (an int) is a ConfigurationError now, not an
    error from deep inside the tracking library at the first write."""
    if path and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    kind = "a path (str or pathlib.Path)" if path else "a non-empty string"
    raise ConfigurationError(f"{tracker}({arg}={value!r}): {arg} must be {kind} such as {example!r}, or None")


def flatten_params(params: Mapping[str, Any], prefix: str = "", sep: str = "/") -> Dict[str, Any]:
    """``{"opt": {"lr": 1}}`` -> ``{"opt/lr": 1}``; scalars kept, anything else made a string."""
    flat: Dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, name, sep))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


class TrackerCallback(Callback):
    """Base of the experiment trackers; see the module docstring for the failure policy."""

    name = "Tracker"
    # A group of metrics (Accelerate's ``log({"glue": {"accuracy": 0.8}})``): a tracker that writes groups as
    # such gets ``{"glue": {"accuracy": 0.8}}`` in its records; the others get ``{"glue/accuracy": 0.8}``.
    keeps_groups = False

    def __init__(self, failure_policy: Optional[FailurePolicy] = None) -> None:
        if failure_policy is not None and not isinstance(failure_policy, FailurePolicy):
            raise ConfigurationError(
                f"failure_policy={failure_policy!r} is not a FailurePolicy; pass "
                "FailurePolicy(initial_backoff_s=..., max_backoff_s=..., flush_timeout_s=...) or None"
            )
        self.failure_policy = failure_policy or FailurePolicy()
        self._writer: Optional[BackendWriter] = None
        self._warned_first = False
        self.last_report: Optional[str] = None  # the end-of-run failure summary, if there was one
        self._rank_zero: Optional[bool] = None  # set at fit start: where ``experiment`` is the real object
        self._spill_dir: Optional[str] = None
        self._spill_file: Optional[str] = None  # created at the first dropped metric value of a run

    @property
    def tracker_name(self) -> str:
        """The tracker's name in messages and file names (its class); ``name`` is Lightning's experiment name
        for the file loggers (CSVLogger, TensorBoardLogger) and the tracker's name for the others."""
        return type(self).__name__

    def place(self, default_root_dir: str) -> None:
        """Called by the Trainer that gets this tracker: a file logger without ``save_dir`` writes under the
        Trainer's ``default_root_dir`` (so ``log_dir`` is known from then on, as Lightning's)."""

    @property
    def log_dir(self) -> Optional[str]:
        """Lightning's ``logger.log_dir``: the file loggers' version folder; None for the others."""
        return None

    def settle(self, default_root_dir: str, broadcast: Callable[[Any, int], Any], continuing: bool = False) -> None:
        """Called by the Trainer on every rank at the start of a fit, before its checkpoints are looked for: the
        file loggers fix their ``version_<N>`` folder here (``versioned.py``); the others have nothing to fix."""

    @property
    def version(self) -> Optional[Union[int, str]]:
        """Lightning's ``logger.version``: the file loggers' ``version_<N>`` number (or name); None for the others."""
        return None

    def version_dir(self, default_root_dir: str) -> Optional[str]:
        """Lightning's ``<save_dir>/<name>/<version>`` of the file loggers (CSVLogger, TensorBoardLogger): when
        the first logger has one, a ModelCheckpoint without ``dirpath`` writes to its ``checkpoints/``, as
        Lightning; None (the other trackers): ``<default_root_dir>/checkpoints``."""
        return None

    # --- backend interface (``_prepare`` on the training thread, the rest on the writer thread) ---
    def _prepare(self, trainer: TrainerView) -> None:
        """Read what the backend calls need from the trainer (paths, step); no I/O here."""

    def _open(self) -> None:
        raise NotImplementedError

    def _write_params(self, params: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _write_metrics(self, records: MetricRecords) -> None:
        raise NotImplementedError

    def _write_artifacts(self, path: str) -> None:
        raise NotImplementedError(f"{self.tracker_name} does not store artifacts")

    def _close(self, status: str) -> None:
        raise NotImplementedError

    def _backend(self) -> Any:
        """The backend's own object once opened, else None (``experiment``; writer thread's object)."""
        return None

    def _store_is_local(self) -> bool:
        """Whether the backend stores on this machine's disk (a file or SQLite store): the end of the run then
        waits until every pending write is done, however slow the disk."""
        return False

    def _resend_hint(self) -> str:
        """How to log the values of the spill file to the backend later (the report adds it)."""
        return "log them to the run once the backend is reachable again"

    def _spill(self, records: Any) -> None:
        """Append dropped metric records to this run's spill file (never one trainforge did not create)."""
        if not records or self._spill_dir is None:
            return
        try:
            os.makedirs(self._spill_dir, exist_ok=True)
            if self._spill_file is None:
                self._spill_file = _new_spill_file(self._spill_dir, self.tracker_name)
            with open(self._spill_file, "a") as f:
                for step, values in records:
                    f.write(json.dumps({"step": int(step), "metrics": values}) + "\n")
        except OSError as e:
            log.warning(
                "trainforge: %s could not keep dropped values in %s (%s)", self.tracker_name, self._spill_file, e
            )

    def _secrets(self) -> List[str]:
        """Strings that must never appear in a message (API keys)."""
        return []

    def _redact(self, text: str) -> str:
        for secret in self._secrets():
            if secret:
                text = text.replace(secret, "***")
        return text

    # --- hooks ---
    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._rank_zero = trainer.is_global_zero
        if trainer.is_global_zero:
            self._start(trainer)

    def on_log(self, trainer: TrainerView, module: TrainingModule, metrics: Dict[str, float], step: int) -> None:
        if not trainer.is_global_zero:
            return
        writer = self._start(trainer)
        values = _numbers(metrics, writer, self.keeps_groups)
        if values:
            count = sum(len(v) if isinstance(v, dict) else 1 for v in values.values())
            writer.put("metrics", (int(step), values), count)
        self._warn_first_failure()

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._writer is not None:
            self._warn_first_failure()

    def on_fit_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if trainer.is_global_zero:
            self._finish("FINISHED")

    def on_exception(self, trainer: TrainerView, module: TrainingModule, exception: BaseException) -> None:
        if trainer.is_global_zero:
            self._finish("FAILED")

    def on_teardown(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        if trainer.is_global_zero:
            self._finish("FINISHED")

    # --- public helpers ---
    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until everything logged so far was handled (written or dropped); False on timeout."""
        if self._writer is None:
            return True
        ok = self._writer.flush(self.failure_policy.flush_timeout_s if timeout is None else timeout)
        self._warn_first_failure()
        return ok

    @property
    def experiment(self) -> Any:
        """Lightning's ``logger.experiment``: the backend's object during fit (``trackers/experiment.py``)."""
        self._wait_opened(self.failure_policy.flush_timeout_s)
        return experiment_or_stand_in(type(self).__name__, self._backend(), self._rank_zero, TrackerWarning)

    @property
    def dropped_values(self) -> int:
        """Metric values of the current run that could not be written."""
        return self._writer.dropped if self._writer is not None else 0

    # --- lifecycle ---
    def _start(self, trainer: TrainerView) -> BackendWriter:
        if self._writer is not None:
            return self._writer
        self._prepare(trainer)
        self._spill_dir, self._spill_file = os.path.abspath(trainer.default_root_dir), None
        self._warned_first = False
        self._writer = writer = BackendWriter(self, self.failure_policy)
        writer.put("params", flatten_params(dict(trainer.hparams)))
        return writer

    def _wait_opened(self, timeout: Optional[float] = None) -> None:
        """Let ``state_dict`` see the run id of a run being opened: at most ``open_wait_s``, and only
        until one such wait ran out (a dead tracker then costs the saves nothing). ``timeout``: an
        explicit bound for a user asking (``run_id``), not limited to once."""
        writer = self._writer
        if writer is None or not writer.thread.is_alive() or writer.attempted.is_set():
            return
        if timeout is not None:
            writer.attempted.wait(timeout)
        elif not writer.open_wait_spent:
            writer.open_wait_spent = not writer.attempted.wait(self.failure_policy.open_wait_s)

    def _queue_artifacts(self, path: str) -> None:
        if self._writer is not None:
            self._writer.put("artifacts", path)

    def _finish(self, status: str) -> None:
        writer = self._writer
        if writer is None:
            return
        self._writer = None
        writer.put("close", status)
        writer.put("stop")
        complete = self._drain(writer)
        lost = 0 if complete else writer.abandon()
        self._warn_first_failure(writer)
        if writer.failures or writer.dropped or writer.dropped_other:
            self.last_report = self._report(writer, lost, complete)
            warnings.warn(self.last_report, TrackerWarning, stacklevel=2)

    def _drain(self, writer: BackendWriter) -> bool:
        """Wait for the pending writes, ``flush_timeout_s`` at a time: again and again for a store on local
        disk, again for another backend while a call completed during the last wait (see the module
        docstring). False when given up."""
        timeout, local = self.failure_policy.flush_timeout_s, self._store_is_local()
        while True:
            before = writer.progress
            if writer.flush(timeout):
                return True
            if not writer.thread.is_alive() or (not local and writer.progress == before):
                return False
            log.warning(
                "trainforge: %s is still writing the run's last values (%s); waiting for it",
                self.tracker_name,
                "a store on local disk" if local else "the backend is making progress",
            )

    def _report(self, writer: BackendWriter, lost: int, complete: bool) -> str:
        timeout = self.failure_policy.flush_timeout_s
        parts = [f"{self.tracker_name}: {writer.dropped} metric value(s) could not be written and were dropped"]
        if lost:
            parts.append(f" ({lost} of them still pending {timeout:g} s after the run ended)")
        if writer.dropped_other:
            parts.append(
                f", and {writer.dropped_other} other record(s) (hyperparameters, artifacts or non-numeric values)"
            )
        if writer.first_error:
            parts.append(f"; {writer.failures} backend call(s) failed; first problem: {writer.first_error}. ")
        if self._spill_file is not None and writer.dropped:
            parts.append(
                f" The dropped values are kept in {self._spill_file} (one JSON line per step: step, metrics); "
                f"{self._resend_hint()}. "
            )
        if writer.failures:
            recovered = complete and not writer.failing
            parts.append(
                "The tracker recovered: its last writes succeeded."
                if recovered
                else "The tracker did not recover before the run ended."
            )
        return "".join(parts)

    def _warn_first_failure(self, writer: Optional[BackendWriter] = None) -> None:
        writer = writer or self._writer
        if writer is None or self._warned_first or writer.first_error is None:
            return
        self._warned_first = True
        policy = self.failure_policy
        warnings.warn(
            f"{self.tracker_name}: writing to the tracker failed ({writer.first_error}). Training continues; "
            f"writes are retried with back-off ({policy.initial_backoff_s:g} s doubling up to "
            f"{policy.max_backoff_s:g} s) and metric values that cannot be written are dropped and "
            "counted (reported at the end of the run).",
            TrackerWarning,
            stacklevel=3,
        )


def _numbers(metrics: Mapping[str, Any], writer: BackendWriter, keep_groups: bool) -> Dict[str, Any]:
    """The numbers of ``metrics`` as floats; a group (a dict value) kept as a dict of floats when
    ``keep_groups``, else flattened to ``"group/name"``. What is not a number is counted as dropped."""
    values: Dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            group = _numbers({f"{key}/{k}": v for k, v in value.items()}, writer, False)
            prefix = len(str(key)) + 1
            values.update({str(key): {k[prefix:]: v for k, v in group.items()}} if keep_groups and group else group)
            continue
        try:
            values[str(key)] = float(value)
        except (TypeError, ValueError):
            writer.count_other()  # not a number: nothing a tracker can plot
    return values


def _new_spill_file(folder: str, name: str) -> str:
    """A spill file created here, by this call: an existing file of the same name (another tracker of this
    name in the same second and process, or anyone's) is never appended to; the next free suffix is taken."""
    stamp = f"{name}-unsent-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for n in range(1000):
        path = os.path.join(folder, f"{stamp}{f'-{n}' if n else ''}.jsonl")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            continue
    raise OSError(f"no free name for {stamp}*.jsonl in {folder}")
