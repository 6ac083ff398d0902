"""Accelerate's experiment tracking on the ``Accelerator``: ``log_with=``, ``init_trackers``, ``log``,
``get_tracker``, ``trackers`` and ``end_training``, done by ``Trackers``, a part the Accelerator builds.

The trackers are trainforge's own (``callbacks/trackers/``), driven through the same hooks the Trainer
calls, so they keep their failure policy (a slow or dead backend never stalls the loop; writes happen on
a background thread). Names: ``"tensorboard"`` (``TensorBoardLogger``, in
``<logging_dir>/<project_name>``), ``"mlflow"`` (``MLflowLogger``, experiment ``project_name``; its
default store is ``<logging_dir>/mlflow.db``), ``"comet_ml"`` (``CometLogger``, project
``project_name``), ``"wandb"`` (``WandbLogger``, project ``project_name``, in ``<logging_dir>/wandb``),
``"csv"`` (``CSVLogger``, ``<logging_dir>/<project_name>/metrics.csv``; trainforge's,
not in Accelerate), ``"all"`` (each of those whose package is installed), or a ``TrackerCallback``
instance. ``init_kwargs={"<name>": {...}}`` go to that tracker's constructor.
"""

from __future__ import annotations

import enum
import importlib.util
import inspect
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple, cast

from trainforge.callbacks.trackers.base import TrackerCallback, require
from trainforge.strategies.errors import ConfigurationError, invalid_choice


class OffMainTracker:
    """What ``get_tracker`` returns on a process other than the main one (Accelerate's blank
    ``GeneralTracker``): trackers live on the main process only, and every method called on this
    one does nothing and returns None."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _does_nothing

    def __repr__(self) -> str:
        return f"OffMainTracker({self.name!r}: the tracker lives on the main process)"


def _does_nothing(*args: Any, **kwargs: Any) -> None:
    return None


LOG_WITH = ("all", "tensorboard", "mlflow", "comet_ml", "wandb", "csv")
# name -> (package it needs or None, pip extra, class name in trainforge.callbacks)
_TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard", "TensorBoardLogger"),
    "mlflow": ("mlflow", "mlflow", "MLflowLogger"),
    "comet_ml": ("comet_ml", "comet", "CometLogger"),
    "wandb": ("wandb", "wandb", "WandbLogger"),
    "csv": (None, "", "CSVLogger"),
}
_WRITE_IN_LOGGING_DIR = ("tensorboard", "csv")


def parse_log_with(log_with: Any, logging_dir: Optional[str]) -> List[Any]:
    """``log_with`` as a list of tracker names and ``TrackerCallback`` instances, checked now (before any
    work): known names, their packages installed, a logging directory for those that write files."""
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    out: List[Any] = []
    for item in items:
        if isinstance(item, TrackerCallback):
            out.append(item)
            continue
        name = str(item.value if isinstance(item, enum.Enum) else item).lower()
        if name not in LOG_WITH:
            raise invalid_choice(
                "log_with",
                item,
                LOG_WITH,
                "or a TrackerCallback instance (trainforge.callbacks: CSVLogger(), MLflowLogger(), ...). "
                "trainforge has no tracker of that name",
            )
        names = (
            [n for n, (pkg, _, _) in _TRACKERS.items() if pkg is None or _installed(pkg)] if name == "all" else [name]
        )
        for n in names:
            package, extra, cls_name = _TRACKERS[n]
            if package is not None:
                require(package, extra, f"log_with={n!r} ({cls_name})")
            if n in _WRITE_IN_LOGGING_DIR and logging_dir is None:
                raise ConfigurationError(
                    f"log_with={item!r} writes {n} files in the logging directory, and none was given: pass "
                    "Accelerator(project_dir=...) or project_config=ProjectConfiguration(project_dir=..., "
                    "logging_dir=...)"
                )
            if n not in out:
                out.append(n)
    return out


class _RunView:
    """What a tracker reads of the run it writes for (those ``TrainerView`` members the trackers use)."""

    def __init__(self, config: Dict[str, Any], root: str) -> None:
        self.is_global_zero = True  # trackers exist on the main process only
        self.hparams, self.default_root_dir, self.global_step = config, root, 0


class Trackers:
    """The trackers of ``log_with`` (``parse_log_with``'s list; they start in ``init``), writing under
    ``logging_dir``, on the main process only (``is_main_process``); see the module docstring."""

    def __init__(self, log_with: List[Any], logging_dir: Optional[str], is_main_process: bool) -> None:
        self.log_with, self.logging_dir, self.is_main_process = log_with, logging_dir, is_main_process
        self.trackers: List[TrackerCallback] = []
        self._tracker_names: List[Tuple[str, TrackerCallback]] = []
        self._run_view: Optional[_RunView] = None
        self._log_calls = 0

    def init(
        self,
        project_name: str,
        config: Optional[Mapping[str, Any]] = None,
        init_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
    ) -> None:
        """Start a run of every tracker of ``log_with`` on the main process, with ``config`` as its
        hyperparameters (Accelerate). Other processes have no trackers."""
        if not isinstance(project_name, str) or not project_name.strip():
            raise ConfigurationError(f"init_trackers(project_name={project_name!r}) must be a non-empty string")
        if config is not None and not isinstance(config, Mapping):
            raise ConfigurationError(
                f"init_trackers(config={type(config).__name__}) must be a dict of hyperparameters (vars(args) for "
                "an argparse.Namespace)"
            )
        init_kwargs = dict(init_kwargs or {})
        names = [n for n in self.log_with if isinstance(n, str)]
        unknown = sorted(set(init_kwargs) - set(names))
        if unknown:
            raise ConfigurationError(
                f"init_trackers(init_kwargs={{{unknown[0]!r}: ...}}): {unknown[0]!r} is not a tracker of this "
                f"Accelerator's log_with ({', '.join(names) or 'none'}); its keys name trackers"
            )
        if self._run_view is not None:
            raise ConfigurationError("init_trackers() was called already: call end_training() before starting new runs")
        if not self.is_main_process:
            return
        view = _RunView(dict(config or {}), os.path.abspath(self.logging_dir or os.getcwd()))
        for item in self.log_with:
            name, tracker = (
                (item, _build(item, project_name, self.logging_dir, init_kwargs.get(item, {})))
                if isinstance(item, str)
                else (item.name, item)
            )
            self._tracker_names.append((name, tracker))
            self.trackers.append(tracker)
        self._run_view = view
        for tracker in self.trackers:
            tracker.on_fit_start(cast(Any, view), cast(Any, None))

    def log(
        self, values: Mapping[str, Any], step: Optional[int] = None, log_kwargs: Optional[Dict[str, Any]] = None
    ) -> None:
        """Log ``values`` (numbers, or 0-d tensors, or groups of them: ``{"glue": {"accuracy": 0.8}}``) at
        ``step`` to every tracker, on the main process. A group is written as Accelerate writes it (TensorBoard
        ``add_scalars``, W&B the nested dict, Comet the group's names), or as ``glue/accuracy`` (MLflow, CSV).
        ``step=None``: the number of earlier ``log`` calls. Other values are counted and reported as dropped at
        the end of the run."""
        if not isinstance(values, Mapping):
            raise ConfigurationError(f"log(values={type(values).__name__}) must be a dict of metric name to value")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ConfigurationError(f"log(step={step!r}) must be an int >= 0, or None")
        if log_kwargs:
            raise ConfigurationError(
                "log(log_kwargs=...) is not supported: trainforge's trackers take their settings when built; "
                "pass them in init_trackers(init_kwargs={'<tracker>': {...}})"
            )
        view = self._run_view
        if view is None:
            if self.log_with and self.is_main_process:
                raise ConfigurationError("log() before init_trackers(project_name, config): start the trackers first")
            return
        step = self._log_calls if step is None else step
        self._log_calls += 1
        view.global_step = step
        for tracker in self.trackers:
            tracker.on_log(cast(Any, view), cast(Any, None), dict(values), step)

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The tracker ``name`` (``"tensorboard"``, ``"mlflow"``, ``"comet_ml"``, ``"wandb"``, ``"csv"``, or a tracker's
        ``name``) on the main process. Elsewhere, as Accelerate, a stand-in whose every method does
        nothing, so ``accelerator.get_tracker("wandb").log_hyperparams(...)`` runs on every rank.
        ``unwrap=True`` is refused (the backend object belongs to the tracker's writer thread)."""
        if unwrap:
            raise ConfigurationError(
                "get_tracker(name, unwrap=True) is not supported: trainforge's trackers call their backend on a "
                "writer thread of their own. Use the tracker get_tracker(name) returns (TensorBoardLogger.directory, "
                "MLflowLogger.run_id, CSVLogger.file...) or accelerator.log(...)"
            )
        if not self.is_main_process:
            return OffMainTracker(name)
        for known, tracker in self._tracker_names:
            if name in (known, tracker.name, tracker.tracker_name):
                return tracker
        raise ConfigurationError(
            f"get_tracker({name!r}): no such tracker; this Accelerator has "
            f"{[n for n, _ in self._tracker_names] or 'none (init_trackers not called, or log_with not set)'}"
        )

    def end(self) -> None:
        """Finish the trackers' runs (pending writes get their flush timeout)."""
        view, self._run_view = self._run_view, None
        for tracker in self.trackers if view is not None else []:
            tracker.on_fit_end(cast(Any, view), cast(Any, None))


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


#: The file loggers' Lightning layout arguments, which the default log_dir/path of a named tracker replaces.
_LAYOUT_ARGS = ("save_dir", "name", "version", "sub_dir", "kwargs")


def _build(name: str, project_name: str, logging_dir: Optional[str], kwargs: Mapping[str, Any]) -> TrackerCallback:
    import trainforge.callbacks as callbacks

    cls = getattr(callbacks, _TRACKERS[name][2])
    defaults: Dict[str, Any] = {}
    if name == "tensorboard":
        defaults["log_dir"] = os.path.join(str(logging_dir), project_name)
    elif name == "csv":
        defaults["path"] = os.path.join(str(logging_dir), project_name, "metrics.csv")
    elif name == "mlflow":
        defaults["experiment_name"] = project_name
    elif name == "wandb":
        defaults["project"] = project_name  # save_dir "." is the logging directory (the run's root)
    else:
        defaults["project_name"] = project_name
    arguments = {**defaults, **kwargs}
    try:
        inspect.signature(cls).bind(**arguments)
    except TypeError as err:
        # not the folder layout (Accelerate's is <logging_dir>/<project_name>), nor TensorBoard's **kwargs
        params = [p for p in inspect.signature(cls).parameters if p not in defaults and p not in _LAYOUT_ARGS]
        raise ConfigurationError(
            f"init_kwargs[{name!r}]={dict(kwargs)!r}: {err}; they go to trainforge's {cls.__name__}, which takes "
            f"{', '.join(params)}"
        ) from None
    return cast(TrackerCallback, cls(**arguments))
