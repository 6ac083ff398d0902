"""``TensorBoardLogger``: event files read by TensorBoard, via ``torch.utils.tensorboard.SummaryWriter``.

Where: ``log_dir`` if given, else ``<default_root_dir>/tensorboard/version_<n>`` with the next free
``n``, so that every new run is its own TensorBoard run instead of being mixed into the previous one.
Hyperparameters go both to the HParams plugin (one session, values as numbers/strings/bools) and as a
markdown table under the text tag ``hparams``; metrics are scalars at the LOG step (a group,
Accelerate's ``log({"glue": {"f1": ...}})``, goes through ``add_scalars`` as Accelerate writes it: tag
``glue`` in a run ``<dir>/glue_f1`` per name). A run that ends
in an exception gets the text ``status`` = FAILED.

Resume: ``state_dict`` holds the directory relative to the run (a resumed fit writes to it when it
lies inside the current run, see ``run_paths.py``) and passes
``purge_step`` so TensorBoard hides the events the crashed run wrote after the checkpoint's step.
SummaryWriter writes files on its own thread; an I/O error there is logged by TensorBoard rather than
raised, so the failure policy sees only errors raised by the calls themselves.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any, Dict, Optional

from trainforge.callbacks.trackers.base import FailurePolicy, MetricRecords, TrackerCallback, check_text, require
from trainforge.callbacks.trackers.run_paths import resolve_in_run, run_relative

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.view import TrainerView

log = logging.getLogger("trainforge")


class TensorBoardLogger(TrackerCallback):
    """Log to TensorBoard event files on the main process. See the module docstring."""

    name = "TensorBoardLogger"
    keeps_groups = True  # written as Accelerate's TensorBoardTracker does, with add_scalars

    def __init__(self, log_dir: Optional[str] = None, failure_policy: Optional[FailurePolicy] = None) -> None:
        super().__init__(failure_policy)
        require("tensorboard", "tensorboard", "TensorBoardLogger")  # torch.utils.tensorboard needs it
        self.log_dir = check_text(log_dir, "TensorBoardLogger", "log_dir", "runs/tensorboard", path=True)
        self._dir: Optional[str] = None
        self._root: Optional[str] = None
        self._saved_dir: Optional[str] = None
        self._resumed = False
        self._purge_step: Optional[int] = None
        self._summary: Any = None  # the SummaryWriter, opened lazily (torch.utils.tensorboard imports tensorboard)

    def __repr__(self) -> str:
        return f"TensorBoardLogger(log_dir={self._dir or self.log_dir!r})"

    @property
    def directory(self) -> Optional[str]:
        """The event-file directory of the current (or last) run."""
        return self._dir

    def state_dict(self) -> Dict[str, Any]:
        return {"log_dir": run_relative(self._dir, self._root)}  # relative to the run (run_paths.py)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict:
            self._saved_dir = state_dict.get("log_dir")
            self._resumed = True

    # --- backend ---
    def _prepare(self, trainer: TrainerView) -> None:
        self._root = os.path.abspath(trainer.default_root_dir)
        saved, self._saved_dir = self._saved_dir, None
        if self.log_dir is not None:
            self._dir = os.path.abspath(self.log_dir)
        elif saved is not None:  # resumed: the checkpoint's directory, if it lies inside this run
            self._dir = resolve_in_run(saved, self._root)
            if self._dir is None:
                self._dir = _next_version(os.path.join(self._root, "tensorboard"))
                log.warning(
                    "trainforge: the checkpoint's TensorBoard directory %r is outside this run (%s); "
                    "writing to %s instead",
                    saved,
                    self._root,
                    self._dir,
                )
        elif self._dir is None:
            self._dir = _next_version(os.path.join(self._root, "tensorboard"))
        self._purge_step = int(trainer.global_step) + 1 if self._resumed else None
        self._resumed = False

    def _store_is_local(self) -> bool:
        return True

    def _open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._summary = SummaryWriter(log_dir=self._dir, purge_step=self._purge_step)

    def _backend(self) -> Any:
        return self._summary  # the SummaryWriter (Lightning's TensorBoardLogger.experiment)

    def _write_params(self, params: Dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        values = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in params.items()}
        for summary in hparams(values, {}):  # experiment, session start and session end summaries
            self._summary.file_writer.add_summary(summary)
        rows = "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in values.items())
        self._summary.add_text("hparams", "| name | value |\n|---|---|\n" + rows)
        self._summary.flush()

    def _write_metrics(self, records: MetricRecords) -> None:
        for step, values in records:
            for key, value in values.items():
                if isinstance(value, dict):  # SummaryWriter.add_scalars: one run per name, <dir>/<key>_<name>
                    self._summary.add_scalars(key, value, step)
                else:
                    self._summary.add_scalar(key, value, step)
        self._summary.flush()

    def _close(self, status: str) -> None:
        if status != "FINISHED":
            self._summary.add_text("status", status)
        self._summary.close()
        self._summary = None


def _next_version(root: str) -> str:
    taken = [int(m.group(1)) for m in (re.fullmatch(r"version_(\d+)", d) for d in _listdir(root)) if m]
    return os.path.join(root, f"version_{max(taken, default=-1) + 1}")


def _listdir(path: str):
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
