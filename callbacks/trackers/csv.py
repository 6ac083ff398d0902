"""``CSVLogger``: metrics to ``metrics.csv``, hyperparameters to ``hparams.yaml``, as Lightning writes them.

Where (Lightning's layout, ``versioned.py``): ``<save_dir>/<name>/version_<N>/`` (``save_dir`` None: the Trainer's
``default_root_dir``; ``name`` ``"lightning_logs"``; the next free ``N`` unless ``version`` is given), so a second
run gets ``version_<N+1>`` and its own files. ``path=`` (trainforge's, keyword only) names the CSV file itself.

Format (Lightning's ``ExperimentWriter``): one row per LOG event, with the metrics of that event, ``epoch`` (the
Trainer's epoch, added to every event as Lightning adds it) and ``step``; the columns are every name seen so far,
sorted; a metric absent from an event leaves its cell empty; a new name rewrites the file once with the extended
header (through a temporary file and an atomic rename). ``hparams.yaml``: the module's (and datamodule's)
``save_hyperparameters``, as Lightning dumps them (``yaml``, keys sorted). The run's end status (FINISHED or
FAILED) goes to ``status.txt`` beside them (trainforge's).

A version folder or ``path=`` file that already holds a metrics file trainforge wrote (a ``version`` or ``path``
given again) is started afresh, with a warning, as Lightning does. A resumed fit (a checkpoint restored, or
``Trainer(resume="auto")``) appends to the checkpoint's file and first drops the rows written after the
checkpoint's step, which the resumed fit logs again.

Where it writes comes from the current run, never from a checkpoint (``run_paths.py``). It writes over only files
trainforge wrote (listed in the folder's ``.trainforge-owned.json``): ``path=`` beside the user's own metrics file,
``hparams.yaml`` or ``status.txt`` is refused when the logger is built; a folder holding such files gets the
logger's files in a ``csv_logger/`` subfolder instead, with a warning.
"""

from __future__ import annotations

import csv
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import yaml

from trainforge.callbacks.trackers.base import FailurePolicy, MetricRecords, TrackerCallback, check_text
from trainforge.callbacks.trackers.run_paths import claim, foreign_files, run_relative
from trainforge.callbacks.trackers.versioned import (
    VersionedDir,
    check_positive,
    check_prefix,
    module_hparams,
    plain_params,
)
from trainforge.strategies.checkpoint.run_lock import RunLock, acquire_run_lock
from trainforge.strategies.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.view import TrainerView

log = logging.getLogger("trainforge")


class CSVLogger(TrackerCallback):
    """Lightning's ``CSVLogger(save_dir, name, version, prefix, flush_logs_every_n_steps)``, written on the main
    process; ``path`` (keyword only) names the CSV file instead. See the module docstring."""

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        save_dir: Optional[str] = None,
        name: Optional[str] = "lightning_logs",
        version: Optional[Union[int, str]] = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        *,
        path: Optional[str] = None,
        failure_policy: Optional[FailurePolicy] = None,
    ) -> None:
        super().__init__(failure_policy)
        if isinstance(save_dir, (str, os.PathLike)) and os.fspath(save_dir).endswith(".csv"):
            raise ConfigurationError(
                f"CSVLogger(save_dir={os.fspath(save_dir)!r}): save_dir is the folder that gets "
                "<name>/version_<N>/metrics.csv (Lightning's layout); to name the CSV file itself pass "
                f"CSVLogger(path={os.fspath(save_dir)!r})"
            )
        self._dirs = VersionedDir("CSVLogger", save_dir, name, version)
        self.prefix = check_prefix(prefix, "CSVLogger")
        self.flush_logs_every_n_steps = check_positive(
            flush_logs_every_n_steps, "CSVLogger", "flush_logs_every_n_steps"
        )
        self.path = check_text(path, "CSVLogger", "path", "runs/metrics/metrics.csv", path=True)
        if self.path is not None:
            if save_dir is not None or version is not None:
                raise ConfigurationError(
                    f"CSVLogger(save_dir={save_dir!r}, version={version!r}, path={self.path!r}): path names the "
                    "file itself; pass either path or save_dir/name/version"
                )
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

    # --- Lightning's names ---
    @property
    def name(self) -> str:  # type: ignore[override]  # Lightning's: the experiment's folder name
        return self._dirs.name

    @property
    def version(self) -> Optional[Union[int, str]]:
        """Lightning's: the version folder's number (or name); None with ``path=``."""
        return None if self.path is not None else self._dirs.version

    @property
    def save_dir(self) -> str:
        return os.path.dirname(self.path) if self.path is not None else self._dirs.required_save_dir()

    @property
    def root_dir(self) -> str:
        return os.path.dirname(self.path) if self.path is not None else self._dirs.root_dir

    @property
    def log_dir(self) -> str:
        """Where metrics.csv and hparams.yaml go: ``<save_dir>/<name>/version_<N>`` (Lightning)."""
        return os.path.dirname(os.path.abspath(self.path)) if self.path is not None else self._dirs.log_dir

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

    def log_hyperparams(self, params: Any) -> None:
        """Lightning's: add ``params`` (a dict or an ``argparse.Namespace``) to ``hparams.yaml``."""
        self._hparams.update(plain_params(params, "CSVLogger"))
        if self._writer is not None:
            self._writer.put("params", dict(self._hparams))

    def settle(self, default_root_dir: str, broadcast: Any, continuing: bool = False) -> None:
        """Fix the version folder on every rank (``versioned.py``); the Trainer calls it at the start of a fit."""
        if self.path is None:
            self._dirs.settle(default_root_dir, broadcast, continuing)

    def place(self, default_root_dir: str) -> None:
        if self.path is None:
            self._dirs.place(default_root_dir)

    def version_dir(self, default_root_dir: str) -> Optional[str]:
        return None if self.path is not None else self._dirs.version_dir(default_root_dir)

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
        self._hparams = {**module_hparams(trainer.hparams), **self._hparams}
        self._fresh = not self._started_once and self._resumed_step is None
        self._root = os.path.abspath(trainer.default_root_dir)
        if self.path is not None:
            wanted = os.path.abspath(self.path)
        else:
            self._dirs.place(self._root)  # validate/test: only this rank writes, the version picked here if not yet
            wanted = os.path.join(os.path.abspath(self._dirs.log_dir), "metrics.csv")
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
            # a version (or path) given again: started afresh, as Lightning (a file trainforge wrote: checked)
            log.warning(
                "trainforge: CSVLogger: %s holds the metrics of an earlier run; this run writes a new file "
                "in its place (as Lightning). To keep both, leave version=None: each run gets its own version_<N>",
                self._run_file,
            )
            os.remove(self._run_file)
        self._fresh = False
        header, rows = self._read()
        if self._resumed_step is not None:
            # Rows after the checkpoint's step are logged again by the resumed fit.
            rows = [r for r in rows if not r.get("step") or int(float(r["step"])) <= self._resumed_step]
            self._rewrite(header, rows)
            self._resumed_step = None
        self._columns = header

    def _write_params(self, params: Dict[str, Any]) -> None:
        if not self._hparams:
            return  # Lightning's CSVLogger writes no hparams.yaml for a module without hyperparameters
        target = os.path.join(os.path.dirname(self._run_file), "hparams.yaml")
        _atomic_write(target, yaml.safe_dump(_plain(self._hparams)))

    def _write_metrics(self, records: MetricRecords) -> None:
        rows = [self._row(step, values) for step, values in records]
        new = sorted({k for row in rows for k in row} - set(self._columns))
        if new or not os.path.exists(self._run_file) or os.path.getsize(self._run_file) == 0:
            header, old = self._read()
            self._columns = sorted(set(self._columns) | set(new))
            self._rewrite(self._columns, old)
        with open(self._run_file, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self._columns).writerows(rows)

    def _row(self, step: int, values: Dict[str, Any]) -> Dict[str, Any]:
        """One LOG event as Lightning's ExperimentWriter writes it: the prefixed metrics, ``epoch``, ``step``."""
        join = self.LOGGER_JOIN_CHAR
        row: Dict[str, Any] = {}
        for key, value in values.items():
            # Lightning adds the epoch as an int
            written = int(value) if key == "epoch" and float(value).is_integer() else repr(float(value))
            row[f"{self.prefix}{join}{key}" if self.prefix else key] = written
        row["step"] = int(step)
        return row

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
