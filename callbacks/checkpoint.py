"""``ModelCheckpoint``: when to save and which checkpoints to keep (Lightning's behaviour:
every-n-steps, every-n-epochs, last, monitored top-k). The Trainer writes the directory; this
callback only decides. Every rank calls the save (sharded strategies need all of them); only
rank 0 deletes, and decisions are broadcast from rank 0 so all ranks agree.

Never overwritten: a checkpoint of another run (its metadata's ``run_id`` differs) whose name this
run would use; this run's checkpoint gets ``-v1``, ``-v2``... instead (logged once). Pruning deletes
only trainforge checkpoints directly inside this callback's directory; paths restored from a
checkpoint's saved state are checked the same way before anything is deleted."""

from __future__ import annotations

import logging
import math
import os
import re
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from trainforge.callbacks.base import Checkpointer
from trainforge.strategies.checkpoint.async_save import check_async_save, resolve_async_save
from trainforge.strategies.checkpoint.io import read_metadata
from trainforge.strategies.checkpoint.remote import RemotePath, check_not_mangled, check_protocol, is_remote, location
from trainforge.strategies.checkpoint.remote_read import (
    Location,
    check_writable_at,
    delete_checkpoint_at,
    remote_name_taken,
)
from trainforge.strategies.environment import STOP_GRACE_ENV
from trainforge.strategies.errors import CheckpointError, ConfigurationError, check_metric_name, invalid_choice

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

MODES = ("min", "max")
_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")  # {name} or {name:format} in a filename template
log = logging.getLogger("trainforge")


def _check_template(filename: Any, within_epoch: bool) -> None:
    """Refuses, when the callback is built, a template that would be used literally (a stray brace, a field
    without a name) and one without ``{step}`` whose saves within an epoch would replace each other
    (tests/callbacks/test_model_checkpoint.py: ``test_malformed_filename_templates_are_refused_when_built``,
    ``test_names_that_change_only_with_the_epoch_are_refused_for_saves_within_an_epoch``)."""
    if not isinstance(filename, str):
        raise ConfigurationError(
            f"ModelCheckpoint filename={filename!r} must be a string template, e.g. '{{epoch}}-{{step}}'"
        )
    rest = _FIELD.sub("", filename)
    if "{" in rest or "}" in rest:
        raise ConfigurationError(
            f"ModelCheckpoint filename={filename!r} is not a valid template: every '{{' and "
            "'}' must enclose a field name, e.g. '{epoch}-{step}' or '{epoch}-{val/loss:.3f}'"
        )
    for match in _FIELD.finditer(filename):  # a format that cannot apply fails now, not at the first save
        field, spec = match.group(1), (match.group(2) or ":")[1:]
        try:
            format(0 if field in ("epoch", "step") else 0.0, spec)
        except ValueError as e:
            kind = "an int" if field in ("epoch", "step") else "a float (logged metrics are floats)"
            raise ConfigurationError(
                f"ModelCheckpoint filename={filename!r}: the format {spec!r} of {{{field}}} does not apply to "
                f"{kind} ({e}); use e.g. '{{{field}:{'d' if kind == 'an int' else '.4g'}}}'"
            ) from None
    if within_epoch and {m.group(1) for m in _FIELD.finditer(filename)} <= {"epoch"}:
        raise ConfigurationError(
            f"ModelCheckpoint(filename={filename!r}) saves several times per epoch "
            "(every_n_steps or train_time_interval) but its names change only with the epoch: "
            "each save of an epoch would replace the one before; add {step}, e.g. "
            "'{epoch}-{step}'"
        )


class ModelCheckpoint(Checkpointer):
    """Decides when the Trainer saves a checkpoint and which checkpoints are kept (Lightning's behaviour).

    With none of ``monitor``, ``every_n_steps``, ``every_n_epochs`` and ``train_time_interval`` (Lightning's
    default), a checkpoint is saved at every epoch end and the newest ``save_top_k`` are kept (1; -1 all;
    0 none). A checkpoint of another run whose name this run would use is never overwritten: this run's
    gets ``-v1``, ``-v2``... instead.

    Args:
        dirpath: where checkpoints go, a local path or an fsspec URL (default None: the Trainer's
            ``default_checkpoint_dir``, ``<default_root_dir>/checkpoints``; ``fit(ckpt_path="last")`` and
            ``Trainer(resume="auto")`` look there).
        filename: a template over ``epoch``, ``step`` and logged metrics, e.g. ``"{epoch}-{val/loss:.3f}"``
            -> ``epoch=3-val_loss=0.123`` (``/`` becomes ``_``). Default None: ``"{epoch}-{step}"``, with or
            without ``monitor`` (Lightning's ``epoch=0-step=10``; a metric is in the name only when the template
            asks for it).
        monitor: a logged metric to rank checkpoints by, or ``"epoch"``/``"step"`` (the newest are the best with
            ``mode="max"``); the ``save_top_k`` best are kept, judged at the end of each validation, or at the
            end of each training epoch when there is no validation loop. Default None: no ranking.
        mode: ``"min"`` (default: lower ``monitor`` is better) or ``"max"``.
        save_top_k: how many checkpoints to keep: the best by ``monitor``, or without it the newest
            (default 1; -1 keeps all, 0 none). Without ``monitor`` it may only be -1, 0 or 1.
        every_n_steps: save every n optimizer steps (default None: not by steps).
        every_n_epochs: save at the end of every n-th training epoch (default None: not by epochs, unless no
            trigger is given at all, see above).
        save_last: also keep a checkpoint named ``last`` (``last_model_path``), rewritten at every save,
            every epoch end and the end of fit, so the newest state is always resumable (default False).
        keep_last_k: how many periodic saves (``every_n_*``, ``train_time_interval``) are kept, the newest
            (default None: all of them).
        every_n_train_steps: Lightning's name of ``every_n_steps`` (default None); pass one of the two.
            Without ``monitor`` and ``keep_last_k`` every periodic checkpoint is kept, which differs from
            Lightning (a warning says so).
        train_time_interval: save when this much wall-clock time (a ``datetime.timedelta``) has passed since
            the last save, by rank 0's clock (default None: not by time).
        save_weights_only: write consolidated safetensors weights only, which cannot resume a fit
            (default False).
        auto_insert_metric_name: write each template field as ``name=value`` (default True:
            ``epoch=3-val_loss=0.123``; False: ``3-0.123``).
        save_on_train_epoch_end: judge ``monitor`` at the end of each training epoch (True) or after each
            validation (False). Default None: at the training epoch end only when there is no validation loop.
        async_save: None (default) saves asynchronously when training on an accelerator (CUDA) and
            synchronously on CPU; True/False force it. Asynchronous: the loop waits only while the
            state is copied to host memory; writing, fsync, checksums and the commit run in the
            background, one save at a time, and pruning waits for the new checkpoint's commit.
        verbose: print on rank 0 what each monitored save did and where each periodic save went (default
            False), in Lightning's words: ``Epoch 3, global step 20: 'val_acc' reached 0.75000 (best 0.75000),
            saving model to '...' as top 2``, or ``... was not in top 2``.
        enable_version_counter: when a name is taken (by another run's checkpoint, or by a top-k checkpoint
            this callback keeps, as ``filename="best"`` with ``save_top_k=2``), save as ``name-v1``, ``-v2``...
            (default True, Lightning's). False: a name held by a top-k checkpoint is replaced, as Lightning
            replaces it; a name held by another run's checkpoint is still never overwritten: the save goes to
            ``-vN`` and fit then stops with an error naming both (nothing is lost).
        trainable_only: leave the frozen parameters (``requires_grad=False``) out of each checkpoint, with a
            record of the base it expects (refused on resume onto another). None (default): for models
            holding a ``peft.PeftModel`` only; True: any model with frozen parameters; False: never.
    """

    def __init__(  # noqa: C901, PLR0915 - 16 arguments (Lightning's and ours), each checked with its own message
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        mode: str = "min",
        save_top_k: int = 1,
        every_n_steps: Optional[int] = None,
        every_n_epochs: Optional[int] = None,
        save_last: bool = False,
        keep_last_k: Optional[int] = None,
        *,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
        save_weights_only: bool = False,
        auto_insert_metric_name: bool = True,
        save_on_train_epoch_end: Optional[bool] = None,
        async_save: Optional[bool] = None,
        trainable_only: Optional[bool] = None,
        verbose: bool = False,
        enable_version_counter: bool = True,
    ) -> None:
        self.async_save = check_async_save(async_save, "ModelCheckpoint")
        if trainable_only is not None and not isinstance(trainable_only, bool):
            raise ConfigurationError(
                f"trainable_only={trainable_only!r} must be None (PEFT models only), True or False"
            )
        self.trainable_only = trainable_only
        if mode not in MODES:
            raise invalid_choice("mode", mode, MODES)
        if monitor is not None:
            check_metric_name(monitor, "ModelCheckpoint(monitor)")
        if every_n_train_steps is not None:
            if every_n_steps is not None and every_n_steps != every_n_train_steps:
                raise ConfigurationError(
                    f"every_n_steps={every_n_steps!r} and every_n_train_steps="
                    f"{every_n_train_steps!r} are the same setting; pass one"
                )
            every_n_steps = every_n_train_steps
            if monitor is None and keep_last_k is None:
                warnings.warn(
                    "ModelCheckpoint(every_n_train_steps=...) without monitor keeps every periodic "
                    "checkpoint (Lightning keeps only the newest); pass keep_last_k=1 for that",
                    UserWarning,
                    stacklevel=2,
                )
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("every_n_epochs", every_n_epochs),
            ("keep_last_k", keep_last_k),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{name}={value!r} must be an int >= 1 or None")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ConfigurationError(f"save_top_k={save_top_k!r} must be -1 (keep all), 0 (none) or a count >= 1")
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ConfigurationError(
                f"ModelCheckpoint(save_top_k={save_top_k}) without monitor: there is no metric "
                "to rank checkpoints by; pass monitor='<logged metric>', or save_top_k -1 "
                "(keep all), 0 or 1 (the newest)"
            )
        if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
            raise ConfigurationError(f"train_time_interval={train_time_interval!r} must be a datetime.timedelta")
        check_not_mangled(dirpath, "ModelCheckpoint(dirpath)")
        if is_remote(dirpath):
            check_protocol(str(dirpath))  # an fsspec protocol that is not installed fails now
        self.dirpath = dirpath
        for flag, value in (("verbose", verbose), ("enable_version_counter", enable_version_counter)):
            if not isinstance(value, bool):
                raise ConfigurationError(f"ModelCheckpoint({flag}={value!r}) must be True or False")
        self.verbose, self.enable_version_counter = verbose, enable_version_counter
        self.filename = filename or "{epoch}-{step}"  # Lightning's: epoch=0-step=10, with or without monitor
        _check_template(self.filename, within_epoch=every_n_steps is not None or train_time_interval is not None)
        self.auto_insert_metric_name = auto_insert_metric_name
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.every_n_steps, self.every_n_epochs = every_n_steps, every_n_epochs
        self.train_time_interval = train_time_interval
        self.save_weights_only, self.save_on_train_epoch_end = save_weights_only, save_on_train_epoch_end
        # Lightning's default: no trigger given -> every epoch end, the newest save_top_k kept
        self._epoch_default = (
            monitor is None and every_n_steps is None and every_n_epochs is None and train_time_interval is None
        )
        if self._epoch_default:
            self.every_n_epochs = 1 if save_top_k != 0 else None
            if keep_last_k is None and save_top_k >= 1:
                keep_last_k = save_top_k
        self.save_last, self.keep_last_k = save_last, keep_last_k
        self.best_k: Dict[str, float] = {}  # path -> score (monitored saves)
        self.periodic: List[str] = []  # paths of periodic saves, oldest first
        self.last_saved_step = -1
        self.last_path: Optional[str] = None  # the newest checkpoint written, whatever its kind
        self.last_model_path: Optional[str] = None  # the ``last`` checkpoint (save_last)
        self._last_written_step = -1  # the step of the ``last`` checkpoint
        self.current_score: Optional[float] = None
        self._last_time = time.monotonic()
        self._restored_paths = False  # set by load_state_dict: paths to place in this run at fit start
        self._versioned_logged = False  # the "-v1: taken by another run" warning was given
        self._grace_warned = False  # a save outlasted the launcher's stop grace (_check_stop_grace): said once
        self._unfilled: Optional[str] = None  # why the name being saved is not the template's (raised after)
        self._kept_other_run: Optional[str] = None  # enable_version_counter=False met another run's name (ditto)

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {
            "best_k": dict(self.best_k),
            "periodic": list(self.periodic),
            "last_saved_step": self.last_saved_step,
            "last_path": self.last_path,
            "monitor": self.monitor,
            "last_model_path": self.last_model_path,
            "current_score": self.current_score,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best_k = dict(state.get("best_k", {}))
        self.periodic = list(state.get("periodic", []))
        self.last_saved_step = int(state.get("last_saved_step", -1))
        self.last_path = state.get("last_path")
        self.last_model_path = state.get("last_model_path")
        self.current_score = state.get("current_score")
        self._restored_paths = True  # placed in this run's directory at fit start

    def _place_restored_paths(self, root: Location) -> None:
        """The checkpoint's paths, which name the directory of the run that wrote them, resolved against
        this run's directory by name: a copied run (``cp -r``) keeps top-k and pruning inside its copy,
        and a downloaded checkpoint cannot name another folder (a checkpoint's state is data)."""

        def here(path: Optional[str]) -> Optional[str]:
            name = Path(path).name if isinstance(path, str) else ""
            return str(root / name) if name not in ("", ".", "..") else None

        best = {here(p): score for p, score in self.best_k.items()}
        self.best_k = {p: score for p, score in best.items() if p is not None}
        self.periodic = [p for p in map(here, self.periodic) if p is not None]
        self.last_path, self.last_model_path = here(self.last_path), here(self.last_model_path)

    @property
    def best_model_path(self) -> Optional[str]:
        """The best monitored checkpoint; without ``monitor``, the newest periodic save (Lightning's)."""
        if self.monitor is None:
            return self.periodic[-1] if self.periodic else None
        if not self.best_k:
            return None
        pick = min if self.mode == "min" else max
        return pick(self.best_k, key=self.best_k.__getitem__)

    @property
    def best_model_score(self) -> Optional[float]:
        path = self.best_model_path
        return None if path is None or self.monitor is None else self.best_k[path]

    @property
    def best_k_models(self) -> Dict[str, float]:
        return dict(self.best_k)

    @property
    def kth_best_model_path(self) -> Optional[str]:
        """The worst of the kept top-k (the one the next better score replaces)."""
        if not self.best_k:
            return None
        pick = max if self.mode == "min" else min
        return pick(self.best_k, key=self.best_k.__getitem__)

    @property
    def writes_full_checkpoints(self) -> bool:
        """``Checkpointer``: resumable checkpoints unless ``save_weights_only``."""
        return not self.save_weights_only

    def directory(self, trainer: TrainerView) -> Location:
        """A ``Path``, or a ``RemotePath`` for a URL (object storage: strategies/checkpoint/remote.py)."""
        return location(self.dirpath if self.dirpath else trainer.default_checkpoint_dir)

    # ---- triggers ------------------------------------------------------------------------------
    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._last_time = time.monotonic()
        if self._saves_anything():  # every rank writes files of each checkpoint: each checks, before any work
            if self.dirpath:
                check_writable_at(self.dirpath, f"ModelCheckpoint(dirpath={self.dirpath!r})", "Pass dirpath=...")
            else:
                check_writable_at(
                    self.directory(trainer),
                    f"the checkpoint directory {str(self.directory(trainer))!r} (Trainer(default_root_dir) + "
                    f"'/checkpoints')",
                    "Pass Trainer(default_root_dir=...) or ModelCheckpoint(dirpath=...)",
                )
        if self._restored_paths:
            self._restored_paths = False
            self._place_restored_paths(self.directory(trainer))

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_steps
        if trainer.stop_requested is not None:  # every rank stops after this step on a signal: save it
            if self._saves_anything():
                self._save_periodic(trainer)
        elif n and trainer.global_step % n == 0 and trainer.global_step != self.last_saved_step:
            self._save_periodic(trainer)
        elif self.train_time_interval is not None:
            due = time.monotonic() - self._last_time >= self.train_time_interval.total_seconds()
            if trainer.strategy.broadcast(due, 0):  # rank 0's clock decides, so every rank saves together
                self._save_periodic(trainer)

    def on_train_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        n = self.every_n_epochs
        if n and (trainer.current_epoch + 1) % n == 0:
            self._save_periodic(trainer)
        if self.monitor is not None and self._judge_at_train_epoch_end(trainer):
            self._save_top_k(trainer)
        self._save_last(trainer)

    def on_fit_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._epoch_default and self.save_top_k != 0 and trainer.global_step != self.last_saved_step:
            self._save_periodic(trainer)  # stopped inside an epoch (max_steps): its state is the newest
        self._save_last(trainer)

    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self.monitor is None or trainer.stage != "fit" or self._judge_at_train_epoch_end(trainer):
            return
        self._save_top_k(trainer)

    def _saves_anything(self) -> bool:
        periodic = self.every_n_steps or self.every_n_epochs or self.train_time_interval is not None
        return bool(self.save_last or periodic or (self.monitor is not None and self.save_top_k != 0))

    def _judge_at_train_epoch_end(self, trainer: TrainerView) -> bool:
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        return not trainer.val_dataloaders  # no validation loop: judge training metrics

    def _monitored(self, trainer: TrainerView) -> float:
        """The monitored value: a logged metric, or (Lightning's candidates) ``epoch``/``step`` unless logged."""
        metrics = trainer.callback_metrics
        if self.monitor in metrics:
            return float(metrics[self.monitor])
        if self.monitor in ("epoch", "step"):
            return float(trainer.current_epoch if self.monitor == "epoch" else trainer.global_step)
        raise ConfigurationError(
            f"ModelCheckpoint(monitor={self.monitor!r}): no such logged metric; available: "
            f"{sorted(metrics)} (and 'epoch', 'step'). Log it with self.log({self.monitor!r}, ...)"
        )

    def _save_top_k(self, trainer: TrainerView) -> None:
        score = trainer.strategy.broadcast(self._monitored(trainer), 0)
        self.current_score = score
        if self.save_top_k == 0 or math.isnan(score) or not self._improves(score):
            if self.save_top_k != 0:
                self._say(trainer, f"{self.monitor!r} was not in top {self.save_top_k}")
            return
        # The state written into this checkpoint must already describe it (path in, eviction out),
        # so that a run resumed from it keeps pruning correctly.
        full = self.save_top_k != -1 and len(self.best_k) >= self.save_top_k
        top = len(self.best_k) + 1 if self.save_top_k == -1 else self.save_top_k
        path = self._path(trainer, replacing=self.kth_best_model_path if full else None)
        self.best_k[path] = score
        evicted = None
        if self.save_top_k != -1 and len(self.best_k) > self.save_top_k:
            pick = max if self.mode == "min" else min
            evicted = pick(self.best_k, key=self.best_k.__getitem__)
            del self.best_k[evicted]
        best = self.best_model_score
        self._say(
            trainer, f"{self.monitor!r} reached {score:0.5f} (best {best:0.5f}), saving model to {path!r} as top {top}"
        )
        self._write(trainer, path)
        if evicted is not None and evicted not in self.periodic and evicted != path:
            self._delete(trainer, evicted)
        self._save_last(trainer)

    def _say(self, trainer: TrainerView, what: str) -> None:
        """``verbose``: Lightning's message, printed by rank 0."""
        if self.verbose and trainer.is_global_zero:
            print(f"Epoch {trainer.current_epoch:d}, global step {trainer.global_step:d}: {what}", flush=True)

    def _improves(self, score: float) -> bool:
        if self.save_top_k == -1 or len(self.best_k) < self.save_top_k:
            return True
        worst = max(self.best_k.values()) if self.mode == "min" else min(self.best_k.values())
        return score < worst if self.mode == "min" else score > worst

    # ---- saving --------------------------------------------------------------------------------
    def _save_periodic(self, trainer: TrainerView) -> None:
        self._last_time = time.monotonic()
        if trainer.global_step == self.last_saved_step and self.last_path:
            return
        full = self.keep_last_k and len(self.periodic) >= self.keep_last_k
        path = self._path(trainer, replacing=self.periodic[0] if full else None)
        if path in self.periodic:  # the same name again (enable_version_counter=False): one entry
            self.periodic.remove(path)
        self.periodic.append(path)
        evicted = []
        while self.keep_last_k and len(self.periodic) > self.keep_last_k:
            evicted.append(self.periodic.pop(0))
        self._write(trainer, path)
        for old in evicted:
            if old not in self.best_k and old != path:
                self._delete(trainer, old)
        self._save_last(trainer)

    def _save_last(self, trainer: TrainerView) -> None:
        if not self.save_last or trainer.global_step == self._last_written_step:
            return
        path = self._path(trainer, "last", replacing=self.last_model_path)
        self.last_model_path, self._last_written_step = path, trainer.global_step
        self._write(trainer, path)

    def _path(self, trainer: TrainerView, name: Optional[str] = None, replacing: Optional[str] = None) -> str:
        """Where the next save goes: the template's name, or ``name-v1``, ``-v2``... (Lightning's version
        counter) while that is taken; ``replacing`` is the kept checkpoint this save evicts, whose name may be
        reused, as Lightning reuses it."""
        directory, name = self.directory(trainer), name or self._format_name(trainer)
        free, version = name, 0
        if trainer.is_global_zero:
            while self._name_taken(directory / free, trainer, replacing):
                version += 1
                free = f"{name}-v{version}"
            if version and not self.enable_version_counter:
                self._kept_other_run = (
                    f"ModelCheckpoint(enable_version_counter=False): {directory / name} holds another run's "
                    "checkpoint, which is never overwritten. Move or delete it, or use another dirpath or "
                    "filename (or enable_version_counter=True, which names this run's save -v1)"
                )
            elif version and not self._versioned_logged and _taken(directory / name, trainer.run_id):
                self._versioned_logged = True
                log.warning(
                    "ModelCheckpoint: %s is taken by another run; saving as %s (nothing is overwritten; "
                    "to continue that run use Trainer(resume='auto'))",
                    directory / name,
                    free,
                )
        return str(directory / trainer.strategy.broadcast(free, 0))

    def _name_taken(self, path: Location, trainer: TrainerView, replacing: Optional[str]) -> bool:
        """Another run's checkpoint (or anything not ours) always; with the version counter, also a top-k
        checkpoint this callback keeps (``filename="best"``, ``save_top_k=2``: ``best``, ``best-v1``), unless
        this save replaces it or saves the same step again. A periodic save replaces this run's own
        checkpoint of the same name (``filename="last"``; a resumed run continues its names)."""
        if _taken(path, trainer.run_id):
            return True
        text = str(path)
        if not self.enable_version_counter or text == replacing:
            return False
        if text == self.last_path and trainer.global_step == self.last_saved_step:
            return False
        return text in self.best_k

    def _write(self, trainer: TrainerView, path: str) -> None:
        self.last_saved_step, self.last_path = trainer.global_step, path
        started, asynchronous = time.monotonic(), self._async(trainer)
        if self.save_weights_only:
            trainer.save_weights(path)
        else:
            trainer.save_checkpoint(path, async_save=asynchronous, trainable_only=self.trainable_only)
        if not asynchronous:
            self._check_stop_grace(trainer, time.monotonic() - started)
        if self._unfilled is not None:  # the metrics are known only now: the work is saved, then we stop
            message, self._unfilled = self._unfilled, None
            raise ConfigurationError(
                f"{message}. Nothing is lost: this checkpoint was saved as {path}; fix filename and resume "
                f"from it (fit(ckpt_path=...))"
            )
        refused = trainer.strategy.broadcast(self._kept_other_run, 0)  # known on rank 0 only
        if refused is not None:
            self._kept_other_run = None
            raise CheckpointError(f"{refused}. Nothing is lost: this checkpoint was saved as {path}; resume from it")

    def _check_stop_grace(self, trainer: TrainerView, seconds: float) -> None:
        """A stop signal's checkpoint is saved like this one; a launcher that kills the workers sooner after
        forwarding the signal (``STOP_GRACE_ENV``) would cut it (the previous checkpoint stays intact,
        the steps since are lost): said once, at the first save that shows it."""
        grace = os.environ.get(STOP_GRACE_ENV)
        if self._grace_warned or not grace or not trainer.is_global_zero:
            return
        try:
            limit = float(grace)
        except ValueError:
            return
        if seconds > limit:
            self._grace_warned = True
            warnings.warn(
                f"ModelCheckpoint: saving {self.last_path} took {seconds:.1f} s, longer than the {limit:g} s the "
                "launcher waits after forwarding a stop signal before it kills the workers: a stop (SIGTERM, "
                "SIGUSR1) would be cut before its checkpoint commits. Raise `trainforge launch --shutdown-timeout` "
                f"(and a scheduler's grace, e.g. SLURM's --signal=USR1@<seconds>) above {math.ceil(seconds * 1.5)} s",
                stacklevel=2,
            )

    def _async(self, trainer: TrainerView) -> bool:
        return resolve_async_save(self.async_save, trainer.device)

    def _format_name(self, trainer: TrainerView) -> str:
        values: Dict[str, Any] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        values.update(epoch=trainer.current_epoch, step=trainer.global_step)

        def fill(match: re.Match[str]) -> str:
            name, spec = match.group(1), match.group(2) or ""
            text = format(values[name], spec[1:])
            return f"{name}={text}" if self.auto_insert_metric_name else text

        try:
            name = _FIELD.sub(fill, self.filename)
        except KeyError as exc:  # a field no metric fills: save under the default name, then say so (_write)
            self._unfilled = (
                f"ModelCheckpoint filename={self.filename!r} cannot be filled ({exc}: no such logged metric); "
                f"it may use epoch, step and the logged metrics {sorted(trainer.callback_metrics)}"
            )
            name = f"epoch={trainer.current_epoch}-step={trainer.global_step}"
        return name.replace("/", "_").replace(" ", "_")

    def _delete(self, trainer: TrainerView, path: str) -> None:
        root = self.directory(trainer)

        def prune() -> None:
            try:  # only a trainforge checkpoint directly inside our directory, whatever the saved state says
                delete_checkpoint_at(path, root)
            except CheckpointError as e:
                log.warning("ModelCheckpoint: not pruning %s: %s", path, e)

        if self._async(trainer):  # only once the checkpoint just saved is committed (issue 12)
            if trainer.is_global_zero:
                trainer.accelerator.async_checkpointer.after_commit(prune)
            return
        if trainer.is_global_zero:
            prune()
        trainer.strategy.barrier()


def _taken(path: Location, run_id: Optional[str]) -> bool:
    """Whether ``path`` holds something this run may not replace (object storage: ``remote_name_taken``)."""
    if isinstance(path, RemotePath):
        return remote_name_taken(path, run_id)
    return path.exists() and not _same_run(path, run_id)


def _same_run(path: Path, run_id: Optional[str]) -> bool:
    """Whether ``path`` is a checkpoint this run wrote (so saving under its name again may replace it)."""
    try:
        return run_id is not None and read_metadata(path).get("run_id") == run_id
    except CheckpointError:
        return False
