"""What a checkpoint holds, on top of the directory format of ``trainforge.strategies.checkpoint.io``
(atomic, verified, weights_only). The Trainer and the Accelerator share one format and one save/load
path (``save_state``/``load_state`` over ``CheckpointParts``): a Trainer checkpoint loads with
``Accelerator.load_state`` and an ``Accelerator.save_state`` one resumes ``Trainer.fit(ckpt_path=...)``.

Layout of one checkpoint directory::

    model.safetensors (+ index)   weights, written by the strategy (sharded strategies: their own subdir)
    optimizers.pt                 optimizer states (the strategy's format)
    trainer_state.pt              progress, schedulers, grad scaler, callback states, registered
                                  objects, the module's hyperparameters (rank 0)
    rng_rank{r}.pt                python/numpy/torch/CUDA generator states of rank r
    dataloader_rank{r}.pt         position of rank r's loader (a global sample count inside)
    grads_rank{r}.pt              only inside an accumulation window: rank r's partial gradients
                                  and item count (trainer/checkpoint/partial_grads.py)
    frozen_base.pt                only when the frozen parameters are left out (``trainable_only``, by
                                  default for PEFT models: trainer/checkpoint/adapters.py): the base it expects
    metadata.json                 format version, step, world size, strategy, precision, versions, manifest

RNG states are restored last, just before the loop continues, so nothing between loading and the
next batch can shift the random streams (that is what makes resume bit-identical).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, cast

from torch import nn

from trainforge.callbacks.base import RESUME_NEEDS_CALLBACK
from trainforge.strategies.checkpoint.async_save import resolve_async_save
from trainforge.strategies.checkpoint.io import (
    list_checkpoints,
    load_object,
    read_metadata,
)
from trainforge.strategies.checkpoint.remote import location
from trainforge.strategies.checkpoint.remote_read import resolve_on_ranks
from trainforge.strategies.checkpoint.remote_write import open_writer
from trainforge.strategies.checkpoint.run_lock import acquire_on_ranks
from trainforge.strategies.environment import slurm_job_id
from trainforge.strategies.errors import CheckpointError, ConfigurationError
from trainforge.trainer.accelerator.seed import rng_state, set_rng_state
from trainforge.trainer.checkpoint.adapters import (
    load_model_state,
    save_adapter,
    save_model_state,
    trainable_only_for,
    wants_adapter,
)
from trainforge.trainer.checkpoint.partial_grads import (
    check_mid_window_save,
    read_partial_gradients,
    restore_partial_gradients,
    save_partial_gradients,
)
from trainforge.trainer.checkpoint.scheduler_clock import convert_scheduler_states, scheduler_clock

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.accelerator.accelerator import Accelerator

log = logging.getLogger("trainforge")


@dataclass
class CheckpointParts:
    """What one side hands to the one save/load path. The Trainer and the Accelerator write the
    same files; each restores the parts it has and names a part it needs that the checkpoint lacks.

    ``progress``: the Trainer's ``Progress``; an Accelerator records the same fields it can know
    (optimizer steps, its first loader's epoch and batch) so that a Trainer resumes its checkpoint."""

    kind: str  # who writes: "trainer" | "accelerator" (metadata "kind")
    model: Optional[nn.Module]
    optimizers: List[Any]  # prepared optimizers (trainer.wrappers.PreparedOptimizer)
    schedulers: List[Any]  # objects with state_dict / load_state_dict
    loaders: List[Any]  # prepared loaders whose position is saved, the training one first
    custom: List[Any] = field(default_factory=list)  # Accelerator.register_for_checkpointing
    callbacks: List[Any] = field(default_factory=list)  # Trainer callbacks (state_key -> state)
    progress: Any = None  # trainer.config.Progress (Trainer only)
    datamodule: Any = None
    run_id: Optional[str] = None  # the Trainer's run (metadata "run_id"; a resumed run keeps it)


def _progress_of(parts: CheckpointParts) -> Dict[str, int]:
    if parts.progress is not None:
        return parts.progress.state_dict()
    first = parts.loaders[0] if parts.loaders else None
    return {
        "global_step": max((o.step_count for o in parts.optimizers), default=0),
        "epoch": first.epoch if first is not None else 0,
        "batch_idx": first.batch_in_epoch if first is not None else 0,
    }


def save_state(
    acc: Accelerator,
    path: os.PathLike | str,
    parts: CheckpointParts,
    async_save: bool = False,
    before_write: Optional[Callable[[Dict[str, Any]], None]] = None,
    update_latest: bool = True,
    trainable_only: Optional[bool] = None,
) -> Path:
    """The one writer of a resumable checkpoint (layout in this module's docstring). ``trainable_only``:
    leave the frozen parameters out (None: for PEFT models; ``trainer/checkpoint/adapters.py``)."""
    strategy = acc.strategy
    check_mid_window_save(acc)
    trainable_only = parts.model is not None and trainable_only_for(strategy, parts.model, trainable_only)
    writer = _open_writer(acc, path, async_save, kind=parts.kind)
    state: Dict[str, Any] = {"path": str(writer.final_dir), "extra": {}}
    if before_write is not None:
        before_write(state)  # the Trainer's SAVE_CHECKPOINT: callbacks and the module may add to state["extra"]
    if parts.model is not None:
        save_model_state(strategy, writer, parts.model, [o.optimizer for o in parts.optimizers], trainable_only)
    progress = _progress_of(parts)
    state.update(
        {
            "progress": progress,
            "schedulers": [s.state_dict() for s in parts.schedulers],
            "scheduler_clock": _clock(acc, parts),
            "precision": acc.precision.state_dict(),
            "accumulation_step": acc.step,
            "callbacks": {cb.state_key: cb.state_dict() for cb in parts.callbacks},
            "custom": [o.state_dict() for o in parts.custom],
            "loaders": len(parts.loaders),
        }
    )
    if parts.datamodule is not None:
        state["datamodule"] = parts.datamodule.state_dict()
    save_partial_gradients(acc, writer, parts.model, state)  # inside a window only
    if strategy.is_global_zero:
        writer.save_object("trainer_state", state)
    writer.save_object(f"rng_rank{strategy.global_rank}", rng_state())
    writer.save_object(f"dataloader_rank{strategy.global_rank}", [dl.state_dict() for dl in parts.loaders])
    return writer.finalize(
        {
            "step": progress["global_step"],
            "epoch": progress["epoch"],
            "batch_idx": progress["batch_idx"],
            "strategy": strategy.name,
            "precision": acc.precision.name,
            "kind": parts.kind,
            "run_id": parts.run_id,
            # the SLURM job that wrote it: a requeued job resumes its own run (trainer/cluster/slurm_requeue.py)
            "slurm_job": _slurm_job(),
            "trainable_only": trainable_only,
        },
        update_latest=update_latest,
    )


def load_state(acc: Accelerator, path: Path, parts: CheckpointParts) -> tuple[Dict[str, Any], Dict[str, Any]]:
    """Restore every part ``parts`` has from ``path`` (written by either side) except RNG, which is
    returned with the state: the caller restores it last, just before the next batch."""
    meta = read_metadata(path)
    strategy = acc.strategy
    state = load_object(path, "trainer_state")
    _check_parts(path, meta, state, parts)
    _check_needed_callbacks(path, state, parts)
    partial_grads = read_partial_gradients(acc, path, state, parts.model)  # checked before anything is restored
    # callbacks first: one that reshapes the optimizers (BaseFinetuning's added parameter groups) does so before
    # their saved states are loaded into them
    _load_callbacks(path, meta, state, parts, strategy.is_global_zero)
    if parts.model is not None:
        load_model_state(strategy, path, meta, parts.model, [o.optimizer for o in parts.optimizers])
    sched_states = convert_scheduler_states(
        path,
        state["schedulers"],
        state.get("scheduler_clock"),
        _clock(acc, parts),
        parts.schedulers,
        announce=strategy.is_global_zero,
    )
    for sched, sched_state in zip(parts.schedulers, sched_states):
        sched.load_state_dict(sched_state)
    acc.precision.load_state_dict(state["precision"])
    acc.step = int(state.get("accumulation_step", 0))
    restore_partial_gradients(acc, partial_grads)  # after the weights and optimizers, before the next micro-batch
    for obj, obj_state in zip(parts.custom, state.get("custom", [])):
        obj.load_state_dict(obj_state)
    for opt in parts.optimizers:
        opt.step_count = int(state["progress"].get("global_step", 0))
    if parts.progress is not None:
        parts.progress.load_state_dict(state["progress"])
    if parts.datamodule is not None and "datamodule" in state:
        parts.datamodule.load_state_dict(state["datamodule"])
    rng, loader_states = _read_rank_state(path, meta, strategy)
    for dl, sd in zip(parts.loaders, loader_states):
        dl.load_state_dict(sd, world_size=strategy.data_parallel_size, rank=strategy.data_parallel_rank)
    if len(loader_states) < len(parts.loaders) and strategy.is_global_zero:
        log.warning(
            "trainforge: %s holds the position of %d data loader(s) and %d are prepared now; the other(s) "
            "start at their beginning (prepare the loaders in the order they were saved in)",
            path,
            len(loader_states),
            len(parts.loaders),
        )
    return state, rng


def _load_callbacks(
    path: Path, meta: Dict[str, Any], state: Dict[str, Any], parts: CheckpointParts, announce: bool
) -> None:
    saved_callbacks = state.get("callbacks", {})
    for cb in parts.callbacks:
        if saved_callbacks.get(cb.state_key):
            # an empty state is not loaded (Lightning)
            cb.load_state_dict(saved_callbacks[cb.state_key])
    fresh = [cb.state_key for cb in parts.callbacks if cb.state_key not in saved_callbacks and cb.state_dict()]
    if fresh and announce:
        log.warning(
            "trainforge: %s holds no state for callback(s) %s (written by %s); they start fresh",
            path,
            ", ".join(fresh),
            _writer_name(meta),
        )


def _clock(acc: Accelerator, parts: CheckpointParts) -> Optional[Dict[str, Any]]:
    """The Accelerator's schedulers step in Accelerate's units (trainer.scheduler_clock); the
    Trainer's once per optimizer step or epoch, as Lightning's (none recorded)."""
    return scheduler_clock(acc, parts.schedulers, parts.loaders) if parts.kind == "accelerator" else None


def _writer_name(meta: Dict[str, Any]) -> str:
    return "Accelerator.save_state" if meta.get("kind") == "accelerator" else "the Trainer"


def _slurm_job() -> Optional[str]:
    try:
        return slurm_job_id()
    except ConfigurationError:
        # a malformed SLURM_JOB_ID is refused where requeueing needs it (Trainer(auto_requeue=True))
        return None


def _check_needed_callbacks(path: Path, state: Dict[str, Any], parts: CheckpointParts) -> None:
    """Training that continues (optimizers restored) from a checkpoint whose callback state says it needs its
    callback (``RESUME_NEEDS_CALLBACK``: a weight average saved as the model) needs that callback."""
    if not parts.optimizers:
        return
    present = {cb.state_key for cb in parts.callbacks}
    for key, saved in state.get("callbacks", {}).items():
        why = saved.get(RESUME_NEEDS_CALLBACK) if isinstance(saved, dict) else None
        if why and key not in present:
            raise CheckpointError(f"{path} cannot continue training without the callback {key}: {why}")


def _check_parts(path: Path, meta: Dict[str, Any], state: Dict[str, Any], parts: CheckpointParts) -> None:
    """A part this side needs and the checkpoint lacks (or holds a different number of) is an error
    that names it, before anything is restored."""
    who = _writer_name(meta)
    saved = len(state.get("schedulers", []))
    if saved != len(parts.schedulers):
        raise CheckpointError(
            f"{path} (written by {who}) holds {saved} learning-rate scheduler state(s) and "
            f"{len(parts.schedulers)} scheduler(s) are prepared now: the schedule cannot continue "
            "where it stopped. Resume with the same schedulers (Trainer: configure_optimizers; "
            "Accelerator: prepare() each scheduler that was saved)"
        )
    saved = len(state.get("custom", []))
    if saved != len(parts.custom):
        raise CheckpointError(
            f"{path} (written by {who}) holds {saved} registered object(s) but "
            f"{len(parts.custom)} are registered now; register the same objects in the same "
            "order (Accelerator.register_for_checkpointing) before load_state"
        )
    if parts.progress is not None and "progress" not in state:
        raise CheckpointError(
            f"{path} (written by {who}, an older format) records no training progress (epoch, "
            "step); the Trainer cannot resume it exactly. Load it with Accelerator.load_state, "
            "or start the Trainer from its weights"
        )
    if parts.loaders and state.get("loaders", 1) == 0:
        raise CheckpointError(
            f"{path} (written by {who}) holds no data position (no DataLoader was prepared when "
            f"it was saved) and {len(parts.loaders)} loader(s) would continue from it; prepare the "
            "training DataLoader before save_state, or leave it out of this run"
        )


def _read_rank_state(path: Path, meta: Dict[str, Any], strategy: Any) -> tuple:
    """This rank's RNG and loader states. On a different number of processes the loader position
    is the global sample count (the same in every rank's file); RNG states come from rank
    ``rank % old_world_size`` (exactness across a world-size change covers samples, not RNG)."""
    old_world = int(meta.get("world_size", 1))
    rank = strategy.global_rank
    source = rank if old_world == strategy.world_size else rank % old_world
    if old_world != strategy.world_size and strategy.is_global_zero:
        log.warning(
            "trainforge: resuming a checkpoint written by %d process(es) on %d; the data position "
            "continues from the same global sample, but the random streams (dropout, later epochs' "
            "shuffle order) continue from rank 0's and differ from an uninterrupted run on %d, and the "
            "DataLoader workers' (augmentation) restart from their seeds for the rest of the saved epoch",
            old_world,
            strategy.world_size,
            strategy.world_size,
        )
    return load_object(path, f"rng_rank{source}"), load_object(
        path, f"dataloader_rank{0 if old_world != strategy.world_size else source}"
    )


# ---- asynchronous saves (strategies/checkpoint/async_save.py) ---------------------------------------
def _open_writer(acc: Accelerator, path: os.PathLike | str, async_save: bool, kind: str) -> Any:
    """A CheckpointWriter, or its staging stand-in for an asynchronous save; either way only after
    the save in flight (if any) is committed: one save at a time."""
    if async_save:
        return acc.async_checkpointer.open(path, kind=kind)
    acc.wait_for_checkpoint()
    strategy = acc.strategy
    return open_writer(  # a URL: staged locally and uploaded (strategies/checkpoint/remote.py)
        path, rank=strategy.global_rank, world_size=strategy.world_size, barrier=strategy.barrier, kind=kind
    )


# ---- the Accelerator's side -------------------------------------------------------------------------
def save_accelerator_state(
    acc: Accelerator,
    output_dir: os.PathLike | str,
    parts: CheckpointParts,
    async_save: bool = False,
    trainable_only: Optional[bool] = None,
) -> Path:
    return save_state(
        acc,
        output_dir,
        parts,
        resolve_async_save(async_save, acc.strategy.root_device),
        update_latest=False,
        trainable_only=trainable_only,
    )


def load_accelerator_state(acc: Accelerator, input_dir: os.PathLike | str, parts: CheckpointParts) -> Path:
    s = acc.strategy
    path = cast(
        Path,
        resolve_on_ranks(
            location(input_dir).parent,
            input_dir,
            rank=s.global_rank,
            broadcast=s.broadcast,
            world_size=s.world_size,
            barrier=s.barrier,
        ),
    )
    _, rng = load_state(acc, path, parts)
    set_rng_state(rng)
    return path


def _project_root(acc: Accelerator) -> Path:
    project_dir = acc.project_dir  # set whenever automatic_checkpoint_naming is (the Accelerator checks)
    if not acc.automatic_checkpoint_naming or project_dir is None:
        raise ConfigurationError(
            "save_state()/load_state() without a directory need Accelerator(project_dir=..., "
            "automatic_checkpoint_naming=True); or pass the directory"
        )
    return Path(project_dir) / "checkpoints"


def save_project_checkpoint(
    acc: Accelerator, parts: CheckpointParts, async_save: bool = False, trainable_only: Optional[bool] = None
) -> Path:
    """Accelerate's automatic naming: ``checkpoints/checkpoint_<i>``, i one more than the newest;
    the oldest beyond ``total_limit`` deleted by rank 0 once the new one is committed."""
    from trainforge.strategies.checkpoint.io import delete_checkpoint

    root = _project_root(acc)
    hold_project_lock(acc, root)
    existing = _numbered(root)
    is_async = resolve_async_save(async_save, acc.strategy.root_device)
    name = f"checkpoint_{existing[-1][0] + 1 if existing else 0}"
    path = save_accelerator_state(acc, root / name, parts, is_async, trainable_only)
    if acc.total_limit is not None and acc.is_main_process:
        # the new directory may not be committed yet: keep total_limit - 1 committed ones beside it
        old = [p for _, p in _numbered(root) if p != path]
        for stale in old[: max(0, len(old) - (acc.total_limit - 1))]:
            if is_async:
                acc.async_checkpointer.after_commit(functools.partial(delete_checkpoint, stale))
            else:
                delete_checkpoint(stale)
    if not is_async:
        acc.wait_for_everyone()
    return path


# Per Accelerator: what gives its project's run lock back (None on the ranks that hold none).
_project_locks: weakref.WeakKeyDictionary[Any, Optional[weakref.finalize]] = weakref.WeakKeyDictionary()


def hold_project_lock(acc: Accelerator, root: Path) -> None:
    """One writer per project directory (``strategies/checkpoint/run_lock.py``): from the first automatically
    named save until ``end_training`` (or the Accelerator's end), a second process on the same ``project_dir``
    is refused on every rank before it writes. A collective the first time, on every rank."""
    if acc in _project_locks:
        return
    lock = acquire_on_ranks(root, acc.strategy.global_rank, acc.strategy.broadcast)
    _project_locks[acc] = weakref.finalize(acc, lock.release) if lock is not None else None


def release_project_lock(acc: Accelerator) -> None:
    """Give the project's run lock back (``end_training``); the next automatically named save takes it again."""
    release = _project_locks.pop(acc, None)
    if release is not None:
        release()


def newest_project_checkpoint(acc: Accelerator) -> Path:
    root = _project_root(acc)
    existing = _numbered(root)
    if not existing:
        raise CheckpointError(f"load_state(): no checkpoint_<i> under {root} yet; save_state() first")
    return existing[-1][1]


def _numbered(root: Path) -> List[tuple]:
    out = []
    for p in list_checkpoints(root) if root.exists() else []:
        suffix = p.name[len("checkpoint_") :]
        if p.name.startswith("checkpoint_") and suffix.isdigit():
            out.append((int(suffix), p))
    return sorted(out)


# ---- consolidated weights ------------------------------------------------------------------------
def save_weights(
    strategy: Any,
    model: Any,
    path: os.PathLike | str,
    max_shard_size: Optional[int] = None,
    adapter_only: Optional[bool] = None,
) -> Path:
    """One safetensors file (or shards + HF index) of the full model, plus ``config.json`` when the
    model carries a Hugging Face config, so ``transformers`` can load the directory; for a PEFT model
    (``adapter_only`` None or True) the adapter in PEFT's format instead (``trainer/checkpoint/adapters.py``)."""
    if wants_adapter(strategy, model, adapter_only):
        return save_adapter(strategy, model, path)
    writer = open_writer(
        path, rank=strategy.global_rank, world_size=strategy.world_size, barrier=strategy.barrier, kind="weights"
    )
    weights = strategy.module_state_dict(model)
    if strategy.is_global_zero:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
        writer.save_tensors("model", weights, **kwargs)
        config: Any = getattr(strategy.unwrap(model), "config", None)
        if hasattr(config, "to_json_string"):
            (writer.tmp_dir / "config.json").write_text(config.to_json_string())
    return writer.finalize({"strategy": strategy.name, "kind": "weights"}, update_latest=False)
