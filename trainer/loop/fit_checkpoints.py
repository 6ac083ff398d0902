"""The Trainer's side of the one checkpoint path (``trainer/checkpoint/contents.py``): which parts it
saves, resuming at fit start, the RNG restored last, just before the loop continues, and rolling back
to the newest checkpoint in the middle of a fit (a ``StepGuard`` such as ``LossSpikes(rollback_after=N)``)."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, cast

from trainforge.callbacks.base import Checkpointer, StepGuard
from trainforge.callbacks.events import Event
from trainforge.strategies.checkpoint.io import read_metadata, resolve_checkpoint
from trainforge.strategies.checkpoint.remote import RemotePath, location
from trainforge.strategies.checkpoint.remote_read import Location, list_checkpoints_at, resolve_on_ranks
from trainforge.strategies.checkpoint.run_lock import RunLock, acquire_on_ranks
from trainforge.strategies.errors import CheckpointError
from trainforge.trainer.accelerator.seed import set_rng_state
from trainforge.trainer.checkpoint.contents import CheckpointParts, load_state, save_state
from trainforge.trainer.loop.settings import Progress
from trainforge.trainer.module.hparams import DATAMODULE_PREFIX, checkpoint_hparams

if TYPE_CHECKING:  # pragma: no cover
    import os

    from trainforge.callbacks.view import TrainerView
    from trainforge.trainer.accelerator.accelerator import Accelerator

log = logging.getLogger("trainforge")


class FitCheckpoints:
    """The Trainer's side of the one checkpoint path, a part the Trainer builds once. What a checkpoint
    holds comes from the Trainer at each call (``parts``: its model, optimizers, schedulers, loader,
    progress, callbacks, datamodule and run id); ``fire`` is its dispatch point (SAVE_CHECKPOINT,
    LOAD_CHECKPOINT); ``view`` is the Trainer as callbacks see it, handed to ``Checkpointer.directory``."""

    def __init__(
        self,
        accelerator: Accelerator,
        progress: Progress,
        callbacks: List[Any],
        fire: Callable[..., None],
        view: TrainerView,
    ) -> None:
        self.accelerator, self.strategy = accelerator, accelerator.strategy
        self.progress, self.callbacks, self.fire, self.view = progress, callbacks, fire, view
        # restored by the loop just before the next batch (see restore_pending_rng)
        self.pending_rng: Optional[Dict[str, Any]] = None
        # written by this fit (or resumed from): rollbacks restore it
        self.newest: Optional[Location] = None
        # Held by global rank 0 from fit start to its end (strategies/checkpoint/run_lock.py).
        self.run_lock: Optional[RunLock] = None

    def root(self) -> Location:
        """Where ``ckpt_path="last"`` and ``resume="auto"`` look: the first ``Checkpointer``'s directory."""
        for cb in self.callbacks:
            if isinstance(cb, Checkpointer):
                return cb.directory(self.view)
        return location(self.view.default_checkpoint_dir)

    def begin_run(self) -> str:
        """A new run id, the same on every rank; the run directory locked first when checkpoints are written.
        One writer per run directory: a second process on it stops here, on every rank, before writing."""
        if any(isinstance(cb, Checkpointer) for cb in self.callbacks):
            self.run_lock = acquire_on_ranks(self.root(), self.strategy.global_rank, self.strategy.broadcast)
        self.newest = None
        return self.strategy.broadcast(uuid.uuid4().hex, 0)

    def end_run(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    def resume(self, ckpt_path: Optional[str], required: bool, parts: CheckpointParts) -> Optional[Path]:
        """Resume from ``ckpt_path`` if given (the checkpoint restored, or None). A fresh run whose checkpoint
        directory already holds checkpoints writes beside them (ModelCheckpoint adds ``-v1``, ``-v2``...
        where names collide; nothing of another run is replaced) and says so once, with how to resume."""
        path = self._load_checkpoint(ckpt_path, parts, required=required) if ckpt_path is not None else None
        # what a StepGuard's rollback restores, until this fit saves
        self.newest = path
        if path is None and self.strategy.is_global_zero:
            self._warn_of_earlier_run()
        return path

    def _warn_of_earlier_run(self) -> None:
        root = self.root()
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

    def save(
        self,
        path: os.PathLike | str,
        parts: CheckpointParts,
        module: Any,
        async_save: bool = False,
        trainable_only: Optional[bool] = None,
    ) -> Path:
        """Write ``parts`` as one checkpoint directory; ``module``'s hyperparameters go with them."""

        def before_write(state: Dict[str, Any]) -> None:
            # the hyperparameters (for load_from_checkpoint), then SAVE_CHECKPOINT: the module and the
            # callbacks may add to the state (Lightning's order)
            state.update(checkpoint_hparams(module))
            state.update(checkpoint_hparams(parts.datamodule, prefix=DATAMODULE_PREFIX))
            self.fire(Event.SAVE_CHECKPOINT, state)

        self.newest = save_state(
            self.accelerator, path, parts, async_save, before_write=before_write, trainable_only=trainable_only
        )
        return self.newest

    def _load_checkpoint(self, ckpt_path: str, parts: CheckpointParts, required: bool = True) -> Optional[Path]:
        """Restore everything but RNG now; RNG is restored by the loop just before the next batch."""
        root = self.root()
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
            if self.strategy.is_global_zero:
                log.info("trainforge: no checkpoint under %s; starting from scratch", root)
            return None
        state, self.pending_rng = load_state(self.accelerator, path, parts)
        self.fire(Event.LOAD_CHECKPOINT, state)
        if self.strategy.is_global_zero:
            log.info(
                "trainforge: resumed from %s (epoch %d, step %d)",
                path,
                self.progress.epoch,
                self.progress.global_step,
            )
        return path

    def restore_pending_rng(self) -> None:
        """The resumed RNG states: the last thing before the loop, so resumed random streams are exact."""
        if self.pending_rng is not None:
            set_rng_state(self.pending_rng)
            self.pending_rng = None

    def roll_back(self, guard: StepGuard, parts: CheckpointParts) -> None:
        """A ``StepGuard``'s rollback (``LossSpikes(rollback_after=N)``), on every rank at the same optimizer step (a skipped one, its
        gradients zeroed): restore the newest checkpoint this fit committed (or resumed from) through
        ``load_state``, all but the data position (callbacks/loss_spikes.py says why). An asynchronous save
        in flight is committed first, so the checkpoint chosen never depends on timing. Not the newest in
        the directory: after a resume from an older checkpoint, the newer ones there belong to the branch
        that was abandoned."""
        self.accelerator.wait_for_checkpoint()
        if isinstance(self.newest, RemotePath):
            # object storage: every node downloads the same one
            chosen, why = self._remote_newest(self.newest)
        else:
            found = self._verified_newest() if self.strategy.is_global_zero else ("", "")
            # rank 0 names it: every rank restores the same one
            chosen, why = self.strategy.broadcast(found, 0)
        if not chosen:
            raise CheckpointError(
                f"{type(guard).__name__} asked to roll back after consecutive skipped steps "
                f"at global step {self.progress.global_step} and there is no checkpoint to "
                f"roll back to: {why}. Save earlier (ModelCheckpoint(every_n_steps=...) with a smaller n), or "
                "raise rollback_after"
            )
        path, before, acc = Path(chosen), self.progress.global_step, self.accelerator
        saved_progress = Progress()
        optimizers = parts.optimizers
        parts = dataclasses.replace(
            parts,
            # the data goes on past the skipped batches
            loaders=[],
            callbacks=[cb for cb in self.callbacks if cb.restore_on_rollback],
            progress=saved_progress,
            datamodule=None,
        )
        state, rng = load_state(acc, path, parts)
        # the optimizer steps the restored weights had
        self.progress.global_step = saved_progress.global_step
        # at a window boundary, whatever the checkpoint's window was: its partial gradients go
        acc.step = 0
        acc.load_item_window_state_dict({"items_in_window": None})
        for opt in optimizers:
            opt.optimizer.zero_grad()
        self.fire(Event.LOAD_CHECKPOINT, state)
        set_rng_state(rng)
        guard.rolled_back(str(path), before, self.progress.global_step, self.strategy.is_global_zero)

    def _verified_newest(self) -> tuple[str, str]:
        """The newest checkpoint of this fit if it verifies, else ``""`` and why (said on every rank)."""
        newest = self.newest
        if newest is None:
            return "", "this fit has written no checkpoint yet and did not resume from one"
        local = cast(Path, newest)  # a URL goes through _remote_newest
        try:
            return str(resolve_checkpoint(local.parent, local)), ""
        except CheckpointError as e:
            return "", str(e)

    def _remote_newest(self, newest: RemotePath) -> tuple[str, str]:
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


def saved_run_id(path: Path) -> Optional[str]:
    """The run id a checkpoint was written by (a resumed run keeps it)."""
    return read_metadata(path).get("run_id")
