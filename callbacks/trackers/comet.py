"""``CometLogger``: parameters and metrics of a run in Comet, online or offline.

Mode: online when an API key is available (``api_key=`` or the ``COMET_API_KEY`` environment
variable), otherwise offline: ``comet_ml.OfflineExperiment`` writes a zip archive under
``<default_root_dir>/comet`` (upload it later with ``comet upload <file>.zip``). ``offline=True``
forces offline mode even with a key; ``offline=False`` without a key is a configuration error.

The API key is never shown: not in ``repr``, warnings, logged parameters, ``state_dict`` or error
messages (the failure policy redacts it), and it is not handed to the offline experiment.
Comet's automatic logging (stdout capture, code, git, environment, system metrics) is switched off:
the tracker logs what the Trainer reports, nothing else.

Resume: ``state_dict`` holds the experiment key; a resumed fit continues that experiment
(``ExistingExperiment`` online, ``ExistingOfflineExperiment`` offline, which writes a second archive
that Comet appends to the same experiment on upload).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from trainforge.callbacks.trackers.base import FailurePolicy, MetricRecords, TrackerCallback, check_text, require
from trainforge.callbacks.trackers.run_paths import resolve_in_run, run_relative
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.view import TrainerView

# Comet's automatic collection, all off (these keywords exist on all four experiment classes).
_QUIET = dict(
    log_code=False,
    log_graph=False,
    auto_param_logging=False,
    auto_metric_logging=False,
    parse_args=False,
    auto_output_logging=False,
    log_env_details=False,
    log_git_metadata=False,
    log_git_patch=False,
    log_env_gpu=False,
    log_env_host=False,
    log_env_cpu=False,
    display_summary_level=0,
)


class CometLogger(TrackerCallback):
    """Log to Comet on the main process. See the module docstring."""

    name = "CometLogger"
    keeps_groups = True  # log_metrics(group) as Accelerate's CometMLTracker: the group's names, unprefixed

    def __init__(
        self,
        api_key: Optional[str] = None,
        project_name: Optional[str] = None,
        workspace: Optional[str] = None,
        offline: Optional[bool] = None,
        offline_directory: Optional[str] = None,
        experiment_key: Optional[str] = None,
        failure_policy: Optional[FailurePolicy] = None,
    ) -> None:
        super().__init__(failure_policy)
        require("comet_ml", "comet", "CometLogger")
        key = api_key or os.environ.get("COMET_API_KEY") or None
        if offline is None:
            offline = key is None
        if not offline and key is None:
            raise ConfigurationError(
                "CometLogger(offline=False) needs an API key, and none was given: pass api_key=... or "
                "set the COMET_API_KEY environment variable, or use offline=True to write an archive"
            )
        self.offline = bool(offline)
        self.__api_key = None if self.offline else key  # name-mangled, never printed
        self._known_secret = key
        self.project_name = check_text(project_name, "CometLogger", "project_name", "my-project")
        self.workspace = check_text(workspace, "CometLogger", "workspace", "my-team")
        self.offline_directory = check_text(offline_directory, "CometLogger", "offline_directory", "runs/comet", True)
        self._experiment_key = check_text(experiment_key, "CometLogger", "experiment_key", "0123abcd" * 4)
        self._directory: Optional[str] = None
        self._root: Optional[str] = None
        self._saved_directory: Optional[str] = None
        self._experiment: Any = None  # the comet_ml experiment, opened lazily (comet_ml is optional)

    def __repr__(self) -> str:
        mode = "offline" if self.offline else "online"
        return (
            f"CometLogger(mode={mode!r}, project_name={self.project_name!r}, workspace={self.workspace!r}, "
            f"experiment_key={self._experiment_key!r}, api_key={'<set>' if self._known_secret else None})"
        )

    @property
    def experiment_key(self) -> Optional[str]:
        self._wait_opened(self.failure_policy.flush_timeout_s)
        return self._experiment_key

    @property
    def offline_dir(self) -> Optional[str]:
        """Where offline archives are written (known once the run started)."""
        return self._directory

    def state_dict(self) -> Dict[str, Any]:
        self._wait_opened()
        return {
            "experiment_key": self._experiment_key,
            "offline": self.offline,
            "offline_directory": run_relative(self._directory, self._root),
        }  # relative to the run

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict.get("experiment_key"):
            self._experiment_key = state_dict["experiment_key"]
        self._saved_directory = state_dict.get("offline_directory")  # resolved inside the run in _prepare

    def _secrets(self) -> List[str]:
        return [self._known_secret] if self._known_secret else []

    # --- backend ---
    def _prepare(self, trainer: TrainerView) -> None:
        self._root = os.path.abspath(trainer.default_root_dir)
        saved, self._saved_directory = self._saved_directory, None
        restored = resolve_in_run(saved, self._root) if self.offline_directory is None else None
        self._directory = restored or os.path.abspath(self.offline_directory or os.path.join(self._root, "comet"))

    def _open(self) -> None:
        import comet_ml as comet

        kwargs: Dict[str, Any] = dict(_QUIET, project_name=self.project_name, workspace=self.workspace)
        cls: Callable[..., Any]
        if self.offline:
            assert self._directory is not None, "the offline directory is resolved before the run opens"
            os.makedirs(self._directory, exist_ok=True)
            kwargs["offline_directory"] = self._directory
            cls = comet.ExistingOfflineExperiment if self._experiment_key else comet.OfflineExperiment
        else:
            kwargs["api_key"] = self.__api_key
            cls = comet.ExistingExperiment if self._experiment_key else comet.Experiment
        if self._experiment_key:
            kwargs["experiment_key"] = self._experiment_key
        experiment = cls(**kwargs)
        if not experiment.alive:  # Comet reports connection problems by logging, not raising
            experiment.end()
            raise ConnectionError("the Comet experiment could not be started (see the COMET messages above)")
        self._experiment = experiment
        self._experiment_key = experiment.get_key()

    def _write_params(self, params: Dict[str, Any]) -> None:
        secret = self._known_secret
        clean = {k: ("***" if secret and isinstance(v, str) and secret in v else v) for k, v in params.items()}
        self._experiment.log_parameters(clean)

    def _write_metrics(self, records: MetricRecords) -> None:
        for step, values in records:
            groups = {k: v for k, v in values.items() if isinstance(v, dict)}
            scalars = {k: v for k, v in values.items() if k not in groups}
            # as Accelerate's CometMLTracker: a group's names unprefixed
            for metrics in ([scalars] if scalars else []) + list(groups.values()):
                self._experiment.log_metrics(metrics, step=step)

    def _backend(self) -> Any:
        return self._experiment  # the comet_ml Experiment (Lightning's CometLogger.experiment)

    def _close(self, status: str) -> None:
        if status != "FINISHED":
            self._experiment.log_other("trainforge_status", status)
        self._experiment.end()
        self._experiment = None
