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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from callbacks.base import Callback
from strategies.checkpoint_io import delete_checkpoint, read_metadata
from strategies.errors import CheckpointError, ConfigurationError, check_metric_name, invalid_choice

if TYPE_CHECKING:  # pragma: no cover
    from trainer import Trainer, TrainingModule

MODES = ("min", "max")
log = logging.getLogger("trainforge")


class ModelCheckpoint(Callback):
    """
    Args:
        dirpath: where checkpoints go (default ``<default_root_dir>/checkpoints``; ``fit(ckpt_path="last")``
            and ``Trainer(resume="auto")`` look there).
        filename: a template over ``epoch``, ``step`` and logged metrics, e.g.
            ``"{epoch}-{step}-{val/loss:.3f}"`` (``/`` in names becomes ``_``).
        monitor, mode, save_top_k: keep the k best checkpoints by a logged metric, judged at the end of
            each validation (-1 keeps all).
        every_n_steps, every_n_epochs: periodic saves; ``keep_last_k`` bounds how many periodic
            saves are kept (None keeps all).
        save_last: also save at the end of every epoch and at the end of fit, so the newest state
            is always resumable.
    """

    def __init__(self, dirpath: Optional[str] = None, filename: Optional[str] = None, monitor: Optional[str] = None,
                 mode: str = "min", save_top_k: int = 1, every_n_steps: Optional[int] = None,
                 every_n_epochs: Optional[int] = None, save_last: bool = False,
                 keep_last_k: Optional[int] = None) -> None:
        if mode not in MODES:
            raise invalid_choice("mode", mode, MODES)
        if monitor is not None:
            check_metric_name(monitor, "ModelCheckpoint(monitor)")
        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs),
                            ("keep_last_k", keep_last_k)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{name}={value!r} must be an int >= 1 or None")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ConfigurationError(f"save_top_k={save_top_k!r} must be -1 (keep all), 0 (none) or a count >= 1")
        self.dirpath = dirpath
        self.filename = filename or ("epoch={epoch}-step={step}" + ("" if monitor is None else "-" + monitor + "={" + monitor + ":.4g}"))
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.every_n_steps, self.every_n_epochs = every_n_steps, every_n_epochs
        self.save_last, self.keep_last_k = save_last, keep_last_k
        self.best_k: Dict[str, float] = {}     # path -> score (monitored saves)
        self.periodic: List[str] = []          # paths of periodic saves, oldest first
        self.last_saved_step = -1
        self.last_path: Optional[str] = None

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"best_k": dict(self.best_k), "periodic": list(self.periodic), "last_saved_step": self.last_saved_step,
                "last_path": self.last_path, "monitor": self.monitor}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best_k = dict(state.get("best_k", {}))
        self.periodic = list(state.get("periodic", []))
        self.last_saved_step = int(state.get("last_saved_step", -1))
        self.last_path = state.get("last_path")

    @property
    def best_model_path(self) -> Optional[str]:
        if not self.best_k:
            return None
        pick = min if self.mode == "min" else max
        return pick(self.best_k, key=self.best_k.get)

    def directory(self, trainer: "Trainer") -> Path:
        return Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "checkpoints"

    # ---- triggers ------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: "Trainer", module: "TrainingModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        n = self.every_n_steps
        if n and trainer.global_step % n == 0 and trainer.global_step != self.last_saved_step:
            self._save_periodic(trainer)

    def on_train_epoch_end(self, trainer: "Trainer", module: "TrainingModule") -> None:
        n = self.every_n_epochs
        if (n and (trainer.current_epoch + 1) % n == 0) or self.save_last:
            self._save_periodic(trainer)

    def on_fit_end(self, trainer: "Trainer", module: "TrainingModule") -> None:
        if self.save_last and trainer.global_step != self.last_saved_step:
            self._save_periodic(trainer)

    def on_validation_end(self, trainer: "Trainer", module: "TrainingModule") -> None:
        if self.monitor is None or trainer.stage != "fit" or self.save_top_k == 0:
            return
        if self.monitor not in trainer.callback_metrics:
            raise ConfigurationError(f"ModelCheckpoint(monitor={self.monitor!r}): no such logged metric; available: "
                                     f"{sorted(trainer.callback_metrics)}. Log it with self.log({self.monitor!r}, ...)")
        score = trainer.strategy.broadcast(float(trainer.callback_metrics[self.monitor]), 0)
        if math.isnan(score) or not self._improves(score):
            return
        # The state written into this checkpoint must already describe it (path in, eviction out),
        # so that a run resumed from it keeps pruning correctly.
        path = self._path(trainer)
        self.best_k[path] = score
        evicted = None
        if self.save_top_k != -1 and len(self.best_k) > self.save_top_k:
            pick = max if self.mode == "min" else min
            evicted = pick(self.best_k, key=self.best_k.get)
            del self.best_k[evicted]
        self._write(trainer, path)
        if evicted is not None and evicted not in self.periodic:
            self._delete(trainer, evicted)

    def _improves(self, score: float) -> bool:
        if self.save_top_k == -1 or len(self.best_k) < self.save_top_k:
            return True
        worst = max(self.best_k.values()) if self.mode == "min" else min(self.best_k.values())
        return score < worst if self.mode == "min" else score > worst

    # ---- saving --------------------------------------------------------------------------------
    def _save_periodic(self, trainer: "Trainer") -> None:
        if trainer.global_step == self.last_saved_step and self.last_path:
            return
        path = self._path(trainer)
        self.periodic.append(path)
        evicted = []
        while self.keep_last_k and len(self.periodic) > self.keep_last_k:
            evicted.append(self.periodic.pop(0))
        self._write(trainer, path)
        for old in evicted:
            if old not in self.best_k and old != path:
                self._delete(trainer, old)

    def _path(self, trainer: "Trainer") -> str:
        directory, name = self.directory(trainer), self._format_name(trainer)
        free, version = name, 0
        if trainer.is_global_zero:  # the first name not held by another run's checkpoint (or anything else)
            while (directory / free).exists() and not _same_run(directory / free, getattr(trainer, "run_id", None)):
                version += 1
                free = f"{name}-v{version}"
            if version and not getattr(self, "_versioned_logged", False):
                self._versioned_logged = True
                log.warning("ModelCheckpoint: %s is taken by another run; saving as %s (nothing is overwritten; "
                            "to continue that run use Trainer(resume='auto'))", directory / name, free)
        return str(directory / trainer.strategy.broadcast(free, 0))

    def _write(self, trainer: "Trainer", path: str) -> None:
        self.last_saved_step, self.last_path = trainer.global_step, path
        trainer.save_checkpoint(path)

    def _format_name(self, trainer: "Trainer") -> str:
        values: Dict[str, Any] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        values.update(epoch=trainer.current_epoch, step=trainer.global_step)
        try:
            name = self.filename.format(**values)
        except (KeyError, ValueError, IndexError) as exc:
            raise ConfigurationError(f"ModelCheckpoint filename={self.filename!r} cannot be filled ({exc}); it may "
                                     f"use epoch, step and the logged metrics {sorted(trainer.callback_metrics)}") from None
        return name.replace("/", "_").replace(" ", "_")

    def _delete(self, trainer: "Trainer", path: str) -> None:
        if trainer.is_global_zero:
            try:  # only a trainforge checkpoint directly inside our directory, whatever the saved state says
                delete_checkpoint(path, root=self.directory(trainer))
            except CheckpointError as e:
                log.warning("ModelCheckpoint: not pruning %s: %s", path, e)
        trainer.strategy.barrier()


def _same_run(path: Path, run_id: Optional[str]) -> bool:
    """Whether ``path`` is a checkpoint this run wrote (so saving under its name again may replace it)."""
    try:
        return run_id is not None and read_metadata(path).get("run_id") == run_id
    except CheckpointError:
        return False
