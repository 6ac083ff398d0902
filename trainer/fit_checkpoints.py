"""The Trainer's side of the one checkpoint path (``trainer/checkpointing.py``): which parts it
saves, resuming at fit start, and the RNG restored last, just before the loop continues."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, cast

from trainforge.strategies.checkpoint.io import list_checkpoints, read_metadata, resolve_checkpoint
from trainforge.strategies.errors import CheckpointError
from trainforge.trainer.checkpointing import CheckpointParts, load_state, save_state
from trainforge.trainer.events import Event
from trainforge.trainer.hparams import DATAMODULE_PREFIX, checkpoint_hparams
from trainforge.trainer.seed import set_rng_state

if TYPE_CHECKING:  # pragma: no cover
    import os

    from trainforge.strategies.base import Strategy
    from trainforge.trainer.accelerator import Accelerator
    from trainforge.trainer.config import Progress
    from trainforge.trainer.trainer import Trainer

log = logging.getLogger("trainforge")


class FitCheckpoints:
    """Mixed into ``Trainer``: everything here reads and writes the Trainer's own state."""

    if TYPE_CHECKING:  # the Trainer's, for the type checker
        accelerator: Accelerator
        strategy: Strategy
        model: Any
        module: Any
        callbacks: List[Any]
        progress: Progress
        lr_scheduler_configs: List[Dict[str, Any]]
        train_dataloader: Any
        datamodule: Any
        run_id: Optional[str]
        default_root_dir: str
        is_global_zero: bool
        _prepared_optimizers: List[Any]
        _pending_rng: Optional[Dict[str, Any]]

        def _fire(self, event: Event, *args: Any) -> None: ...

    def _checkpoint_root(self) -> Path:
        """Where ``ckpt_path="last"`` and ``resume="auto"`` look: the first ModelCheckpoint's directory."""
        from trainforge.callbacks.checkpoint import ModelCheckpoint

        for cb in self.callbacks:
            if isinstance(cb, ModelCheckpoint):
                return cb.directory(cast("Trainer", self))
        return Path(self.default_root_dir) / "checkpoints"

    def _start_run(self, ckpt_path: Optional[str], required: bool) -> Optional[Path]:
        """Give this fit a run id (every rank the same), then resume from ``ckpt_path`` if given: a
        resumed run keeps the id of the run it continues. A fresh run whose checkpoint directory
        already holds checkpoints writes beside them (ModelCheckpoint adds ``-v1``, ``-v2``... where
        names collide; nothing of another run is replaced) and says so once, with how to resume."""
        self.run_id = self.strategy.broadcast(uuid.uuid4().hex, 0)
        path = self._load_checkpoint(ckpt_path, required=required) if ckpt_path is not None else None
        if path is not None:
            self.run_id = read_metadata(path).get("run_id") or self.run_id
        elif self.is_global_zero:
            root = self._checkpoint_root()
            earlier = list_checkpoints(root)
            if earlier:
                log.warning(
                    "trainforge: %s already holds %d checkpoint(s) of an earlier run (newest: %s). This run "
                    "starts fresh and writes beside them; a name that is taken gets a -v1, -v2... suffix, so "
                    "nothing is overwritten. To continue that run instead, pass Trainer(resume='auto') or "
                    "fit(ckpt_path='last')",
                    root,
                    len(earlier),
                    earlier[-1].name,
                )
        return path

    def _checkpoint_parts(self) -> CheckpointParts:
        return CheckpointParts(
            "trainer",
            self.model,
            list(self._prepared_optimizers),
            [cfg["scheduler"] for cfg in self.lr_scheduler_configs],
            [self.train_dataloader],
            callbacks=list(self.callbacks),
            progress=self.progress,
            datamodule=self.datamodule,
            run_id=self.run_id,
        )

    def _save_checkpoint(self, path: os.PathLike | str, async_save: bool = False) -> Path:
        return save_state(
            self.accelerator,
            path,
            self._checkpoint_parts(),
            async_save,
            before_write=self._before_checkpoint_write,
        )

    def _before_checkpoint_write(self, state: Dict[str, Any]) -> None:
        """The hyperparameters (for ``load_from_checkpoint``), then SAVE_CHECKPOINT: the module and the
        callbacks may add to the state (Lightning's order)."""
        state.update(checkpoint_hparams(self.module))
        state.update(checkpoint_hparams(self.datamodule, prefix=DATAMODULE_PREFIX))
        self._fire(Event.SAVE_CHECKPOINT, state)

    def _load_checkpoint(self, ckpt_path: str, required: bool = True) -> Optional[Path]:
        """Restore everything but RNG now; RNG is restored by the loop just before the next batch."""
        root = self._checkpoint_root()
        if required and str(ckpt_path) == "last" and not list_checkpoints(root):
            raise CheckpointError(
                f"fit(ckpt_path='last'): there is no checkpoint under {root} yet. To resume when one "
                "exists and start fresh otherwise, use Trainer(resume='auto') and leave ckpt_path out"
            )
        path = resolve_checkpoint(root, ckpt_path, missing_ok=not required)
        if path is None:
            if self.is_global_zero:
                log.info("trainforge: no checkpoint under %s; starting from scratch", root)
            return None
        state, self._pending_rng = load_state(self.accelerator, path, self._checkpoint_parts())
        self._fire(Event.LOAD_CHECKPOINT, state)
        if self.is_global_zero:
            log.info(
                "trainforge: resumed from %s (epoch %d, step %d)",
                path,
                self.progress.epoch,
                self.progress.global_step,
            )
        return path

    def _restore_pending_rng(self) -> None:
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None
