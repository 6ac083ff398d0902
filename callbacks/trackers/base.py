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
- when the run finishes, pending writes get ``flush_timeout_s`` at most (5 s by default); then one
  ``TrackerWarning`` reports how many metric values were dropped and whether the tracker recovered;
- a checkpoint save never waits for the queue. It waits at most ``open_wait_s`` (2 s; 0: never), once
  per run, for the tracker's run to be opened so the checkpoint can name it for a resumed fit; a run
  that never opened (a dead server) is not "closed" at the end either.

Subclasses implement the backend calls (run on the writer thread): ``_open``, ``_write_params``,
``_write_metrics``, ``_close`` and optionally ``_write_artifacts``; ``_prepare`` runs on the training
thread at start to read what they need from the trainer (paths, step), without I/O.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple

from trainforge.callbacks.base import Callback
from trainforge.callbacks.trackers.experiment import experiment_or_stand_in
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover - type hints only, see docs/ARCHITECTURE.md "Floors"
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

MetricRecords = List[Tuple[int, Dict[str, float]]]
_PARAM_ATTEMPTS = 3


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


class _Writer:
    """One tracker's backend calls, made in order on a daemon thread under the failure policy."""

    def __init__(self, tracker: TrackerCallback, policy: FailurePolicy) -> None:
        self.tracker, self.policy = tracker, policy
        self.cond = threading.Condition()
        self.items: List[Tuple[str, Any, int]] = []
        self.submitted = self.done = 0
        self.dropped = self.dropped_other = self.failures = 0
        self.first_error: Optional[str] = None
        self.failing = False
        self.abandoned = False
        self.retry_at, self.delay = 0.0, policy.initial_backoff_s
        self.opened = threading.Event()
        self.attempted = threading.Event()  # the first open was tried (succeeded or not)
        self.open_wait_spent = False  # a save waited open_wait_s for the first open, in vain
        self.params: Optional[Dict[str, Any]] = None
        self.param_attempts = 0
        self.inflight = 0  # metric values in the batch being written
        self.urgent = False  # a flush waits: write what is queued now
        self.next_write = 0.0  # monotonic time before which queued metric records wait (write_interval_s)
        self.thread = threading.Thread(target=self._run, name=f"trainforge-{tracker.name}", daemon=True)
        self.thread.start()

    def put(self, kind: str, payload: Any = None, n_values: int = 0) -> None:
        with self.cond:
            if kind == "metrics" and self.submitted - self.done >= self.policy.max_pending:
                reason = f"{self.policy.max_pending} records already pending (the backend is too slow)"
                self._record_failure(reason, "metrics", n_values, backend=False)
                return
            self.items.append((kind, payload, n_values))
            self.submitted += 1
            if kind != "metrics" or len(self.items) == 1:  # a metric joining a queued batch wakes nobody
                self.cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far was handled; False on timeout."""
        deadline = time.monotonic() + timeout
        with self.cond:
            target = self.submitted
            if self.done < target:
                self.urgent = True
                self.cond.notify_all()
            while self.done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self.thread.is_alive():
                    return False
                self.cond.wait(min(left, 0.5))
            return True

    def abandon(self) -> int:
        """Stop after the call in flight; count what is still queued (or in flight) as dropped."""
        with self.cond:
            self.abandoned = True
            lost = sum(n for _, _, n in self.items) + self.inflight
            self.dropped += lost
            self.items.clear()
            self.cond.notify_all()
            return lost

    def count_other(self) -> None:
        with self.cond:
            self.dropped_other += 1

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.abandoned and not self._due():
                    wait = None if not self.items else self.next_write - time.monotonic()
                    self.cond.wait(wait)
                if self.abandoned:
                    return
                batch, self.items, self.urgent = self.items, [], False
                self.next_write = time.monotonic() + self.policy.write_interval_s
                self.inflight = sum(n for _, _, n in batch)
            for kind, payload, n_values in _coalesce(batch):
                if kind == "stop":
                    self._finished(len(batch))
                    return
                self._handle(kind, payload, n_values)
                with self.cond:
                    if self.abandoned:
                        return
                    self.inflight -= n_values
            self._finished(len(batch))

    def _due(self) -> bool:
        """Queued records to write now: a flush waits, a record other than metrics, or the interval passed."""
        items = self.items
        if not items:
            return False
        return self.urgent or time.monotonic() >= self.next_write or any(k != "metrics" for k, _, _ in items)

    def _finished(self, count: int) -> None:
        with self.cond:
            self.done += count
            self.inflight = 0
            self.cond.notify_all()

    def _handle(self, kind: str, payload: Any, n_values: int) -> None:
        if kind == "params":
            self.params = {**(self.params or {}), **payload}
        if kind == "close" and self.failing and not self.opened.is_set():
            return  # never opened (a dead server): nothing to close, and no new connection attempt
        if kind != "close" and self.failing and self.policy.clock() < self.retry_at:
            with self.cond:  # backing off: drop without calling the backend (params stay pending)
                self._record_failure(None, kind, n_values)
            return
        tracker = self.tracker
        try:
            if not self.opened.is_set():
                try:
                    tracker._open()
                    self.opened.set()
                finally:
                    self.attempted.set()
            if self.params is not None:
                self._write_params()
            if kind == "metrics":
                tracker._write_metrics(payload)
            elif kind == "artifacts":
                tracker._write_artifacts(payload)
            elif kind == "close":
                tracker._close(payload)
        except Exception as err:  # any backend failure: counted, warned once, never raised
            with self.cond:
                self._record_failure(f"{type(err).__name__}: {err}", kind, n_values)
        else:
            self.failing, self.delay = False, self.policy.initial_backoff_s

    def _write_params(self) -> None:
        params, self.params = self.params, None
        if params is None:  # the caller checked; nothing to write
            return
        self.param_attempts += 1
        try:
            self.tracker._write_params(params)
        except BaseException:
            if self.param_attempts < _PARAM_ATTEMPTS:
                self.params = params  # retried with the next attempt
            else:
                with self.cond:
                    self.dropped_other += 1
            raise

    def _record_failure(self, error: Optional[str], kind: str, n_values: int, backend: bool = True) -> None:
        """Count a dropped record; with ``error`` remember it and, for a failed backend call, start or
        extend the back-off. The caller holds ``cond``."""
        if self.abandoned:  # already counted by abandon()
            return
        if kind == "metrics":
            self.dropped += n_values
        elif kind == "artifacts":
            self.dropped_other += 1
        if error is None:
            return
        if self.first_error is None:
            self.first_error = self.tracker._redact(error)
        if not backend:
            return
        self.failures += 1
        self.failing = True
        self.retry_at = self.policy.clock() + self.delay
        self.delay = min(self.delay * 2, self.policy.max_backoff_s)


def _coalesce(batch: List[Tuple[str, Any, int]]) -> List[Tuple[str, Any, int]]:
    """Merge consecutive metric records into one backend call (order kept)."""
    out: List[Tuple[str, Any, int]] = []
    for kind, payload, n in batch:
        if kind == "metrics" and out and out[-1][0] == "metrics":
            out[-1] = ("metrics", out[-1][1] + [payload], out[-1][2] + n)
        else:
            out.append((kind, [payload] if kind == "metrics" else payload, n))
    return out


class TrackerCallback(Callback):
    """Base of the experiment trackers; see the module docstring for the failure policy."""

    name = "Tracker"

    def __init__(self, failure_policy: Optional[FailurePolicy] = None) -> None:
        if failure_policy is not None and not isinstance(failure_policy, FailurePolicy):
            raise ConfigurationError(
                f"failure_policy={failure_policy!r} is not a FailurePolicy; pass "
                "FailurePolicy(initial_backoff_s=..., max_backoff_s=..., flush_timeout_s=...) or None"
            )
        self.failure_policy = failure_policy or FailurePolicy()
        self._writer: Optional[_Writer] = None
        self._warned_first = False
        self.last_report: Optional[str] = None  # the end-of-run failure summary, if there was one
        self._rank_zero: Optional[bool] = None  # set at fit start: where ``experiment`` is the real object

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
        raise NotImplementedError(f"{self.name} does not store artifacts")

    def _close(self, status: str) -> None:
        raise NotImplementedError

    def _backend(self) -> Any:
        """The backend's own object once opened, else None (``experiment``; writer thread's object)."""
        return None

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
        values: Dict[str, float] = {}
        for key, value in metrics.items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                writer.count_other()  # not a number: nothing a tracker can plot
        if values:
            writer.put("metrics", (int(step), values), len(values))
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
    def _start(self, trainer: TrainerView) -> _Writer:
        if self._writer is not None:
            return self._writer
        self._prepare(trainer)
        self._warned_first = False
        self._writer = writer = _Writer(self, self.failure_policy)
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
        timeout = self.failure_policy.flush_timeout_s
        complete = writer.flush(timeout)
        lost = 0 if complete else writer.abandon()
        self._warn_first_failure(writer)
        if writer.failures or writer.dropped or writer.dropped_other:
            self.last_report = self._report(writer, lost, complete)
            warnings.warn(self.last_report, TrackerWarning, stacklevel=2)

    def _report(self, writer: _Writer, lost: int, complete: bool) -> str:
        timeout = self.failure_policy.flush_timeout_s
        parts = [f"{self.name}: {writer.dropped} metric value(s) could not be written and were dropped"]
        if lost:
            parts.append(f" ({lost} of them still pending {timeout:g} s after the run ended)")
        if writer.dropped_other:
            parts.append(
                f", and {writer.dropped_other} other record(s) (hyperparameters, artifacts or non-numeric values)"
            )
        if writer.first_error:
            parts.append(f"; {writer.failures} backend call(s) failed; first problem: {writer.first_error}. ")
        if writer.failures:
            recovered = complete and not writer.failing
            parts.append(
                "The tracker recovered: its last writes succeeded."
                if recovered
                else "The tracker did not recover before the run ended."
            )
        return "".join(parts)

    def _warn_first_failure(self, writer: Optional[_Writer] = None) -> None:
        writer = writer or self._writer
        if writer is None or self._warned_first or writer.first_error is None:
            return
        self._warned_first = True
        policy = self.failure_policy
        warnings.warn(
            f"{self.name}: writing to the tracker failed ({writer.first_error}). Training continues; "
            f"writes are retried with back-off ({policy.initial_backoff_s:g} s doubling up to "
            f"{policy.max_backoff_s:g} s) and metric values that cannot be written are dropped and "
            "counted (reported at the end of the run).",
            TrackerWarning,
            stacklevel=3,
        )
