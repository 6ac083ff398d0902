"""The writer thread of a tracker (``TrackerCallback``, ``callbacks/trackers/base.py`` has the failure policy it
applies): one daemon thread per tracker makes every backend call, in order, in batches."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.trackers.base import FailurePolicy, TrackerCallback

_PARAM_ATTEMPTS = 3


class BackendWriter:
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
        # Backend calls that completed: the end of a run waits longer while this grows.
        self.progress = 0
        # The batch being written, its items removed as they are handled (what abandon() keeps in the spill).
        self.current: List[Tuple[str, Any, int]] = []
        self.thread = threading.Thread(target=self._run, name=f"trainforge-{tracker.tracker_name}", daemon=True)
        self.thread.start()

    def put(self, kind: str, payload: Any = None, n_values: int = 0) -> None:
        with self.cond:
            if kind == "metrics" and self.submitted - self.done >= self.policy.max_pending:
                reason = f"{self.policy.max_pending} records already pending (the backend is too slow)"
                self._record_failure(reason, "metrics", n_values, backend=False)
                self.tracker._spill([payload])
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
            records = [p for k, p, _ in self.items if k == "metrics"]
            records += [r for k, p, _ in self.current if k == "metrics" for r in p]
            self.tracker._spill(records)
            self.items.clear()
            self.current = []
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
            with self.cond:
                self.current = coalesce(batch)
            while self.current:
                kind, payload, n_values = self.current[0]
                if kind == "stop":
                    self._finished(len(batch))
                    return
                self._handle(kind, payload, n_values)
                with self.cond:
                    if self.abandoned:
                        return
                    self.current.pop(0)
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
                self._record_failure(None, kind, n_values, payload=payload)
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
                self._record_failure(f"{type(err).__name__}: {err}", kind, n_values, payload=payload)
        else:
            self.failing, self.delay = False, self.policy.initial_backoff_s
            with self.cond:
                self.progress += 1

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

    def _record_failure(
        self, error: Optional[str], kind: str, n_values: int, backend: bool = True, payload: Any = None
    ) -> None:
        """Count a dropped record (metric records ``payload`` kept in the spill file); with ``error`` remember it
        and, for a failed backend call, start or extend the back-off. The caller holds ``cond``."""
        if self.abandoned:  # already counted by abandon()
            return
        if kind == "metrics":
            self.dropped += n_values
            if payload is not None:
                self.tracker._spill(payload)
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


def coalesce(batch: List[Tuple[str, Any, int]]) -> List[Tuple[str, Any, int]]:
    """Merge consecutive metric records into one backend call (order kept)."""
    out: List[Tuple[str, Any, int]] = []
    for kind, payload, n in batch:
        if kind == "metrics" and out and out[-1][0] == "metrics":
            out[-1] = ("metrics", out[-1][1] + [payload], out[-1][2] + n)
        else:
            out.append((kind, [payload] if kind == "metrics" else payload, n))
    return out
