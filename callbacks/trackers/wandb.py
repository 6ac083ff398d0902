"""``WandbLogger``: parameters and metrics of a run in Weights & Biases, online or offline.

Lightning's name and arguments (``name``, ``save_dir``, ``version``/``id``, ``offline``, ``dir``,
``project``, ``prefix``, ``experiment``, ``**kwargs`` for ``wandb.init``) on trainforge's tracker base.
``logger.experiment`` is the wandb ``Run`` during fit on rank 0 (``experiment.py``: a stand-in elsewhere);
``version`` is the run id. Everything else goes through the base class:
the run is opened, and every write made, on the tracker's writer thread of the main process, in
batches, under the failure policy (``base.py``). Metrics are logged with ``trainer/global_step`` as
their x-axis (``define_metric``, as Lightning does), never as wandb's own ``step``, so a resumed run
whose step lies behind what the crashed run logged loses nothing.

Where: ``<save_dir>/wandb/``; a relative ``save_dir`` (default ``"."``) is relative to the Trainer's
``default_root_dir`` (Lightning's is the working directory, which is also the Trainer's default).
Offline runs (``offline=True``, or ``WANDB_MODE=offline``) write ``offline-run-*/run-<id>.wandb`` there;
upload them later with ``wandb sync``. (wandb's service writes that file out shortly after
``run.finish()`` returns, and before the process exits.)

Online: before ``wandb.init``, one TCP connection to the server (``WANDB_BASE_URL``, or
``settings={"base_url": ...}``; else wandb's default) is tried for ``CONNECT_TIMEOUT_S``: a
server that is down or unreachable fails at once and the failure policy takes over. ``wandb.init``
gets ``init_timeout=INIT_TIMEOUT_S`` unless ``settings`` names one (wandb holds the process's exit for
as long as an ``init`` is pending). Console capture is off (``console="off"``): the tracker logs what
the Trainer reports.

Resume: the run id is chosen when the fit starts (8 random letters and digits, as wandb's, from
``secrets``: no RNG of the run is drawn), so every checkpoint names the run even while it is being
opened; ``state_dict`` holds it and the project; a resumed fit calls ``wandb.init(id=...,
resume="allow")`` in its own ``save_dir`` and project. The id is data: it must look like a W&B run id
(letters, digits, ``-``, ``_``), a checkpoint of another project starts a new run, and no path is ever
taken from a checkpoint (``run_paths.py``).

Needs wandb >= 0.20 (``reinit="create_new"``: each WandbLogger has a run of its own, never
``wandb.run``, so two trackers or two fits in one process do not interfere).

Not supported: ``log_model`` (checkpoints as W&B artifacts; use ``MLflowLogger(log_checkpoints=True)``)
and ``anonymous=True`` (removed from wandb). ``WandbLogger.name`` is the tracker's name, as for the other
trackers; the run's display name is ``run_name``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import string
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

from trainforge.callbacks.trackers.base import FailurePolicy, MetricRecords, TrackerCallback, check_text, require
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.view import TrainerView

log = logging.getLogger("trainforge")
STEP_KEY = "trainer/global_step"
CONNECT_TIMEOUT_S = 3.0
INIT_TIMEOUT_S = 30.0
# wandb.init's keywords that WandbLogger passes on; the rest it sets itself from its own arguments.
INIT_KWARGS = (
    "entity",
    "notes",
    "tags",
    "config",
    "config_exclude_keys",
    "config_include_keys",
    "allow_val_change",
    "group",
    "job_type",
    "mode",
    "force",
    "save_code",
    "tensorboard",
    "sync_tensorboard",
    "monitor_gym",
    "settings",
    "resume_from",
    "fork_from",
)
_OWN_KWARGS = {"resume": "version=/id= (a resumed fit continues its run by itself)", "reinit": "nothing"}
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_OFFLINE_MODES = ("offline", "dryrun", "disabled")


def _same(a: Any, b: Any, default: Any, arg_a: str, arg_b: str) -> Any:
    """Lightning's pairs of aliases (``save_dir``/``dir``, ``version``/``id``): one of them, or both equal."""
    if b is None or b == a:
        return a
    if a is None or a == default:
        return b
    raise ConfigurationError(f"WandbLogger({arg_a}={a!r}, {arg_b}={b!r}): they are the same setting; pass one")


def _check_folder(path: str, given: str) -> None:
    """``save_dir`` must be (or be creatable as) a folder: wandb fails on a file in its writer thread, and the
    whole run would log nothing."""
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigurationError(
            f"WandbLogger(save_dir={given!r}): {existing} is a file, not a folder, so no run could be written under "
            f"{path}. Pass a folder (WandbLogger(save_dir='runs'); relative to the Trainer's default_root_dir)"
        )


def _check_reachable(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(f"cannot connect to the W&B server {parts.hostname}:{port} ({e})") from None


class WandbLogger(TrackerCallback):
    """Log to Weights & Biases on the main process. See the module docstring."""

    name = "WandbLogger"
    keeps_groups = True  # a group goes to run.log as a nested dict, as Accelerate's WandBTracker passes it

    def __init__(
        self,
        name: Optional[str] = None,
        save_dir: Any = ".",
        version: Optional[str] = None,
        offline: bool = False,
        dir: Any = None,
        id: Optional[str] = None,
        anonymous: Optional[bool] = None,
        project: Optional[str] = None,
        log_model: Any = False,
        prefix: str = "",
        experiment: Any = None,
        checkpoint_name: Optional[str] = None,
        failure_policy: Optional[FailurePolicy] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(failure_policy)
        require("wandb", "wandb", "WandbLogger")
        if log_model not in (False, None):
            raise ConfigurationError(
                f"WandbLogger(log_model={log_model!r}) is not supported: trainforge does not upload checkpoints "
                "to W&B. Keep log_model=False (checkpoints stay where ModelCheckpoint writes them), or use "
                "MLflowLogger(log_checkpoints=True) for checkpoints as artifacts"
            )
        if anonymous:
            raise ConfigurationError(
                "WandbLogger(anonymous=True) is not supported: wandb removed anonymous runs. Log in "
                "(wandb login / WANDB_API_KEY) or use offline=True"
            )
        if not isinstance(offline, bool):
            raise ConfigurationError(f"WandbLogger(offline={offline!r}) must be True or False")
        if not isinstance(prefix, str):
            raise ConfigurationError(f"WandbLogger(prefix={prefix!r}) must be a string ('' for none)")
        check_text(checkpoint_name, "WandbLogger", "checkpoint_name", "model")
        unknown = sorted(set(kwargs) - set(INIT_KWARGS))
        if unknown:
            own = [k for k in unknown if k in _OWN_KWARGS]
            hint = f"; {own[0]!r} is set by WandbLogger from {_OWN_KWARGS[own[0]]}" if own else ""
            raise ConfigurationError(
                f"WandbLogger({unknown[0]}=...): not an argument of WandbLogger nor of wandb.init that it passes "
                f"on{hint}. It takes name, save_dir, version, offline, dir, id, project, prefix, experiment, "
                f"failure_policy and these wandb.init arguments: {', '.join(INIT_KWARGS)}"
            )
        if kwargs.get("mode") not in (None, "online", "offline", "disabled", "shared"):
            raise ConfigurationError(
                f"WandbLogger(mode={kwargs['mode']!r}) must be 'online', 'offline', 'disabled' or 'shared' (or None)"
            )
        settings = kwargs.get("settings")
        if settings is not None and not isinstance(settings, Mapping) and type(settings).__name__ != "Settings":
            raise ConfigurationError(f"WandbLogger(settings={settings!r}) must be a dict or a wandb.Settings")
        if experiment is not None and type(experiment).__name__ != "Run":
            raise ConfigurationError(
                f"WandbLogger(experiment={experiment!r}) must be a wandb Run (what wandb.init returns), or None"
            )
        self.run_name = check_text(name, "WandbLogger", "name", "baseline-lr3e-4")
        self.project = check_text(project, "WandbLogger", "project", "my-project") or os.environ.get(
            "WANDB_PROJECT", "trainforge"
        )
        save = check_text(save_dir, "WandbLogger", "save_dir", "runs", path=True)
        other = check_text(dir, "WandbLogger", "dir", "runs", path=True)
        self.save_dir_setting: str = _same(save, other, ".", "save_dir", "dir") or "."
        run_id = _same(
            check_text(version, "WandbLogger", "version", "1a2b3c4d"),
            check_text(id, "WandbLogger", "id", "1a2b3c4d"),
            None,
            "version",
            "id",
        )
        if run_id is not None and not _RUN_ID.fullmatch(run_id):
            raise ConfigurationError(f"WandbLogger(id={run_id!r}): a W&B run id holds letters, digits, '-' and '_'")
        self.offline = offline
        self.prefix = prefix
        self.checkpoint_name = checkpoint_name
        self.init_kwargs: Dict[str, Any] = dict(kwargs)
        self._run_id: Optional[str] = run_id
        self._explicit_id = run_id is not None or experiment is not None
        self._given = experiment  # a run the user opened: used, never finished by the tracker
        self._run: Any = None
        self._dir: Optional[str] = None
        self._saved: Dict[str, Any] = {}

    def __repr__(self) -> str:
        return (
            f"WandbLogger(project={self.project!r}, run_name={self.run_name!r}, id={self._run_id!r}, "
            f"save_dir={self._dir or self.save_dir_setting!r}, offline={self.offline})"
        )

    # --- Lightning's properties ---
    @property
    def version(self) -> Optional[str]:
        """The W&B run id (known once the run opened)."""
        self._wait_opened(self.failure_policy.flush_timeout_s)
        return self._run_id

    @property
    def save_dir(self) -> Optional[str]:
        """The directory holding ``wandb/`` (known once the run started)."""
        return self._dir

    # --- state ---
    def state_dict(self) -> Dict[str, Any]:
        return {"id": self._run_id, "project": self.project}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not self._explicit_id and state_dict.get("id"):
            self._saved = dict(state_dict)

    def _continue_saved_run(self) -> None:
        """Continue the checkpoint's run only when its id looks like one and its project is this one."""
        saved, self._saved = self._saved, {}
        if not saved:
            return
        run_id, project = saved.get("id"), saved.get("project")
        if isinstance(run_id, str) and _RUN_ID.fullmatch(run_id) and project == self.project:
            self._run_id = run_id
            return
        log.warning(
            "trainforge: the checkpoint's W&B run %r of project %r is not continued (this WandbLogger logs to "
            "project %r): a new run is started",
            run_id,
            project,
            self.project,
        )

    def _secrets(self) -> List[str]:
        key = os.environ.get("WANDB_API_KEY")
        return [key] if key else []

    # --- backend ---
    def _prepare(self, trainer: TrainerView) -> None:
        root = os.path.abspath(trainer.default_root_dir)
        self._dir = os.path.abspath(os.path.join(root, self.save_dir_setting))
        _check_folder(self._dir, self.save_dir_setting)
        self._continue_saved_run()
        if self._given is not None:
            self._run_id = self._given.id
        elif self._run_id is None:  # chosen here, so that every checkpoint names the run even before it opened
            self._run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))

    def _settings(self) -> Tuple[Any, str]:
        """The ``wandb.Settings`` to open the run with, and the server it talks to when online."""
        import wandb

        given = self.init_kwargs.get("settings")
        if given is not None and not isinstance(given, Mapping):
            settings, explicit = given, given.model_fields_set  # a wandb.Settings of the user's: used as it is
        else:
            settings = wandb.Settings(**{"console": "off", "init_timeout": INIT_TIMEOUT_S, **(given or {})})
            explicit = set(given or {})
        # wandb.init applies WANDB_BASE_URL under the settings it is given, unless they name a server
        url = settings.base_url if "base_url" in explicit else os.environ.get("WANDB_BASE_URL") or settings.base_url
        return settings, str(url)

    def _open(self) -> None:
        run = self._given
        if run is None:
            import wandb

            settings, url = self._settings()
            mode = "offline" if self.offline else self.init_kwargs.get("mode") or os.environ.get("WANDB_MODE", "")
            if mode not in _OFFLINE_MODES:
                _check_reachable(url)
            assert self._dir is not None, "the save directory is resolved before the run opens"
            os.makedirs(self._dir, exist_ok=True)
            kwargs: Dict[str, Any] = {**self.init_kwargs, "settings": settings}
            kwargs.update(project=self.project, name=self.run_name, dir=self._dir, reinit="create_new")
            if self.offline:
                kwargs["mode"] = "offline"
            kwargs.update(id=self._run_id, resume="allow")
            run = wandb.init(**kwargs)
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY, step_sync=True)
        self._run, self._run_id = run, run.id

    def _backend(self) -> Any:
        return self._run if self._run is not None else self._given  # the wandb Run (Lightning's .experiment)

    def _write_params(self, params: Dict[str, Any]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def _write_metrics(self, records: MetricRecords) -> None:
        rows: List[Tuple[int, Dict[str, float]]] = []
        for step, values in records:
            row = {(f"{self.prefix}-{k}" if self.prefix else k): v for k, v in values.items()}
            if rows and rows[-1][0] == step and not set(row) & set(rows[-1][1]):
                rows[-1][1].update(row)  # one W&B history row per step where the names do not repeat
            else:
                rows.append((step, row))
        for step, row in rows:
            self._run.log({**row, STEP_KEY: step})

    def _close(self, status: str) -> None:
        run, self._run = self._run, None
        if run is not None and run is not self._given:
            run.finish(exit_code=0 if status == "FINISHED" else 1)
