"""``TensorBoardLogger``: event files read by TensorBoard, via ``torch.utils.tensorboard.SummaryWriter``.

Lightning's ``TensorBoardLogger(save_dir, name="lightning_logs", version=None, log_graph=False,
default_hp_metric=True, prefix="", sub_dir=None, **kwargs)`` (``kwargs``: SummaryWriter's). Where:
``<save_dir>/<name>/version_<N>[/<sub_dir>]`` (Lightning's layout, ``versioned.py``: ``save_dir`` None is the
Trainer's ``default_root_dir``, the next free ``N`` unless ``version`` is given), so that every new run is its own
TensorBoard run; ``log_dir=`` (trainforge's, keyword only) names the folder itself. ``hparams.yaml`` beside the
events holds the module's hyperparameters as Lightning writes it; ``default_hp_metric``: ``hp_metric`` = -1 at
step 0, as Lightning; ``log_graph=True``: ``add_graph(module, module.example_input_array)`` at fit start.
Hyperparameters go both to the HParams plugin (one session, values as numbers/strings/bools) and as a
markdown table under the text tag ``hparams``; metrics are scalars at the LOG step (a group,
Accelerate's ``log({"glue": {"f1": ...}})``, goes through ``add_scalars`` as Accelerate writes it: tag
``glue`` in a run ``<dir>/glue_f1`` per name). A run that ends
in an exception gets the text ``status`` = FAILED.

Resume: ``fit(ckpt_path="last")`` and ``Trainer(resume="auto")`` go on in the newest version folder, where the
checkpoints are (``versioned.py``); another checkpoint path starts a new version, as Lightning. A resumed fit passes
``purge_step`` so TensorBoard hides the events the crashed run wrote after the checkpoint's step.
SummaryWriter writes files on its own thread; an I/O error there is logged by TensorBoard rather than
raised, so the failure policy sees only errors raised by the calls themselves.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

import yaml

from trainforge.callbacks.trackers.base import FailurePolicy, MetricRecords, TrackerCallback, check_text, require
from trainforge.callbacks.trackers.run_paths import claim, foreign_files, run_relative
from trainforge.callbacks.trackers.versioned import VersionedDir, check_prefix, module_hparams, plain_params
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.view import TrainerView

log = logging.getLogger("trainforge")


class TensorBoardLogger(TrackerCallback):
    """Log to TensorBoard event files on the main process. See the module docstring."""

    keeps_groups = True  # written as Accelerate's TensorBoardTracker does, with add_scalars

    def __init__(
        self,
        save_dir: Optional[str] = None,
        name: Optional[str] = "lightning_logs",
        version: Optional[Union[int, str]] = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: Optional[str] = None,
        *,
        log_dir: Optional[str] = None,
        failure_policy: Optional[FailurePolicy] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(failure_policy)
        require("tensorboard", "tensorboard", "TensorBoardLogger")  # torch.utils.tensorboard needs it
        self._dirs = VersionedDir("TensorBoardLogger", save_dir, name, version, sub_dir)
        self._given_dir = check_text(log_dir, "TensorBoardLogger", "log_dir", "runs/tensorboard", path=True)
        if self._given_dir is not None and (save_dir is not None or version is not None):
            raise ConfigurationError(
                f"TensorBoardLogger(save_dir={save_dir!r}, version={version!r}, log_dir={log_dir!r}): log_dir names "
                "the folder itself; pass either log_dir or save_dir/name/version"
            )
        for arg, value in (("log_graph", log_graph), ("default_hp_metric", default_hp_metric)):
            if not isinstance(value, bool):
                raise ConfigurationError(f"TensorBoardLogger({arg}={value!r}): {arg} must be True or False")
        self.log_graph, self.default_hp_metric = log_graph, default_hp_metric
        self.prefix = check_prefix(prefix, "TensorBoardLogger")
        unknown = sorted(set(kwargs) - _WRITER_ARGS)
        if unknown:
            raise ConfigurationError(
                f"TensorBoardLogger({unknown[0]}=...): not an argument of TensorBoardLogger or of SummaryWriter "
                f"(which takes {', '.join(sorted(_WRITER_ARGS))})"
            )
        self._writer_args = dict(kwargs)
        self._yaml_hparams: Dict[str, Any] = {}
        self._dir: Optional[str] = None
        self._root: Optional[str] = None
        self._resumed = False
        self._purge_step: Optional[int] = None
        self._summary: Any = None  # the SummaryWriter, opened lazily (torch.utils.tensorboard imports tensorboard)

    def __repr__(self) -> str:
        return f"TensorBoardLogger(log_dir={self._dir or self._given_dir!r})"

    # --- Lightning's names ---
    @property
    def name(self) -> str:  # type: ignore[override]  # Lightning's: the experiment's folder name
        return self._dirs.name

    @property
    def version(self) -> Optional[Union[int, str]]:
        """Lightning's: the version folder's number (or name); None with ``log_dir=``."""
        return None if self._given_dir is not None else self._dirs.version

    @property
    def save_dir(self) -> str:
        return os.path.dirname(self._given_dir) if self._given_dir is not None else self._dirs.required_save_dir()

    @property
    def root_dir(self) -> str:
        return os.path.dirname(self._given_dir) if self._given_dir is not None else self._dirs.root_dir

    @property
    def sub_dir(self) -> Optional[str]:
        return self._dirs.sub_dir

    @property
    def log_dir(self) -> str:
        """The event files' folder: ``<save_dir>/<name>/version_<N>[/<sub_dir>]`` (Lightning)."""
        return os.path.abspath(self._given_dir) if self._given_dir is not None else self._dirs.log_dir

    def log_hyperparams(self, params: Any, metrics: Any = None, step: Optional[int] = None) -> None:
        """Lightning's: add ``params`` (a dict or an ``argparse.Namespace``) to the run's hyperparameters
        (``hparams.yaml`` and TensorBoard's HParams); ``metrics``, if given, are logged at ``step`` (0)."""
        self._yaml_hparams.update(plain_params(params, "TensorBoardLogger"))
        if self._writer is not None:
            self._writer.put("params", dict(self._yaml_hparams))
            if metrics:
                self._writer.put("metrics", (int(step or 0), {str(k): float(v) for k, v in metrics.items()}), 1)

    def settle(self, default_root_dir: str, broadcast: Any, continuing: bool = False) -> None:
        """Fix the version folder on every rank (``versioned.py``); the Trainer calls it at the start of a fit."""
        if self._given_dir is None:
            self._dirs.settle(default_root_dir, broadcast, continuing)

    def place(self, default_root_dir: str) -> None:
        if self._given_dir is None:
            self._dirs.place(default_root_dir)

    def version_dir(self, default_root_dir: str) -> Optional[str]:
        return None if self._given_dir is not None else self._dirs.version_dir(default_root_dir)

    def on_fit_start(self, trainer: TrainerView, module: Any) -> None:
        super().on_fit_start(trainer, module)
        if self.log_graph and trainer.is_global_zero:
            self._add_graph(module)

    def on_log(self, trainer: TrainerView, module: Any, metrics: Dict[str, Any], step: int) -> None:
        if self.prefix:  # Lightning's: "<prefix>-<name>"
            metrics = {f"{self.prefix}-{key}": value for key, value in metrics.items()}
        super().on_log(trainer, module, metrics, step)

    def _add_graph(self, module: Any) -> None:
        example = getattr(module, "example_input_array", None)
        if example is None:
            log.warning(
                "trainforge: TensorBoardLogger(log_graph=True) could not log the graph: set "
                "module.example_input_array (the forward's input, a tensor or a tuple of them)"
            )
            return
        device = next((p.device for p in module.parameters()), None)
        if device is not None:
            example = tuple(t.to(device) for t in example) if isinstance(example, tuple) else example.to(device)
        self.experiment.add_graph(module, example)

    @property
    def directory(self) -> Optional[str]:
        """The event-file directory of the current (or last) run."""
        return self._dir

    def state_dict(self) -> Dict[str, Any]:
        return {"log_dir": run_relative(self._dir, self._root)}  # relative to the run (run_paths.py)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict:
            self._resumed = True  # the version folder is the checkpoint's (settle, continuing): purge_step hides

    # --- backend ---
    def _prepare(self, trainer: TrainerView) -> None:
        self._root = os.path.abspath(trainer.default_root_dir)
        self._yaml_hparams = {**module_hparams(trainer.hparams), **self._yaml_hparams}
        if self._given_dir is not None:
            self._dir = os.path.abspath(self._given_dir)
        else:  # the version the Trainer settled (a validate/test run: picked here, only this rank writes)
            self._dirs.place(self._root)
            self._dir = os.path.abspath(self._dirs.log_dir)
        self._purge_step = int(trainer.global_step) + 1 if self._resumed else None
        self._resumed = False

    def _store_is_local(self) -> bool:
        return True

    def _open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        options = {**self._writer_args}
        if self._purge_step is not None:
            options["purge_step"] = self._purge_step
            _after_existing_events(self._dir)
        self._summary = SummaryWriter(log_dir=self._dir, **options)

    def _backend(self) -> Any:
        return self._summary  # the SummaryWriter (Lightning's TensorBoardLogger.experiment)

    def _write_params(self, params: Dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        values = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in params.items()}
        hp_metric = {"hp_metric": -1} if self.default_hp_metric else {}  # Lightning's placeholder metric
        for summary in hparams(values, hp_metric):  # experiment, session start and session end summaries
            self._summary.file_writer.add_summary(summary)
        for key, value in hp_metric.items():
            self._summary.add_scalar(key, value, 0)
        self._write_hparams_yaml()
        rows = "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in values.items())
        self._summary.add_text("hparams", "| name | value |\n|---|---|\n" + rows)
        self._summary.flush()

    def _write_hparams_yaml(self) -> None:
        """Lightning's ``hparams.yaml`` beside the events: the module's hyperparameters. A file of that name
        that trainforge did not write (a version folder given again, holding the user's) is left alone."""
        assert self._dir is not None, "the run's folder is resolved (_prepare) before anything is written"
        target = os.path.join(self._dir, "hparams.yaml")
        if foreign_files([target]):
            log.warning("trainforge: TensorBoardLogger leaves %s alone (not written by trainforge)", target)
            return
        claim([target])
        with open(target, "w") as f:
            yaml.safe_dump(_yaml_safe(self._yaml_hparams), f)

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


#: SummaryWriter's arguments that TensorBoardLogger(**kwargs) hands on (log_dir is the logger's own).
_WRITER_ARGS = frozenset({"comment", "max_queue", "flush_secs", "filename_suffix"})


def _after_existing_events(folder: Optional[str]) -> None:
    """Wait (at most a second) until the clock is past the newest event file's second in ``folder``: TensorBoard
    reads a folder's files in name order, ``events.out.tfevents.<second>.<host>.<pid>.<n>``, and within one second
    ``<n>`` (a per-process count) may sort a resumed run's file, whose purge hides the replayed steps, first."""
    stamps = []
    for name in os.listdir(folder) if folder and os.path.isdir(folder) else []:
        parts = name.split(".")
        if name.startswith("events.out.tfevents.") and len(parts) > 3 and parts[3].isdigit():
            stamps.append(int(parts[3]))
    wait = max(stamps, default=0) + 1 - time.time()
    if 0 < wait <= 1:
        time.sleep(wait)


def _yaml_safe(value: Any) -> Any:
    """Hyperparameters as YAML can hold them: mappings, lists and scalars kept; anything else a string."""
    if isinstance(value, dict):
        return {str(k): _yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
