"""``CSVLogger``: metrics to a CSV file, hyperparameters to ``hparams.yaml``; no extra dependency.

Format (wide): one row per LOG event, columns ``step`` and then the metric names in the order they
first appeared; a metric absent from an event leaves its cell empty. When a new metric name appears
later the file is rewritten once with the extended header (through a temporary file and an atomic
rename), so the file is always a plain rectangular CSV that ``csv.DictReader`` or ``pandas.read_csv``
reads directly. The run's end status (FINISHED or FAILED) goes to ``status.txt`` beside it.

A new run (not a resume) that finds a previous run's file renames it to ``metrics.1.csv`` (next free
number) rather than mixing two runs in one file. A resumed fit appends to the same file and first
drops the rows written after the checkpoint's step, which the resumed fit logs again.

Where it writes comes from the current run, never from a checkpoint (``run_paths.py``): the file is
``path`` or ``<default_root_dir>/metrics.csv``. It writes over or moves only files trainforge wrote
(listed in the folder's ``.trainforge-owned.json``): ``path=`` beside the user's own metrics file,
``hparams.yaml`` or ``status.txt`` is refused when the logger is built; a default folder holding such
files gets the logger's files in a ``csv_logger/`` subfolder instead, with a warning.
"""

from __future__ import annotations

import csv
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import yaml

from trainforge.callbacks.trackers.base import FailurePolicy, MetricRecords, TrackerCallback, check_text
from trainforge.callbacks.trackers.run_paths import claim, foreign_files, run_relative
from trainforge.strategies.checkpoint.run_lock import RunLock, acquire_run_lock
from trainforge.strategies.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.view import TrainerView

log = logging.getLogger("trainforge")


class CSVLogger(TrackerCallback):
    """Write metrics to ``path`` (default ``<default_root_dir>/metrics.csv``) on the main process."""

    name = "CSVLogger"

    def __init__(self, path: Optional[str] = None, failure_policy: Optional[FailurePolicy] = None) -> None:
        super().__init__(failure_policy)
        self.path = check_text(path, "CSVLogger", "path", "runs/metrics/metrics.csv", path=True)
        if self.path is not None:
            foreign = foreign_files(_targets(os.path.abspath(self.path)))
            if foreign:
                raise ConfigurationError(
                    f"CSVLogger(path={self.path!r}) would overwrite or move {foreign}, which trainforge did not "
                    "write; give it a path in a folder of its own (it writes the CSV file, hparams.yaml and "
                    "status.txt there), or move those files away"
                )
        self._root: Optional[str] = None
        self._file: Optional[str] = None  # resolved path of the current run
        self._resumed_step: Optional[int] = None
        self._started_once = False
        self._fresh = False
        self._hparams: Dict[str, Any] = {}
        self._columns: List[str] = []
        self._lock: Optional[RunLock] = None

    def __repr__(self) -> str:
        return f"CSVLogger(path={self._file or self.path!r})"

    @property
    def file(self) -> Optional[str]:
        """The CSV file of the current (or last) run."""
        return self._file

    @property
    def experiment(self) -> Any:
        """Refused: a CSV file has no backend object to hand out (Lightning's CSVLogger.experiment is its
        own ExperimentWriter, which trainforge does not have)."""
        raise ConfigurationError(
            "CSVLogger.experiment: CSVLogger writes the logged numbers to a CSV file and has no backend object; "
            "log numbers with self.log(...), and for images, text or histograms pass "
            "Trainer(logger=TensorBoardLogger()), whose experiment is TensorBoard's SummaryWriter"
        )

    def state_dict(self) -> Dict[str, Any]:
        # where the file was, relative to the run (for reading only: a resume writes where the current
        # run's settings say, so a copied or downloaded checkpoint never names the file to write)
        return {"file": run_relative(self._file, self._root), "resumed": True}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict.get("resumed") or state_dict.get("path"):  # "path": checkpoints of older versions
            self._resumed_step = -1  # set to the trainer's step in _prepare

    # --- backend ---
    def _store_is_local(self) -> bool:
        return True

    def _prepare(self, trainer: TrainerView) -> None:
        self._hparams = dict(trainer.hparams)
        self._fresh = not self._started_once and self._resumed_step is None
        self._root = os.path.abspath(trainer.default_root_dir)
        wanted = os.path.abspath(self.path) if self.path is not None else os.path.join(self._root, "metrics.csv")
        self._file = _own_place(wanted)
        if self._resumed_step is not None:
            self._resumed_step = int(trainer.global_step)
        self._started_once = True

    @property
    def _run_file(self) -> str:
        assert self._file is not None, "the run's file is resolved (_prepare) before anything is written"
        return self._file

    def _open(self) -> None:
        if self._lock is None:
            self._file, self._lock = _unshared(self._run_file)
        os.makedirs(os.path.dirname(self._run_file), exist_ok=True)
        claim(_targets(self._run_file))
        if self._fresh and os.path.exists(self._run_file) and os.path.getsize(self._run_file) > 0:
            older = _free_name(self._run_file)
            claim([older])
            os.replace(self._run_file, older)  # a previous run's file, written by trainforge (checked in _prepare)
        self._fresh = False
        header, rows = self._read()
        if self._resumed_step is not None:
            # Rows after the checkpoint's step are logged again by the resumed fit.
            rows = [r for r in rows if not r.get("step") or int(float(r["step"])) <= self._resumed_step]
            self._rewrite(header, rows)
            self._resumed_step = None
        self._columns = header[1:] if header else []

    def _write_params(self, params: Dict[str, Any]) -> None:
        target = os.path.join(os.path.dirname(self._run_file), "hparams.yaml")
        _atomic_write(target, yaml.safe_dump(_plain(self._hparams), sort_keys=False))

    def _write_metrics(self, records: MetricRecords) -> None:
        new = [k for _, values in records for k in values if k not in self._columns]
        if new or not os.path.exists(self._run_file) or os.path.getsize(self._run_file) == 0:
            header, rows = self._read()
            self._columns += list(dict.fromkeys(new))
            self._rewrite(["step"] + self._columns, rows)
        with open(self._run_file, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step"] + self._columns)
            for step, values in records:
                writer.writerow({"step": step, **{k: repr(float(v)) for k, v in values.items()}})

    def _close(self, status: str) -> None:
        _atomic_write(os.path.join(os.path.dirname(self._run_file), "status.txt"), status + "\n")
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --- file helpers ---
    def _read(self):
        if not os.path.exists(self._run_file):
            return [], []
        with open(self._run_file, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return list(reader.fieldnames or []), rows

    def _rewrite(self, header: List[str], rows: List[Dict[str, str]]) -> None:
        tmp = _temporary(self._run_file)
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header or ["step"])
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self._run_file)


def _targets(file: str) -> List[str]:
    """Every file the logger writes for the CSV file ``file``."""
    folder = os.path.dirname(file)
    return [file, os.path.join(folder, "hparams.yaml"), os.path.join(folder, "status.txt")]


def _own_place(wanted: str) -> str:
    """``wanted``, or the same name in a ``csv_logger`` subfolder when ``wanted``'s folder holds files of
    the same names that trainforge did not write (said once, as a warning)."""
    candidate, n = wanted, 0
    while foreign_files(_targets(candidate)):
        sub = "csv_logger" if n == 0 else f"csv_logger.{n}"
        candidate, n = os.path.join(os.path.dirname(wanted), sub, os.path.basename(wanted)), n + 1
        if n > 1000:
            raise FileExistsError(f"no folder of its own left for {wanted}")
    if candidate != wanted:
        log.warning(
            "trainforge: CSVLogger leaves %s alone (not written by trainforge) and writes to %s",
            foreign_files(_targets(wanted)),
            candidate,
        )
    return candidate


def _free_name(path: str) -> str:
    stem, ext = os.path.splitext(path)
    for n in range(1, 100_000):
        candidate = f"{stem}.{n}{ext}"
        if not os.path.exists(candidate):
            return candidate
    raise FileExistsError(f"no free name left for an old {path}")


def _temporary(path: str) -> str:
    # A name of this write's own: a shared one let two writers truncate each other's rows.
    return f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


def _unshared(wanted: str) -> tuple[str, RunLock]:
    """``wanted``, held for this run (a lock beside it), unless another process is writing it: then the same
    name in the first ``csv_logger.<n>`` subfolder without a CSV file and nobody writing there (warned), so
    that neither run truncates, drops or renames the other's rows."""
    candidate, n = wanted, 0
    while True:
        folder, name = os.path.split(candidate)
        fresh = candidate == wanted or not os.path.exists(candidate)
        if fresh and not foreign_files(_targets(candidate)):
            try:
                lock = acquire_run_lock(folder, name=f".{name}.lock")
                break
            except CheckpointError:
                pass
        n += 1
        candidate = os.path.join(os.path.dirname(wanted), f"csv_logger.{n}", os.path.basename(wanted))
        if n > 1000:
            raise FileExistsError(f"no folder of its own left for {wanted}")
    if candidate != wanted:
        log.warning(
            "trainforge: CSVLogger: another process is writing %s; this run writes its metrics to %s instead",
            wanted,
            candidate,
        )
    return candidate, lock


def _atomic_write(path: str, text: str) -> None:
    tmp = _temporary(path)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    """Make hyperparameters YAML-safe: mappings, lists and scalars kept; anything else a string."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
