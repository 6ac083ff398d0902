"""The Trainer's side of the one checkpoint path (``trainer/checkpoint/contents.py``): which parts it
saves, resuming at fit start, the RNG restored last, just before the loop continues, and rolling back
to the newest checkpoint in the middle of a fit (a ``StepGuard`` such as ``LossSpikes(rollback_after=N)``)."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, cast

from trainforge.callbacks.base import Checkpointer, StepGuard
from trainforge.callbacks.events import Event
from trainforge.strategies.checkpoint.io import read_metadata, resolve_checkpoint
from trainforge.strategies.checkpoint.remote import RemotePath, location
from trainforge.strategies.checkpoint.remote_read import Location, list_checkpoints_at, resolve_on_ranks
from trainforge.strategies.errors import CheckpointError
from trainforge.trainer.accelerator.seed import set_rng_state
from trainforge.trainer.checkpoint.contents import CheckpointParts, load_state, save_state
from trainforge.trainer.loop.settings import Progress
from trainforge.trainer.module.hparams import DATAMODULE_PREFIX, checkpoint_hparams

if TYPE_CHECKING:  # pragma: no cover
    import os

    from trainforge.strategies.base import Strategy
    from trainforge.trainer.accelerator.accelerator import Accelerator
    from trainforge.trainer.loop.trainer import Trainer

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

    _remote_root: Optional[str] = None  # Trainer(default_root_dir=<URL>): checkpoints go there, logs stay local

    @property
    def default_checkpoint_dir(self) -> str:
        """``<default_root_dir>/checkpoints``, a URL when ``default_root_dir`` was one (``default_root_dir`` is
        then the local folder of logs and trackers: trainer/loop/settings.py ``resolve_root_dirs``)."""
        return (
            f"{self._remote_root}/checkpoints"
            if self._remote_root
            else str(Path(self.default_root_dir) / "checkpoints")
        )

    def _checkpoint_root(self) -> Location:
        """Where ``ckpt_path="last"`` and ``resume="auto"`` look: the first ``Checkpointer``'s directory."""
        for cb in self.callbacks:
            if isinstance(cb, Checkpointer):
                return cb.directory(cast("Trainer", self))
        return location(self.default_checkpoint_dir)

    def _start_run(self, ckpt_path: Optional[str], required: bool) -> Optional[Path]:
        """Give this fit a run id (every rank the same), then resume from ``ckpt_path`` if given: a
        resumed run keeps the id of the run it continues. A fresh run whose checkpoint directory
        already holds checkpoints writes beside them (ModelCheckpoint adds ``-v1``, ``-v2``... where
        names collide; nothing of another run is replaced) and says so once, with how to resume."""
        self.run_id = self.strategy.broadcast(uuid.uuid4().hex, 0)
        path = self._load_checkpoint(ckpt_path, required=required) if ckpt_path is not None else None
        self._newest_checkpoint = path  # what a StepGuard's rollback restores, until this fit saves
        if path is not None:
            self.run_id = read_metadata(path).get("run_id") or self.run_id
        elif self.is_global_zero:
            root = self._checkpoint_root()
            earlier = list_checkpoints_at(root)
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

    _newest_checkpoint: Optional[Location] = None  # written by this fit (or resumed from): rollbacks restore it

    def _save_checkpoint(
        self, path: os.PathLike | str, async_save: bool = False, trainable_only: Optional[bool] = None
    ) -> Path:
        self._newest_checkpoint = save_state(
            self.accelerator,
            path,
            self._checkpoint_parts(),
            async_save,
            before_write=self._before_checkpoint_write,
            trainable_only=trainable_only,
        )
        return self._newest_checkpoint

    def _before_checkpoint_write(self, state: Dict[str, Any]) -> None:
        """The hyperparameters (for ``load_from_checkpoint``), then SAVE_CHECKPOINT: the module and the
        callbacks may add to the state (Lightning's order)."""
        state.update(checkpoint_hparams(self.module))
        state.update(checkpoint_hparams(self.datamodule, prefix=DATAMODULE_PREFIX))
        self._fire(Event.SAVE_CHECKPOINT, state)

    def _load_checkpoint(self, ckpt_path: str, required: bool = True) -> Optional[Path]:
        """Restore everything but RNG now; RNG is restored by the loop just before the next batch."""
        root = self._checkpoint_root()
        if required and str(ckpt_path) == "last" and not list_checkpoints_at(root):
            raise CheckpointError(
                f"fit(ckpt_path='last'): there is no checkpoint under {root} yet. To resume when one "
                "exists and start fresh otherwise, use Trainer(resume='auto') and leave ckpt_path out"
            )
        s = self.strategy  # a URL: downloaded once per node and verified (strategies/checkpoint/remote_read.py)
        path = resolve_on_ranks(
            root,
            ckpt_path,
            rank=s.global_rank,
            broadcast=s.broadcast,
            missing_ok=not required,
            world_size=s.world_size,
            barrier=s.barrier,
        )
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

    def _roll_back(self, guard: StepGuard) -> None:
        """A ``StepGuard``'s rollback (``LossSpikes(rollback_after=N)``), on every rank at the same optimizer step (a skipped one, its
        gradients zeroed): restore the newest checkpoint this fit committed (or resumed from) through
        ``load_state``, all but the data position (callbacks/loss_spikes.py says why). An asynchronous save
        in flight is committed first, so the checkpoint chosen never depends on timing. Not the newest in
        the directory: after a resume from an older checkpoint, the newer ones there belong to the branch
        that was abandoned."""
        self.accelerator.wait_for_checkpoint()
        if isinstance(self._newest_checkpoint, RemotePath):  # object storage: every node downloads the same one
            chosen, why = self._remote_newest(self._newest_checkpoint)
        else:
            found = self._verified_newest() if self.is_global_zero else ("", "")
            chosen, why = self.strategy.broadcast(found, 0)  # rank 0 names it: every rank restores the same one
        if not chosen:
            raise CheckpointError(
                f"{type(guard).__name__} asked to roll back after consecutive skipped steps "
                f"at global step {self.progress.global_step} and there is no checkpoint to "
                f"roll back to: {why}. Save earlier (ModelCheckpoint(every_n_steps=...) with a smaller n), or "
                "raise rollback_after"
            )
        path, before, acc = Path(chosen), self.progress.global_step, self.accelerator
        saved_progress = Progress()
        parts = dataclasses.replace(
            self._checkpoint_parts(),
            loaders=[],  # the data goes on past the skipped batches
            callbacks=[cb for cb in self.callbacks if cb.restore_on_rollback],
            progress=saved_progress,
            datamodule=None,
        )
        state, rng = load_state(acc, path, parts)
        self.progress.global_step = saved_progress.global_step  # the optimizer steps the restored weights had
        acc.step = 0  # at a window boundary, whatever the checkpoint's window was: its partial gradients go
        acc.load_item_window_state_dict({"items_in_window": None})
        for opt in self._prepared_optimizers:
            opt.optimizer.zero_grad()
        self._fire(Event.LOAD_CHECKPOINT, state)
        set_rng_state(rng)
        guard.rolled_back(str(path), before, self.progress.global_step, self.is_global_zero)

    def _verified_newest(self) -> "tuple[str, str]":
        """The newest checkpoint of this fit if it verifies, else ``""`` and why (said on every rank)."""
        newest = self._newest_checkpoint
        if newest is None:
            return "", "this fit has written no checkpoint yet and did not resume from one"
        local = cast(Path, newest)  # a URL goes through _remote_newest
        try:
            return str(resolve_checkpoint(local.parent, local)), ""
        except CheckpointError as e:
            return "", str(e)

    def _remote_newest(self, newest: RemotePath) -> "tuple[str, str]":
        """The local copy of this fit's newest checkpoint in object storage, downloaded once per node and verified
        (``remote_read.resolve_on_ranks``: rank 0 chooses), else ``""`` and why."""
        s = self.strategy
        try:
            found = resolve_on_ranks(
                newest.parent,
                newest,
                rank=s.global_rank,
                broadcast=s.broadcast,
                world_size=s.world_size,
                barrier=s.barrier,
            )
        except CheckpointError as e:
            return "", str(e)
        return str(found), ""
