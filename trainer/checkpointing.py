"""What a Trainer or Accelerator checkpoint holds, on top of the directory format of
``trainforge.strategies.checkpoint_io`` (atomic, verified, weights_only).

Layout of one checkpoint directory::

    model.safetensors (+ index)   weights, written by the strategy (sharded strategies: their own subdir)
    optimizers.pt                 optimizer states (the strategy's format)
    trainer_state.pt              progress, schedulers, grad scaler, callback states (rank 0)
    rng_rank{r}.pt                python/numpy/torch/CUDA generator states of rank r
    dataloader_rank{r}.pt         position of rank r's loader (a global sample count inside)
    metadata.json                 format version, step, world size, strategy, precision, versions, manifest

RNG states are restored last, just before the loop continues, so nothing between loading and the
next batch can shift the random streams (that is what makes resume bit-identical).
"""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from trainforge.strategies.async_save import resolve_async_save
from trainforge.strategies.checkpoint_io import (
    CheckpointWriter,
    list_checkpoints,
    load_object,
    read_metadata,
    resolve_checkpoint,
)
from trainforge.strategies.errors import CheckpointError, ConfigurationError
from trainforge.trainer.events import Event
from trainforge.trainer.seed import rng_state, set_rng_state

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.accelerator import Accelerator
    from trainforge.trainer.trainer import Trainer

log = logging.getLogger("trainforge")


def checkpoint_root(trainer: "Trainer") -> Path:
    """Where ``ckpt_path="last"`` and ``resume="auto"`` look: the first ModelCheckpoint's directory."""
    from trainforge.callbacks.checkpoint import ModelCheckpoint

    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint):
            return cb.directory(trainer)
    return Path(trainer.default_root_dir) / "checkpoints"


def start_run(trainer: "Trainer", ckpt_path: Optional[str], required: bool) -> Optional[Path]:
    """Give this fit a run id (every rank the same), then resume from ``ckpt_path`` if given: a
    resumed run keeps the id of the run it continues. A fresh run whose checkpoint directory
    already holds checkpoints writes beside them (ModelCheckpoint adds ``-v1``, ``-v2``... where
    names collide; nothing of another run is replaced) and says so once, with how to resume."""
    trainer.run_id = trainer.strategy.broadcast(uuid.uuid4().hex, 0)
    path = load_trainer_checkpoint(trainer, ckpt_path, required=required) if ckpt_path is not None else None
    if path is not None:
        trainer.run_id = read_metadata(path).get("run_id") or trainer.run_id
    elif trainer.is_global_zero:
        root = checkpoint_root(trainer)
        earlier = list_checkpoints(root)
        if earlier:
            log.warning("trainforge: %s already holds %d checkpoint(s) of an earlier run (newest: %s). This run "
                        "starts fresh and writes beside them; a name that is taken gets a -v1, -v2... suffix, so "
                        "nothing is overwritten. To continue that run instead, pass Trainer(resume='auto') or "
                        "fit(ckpt_path='last')", root, len(earlier), earlier[-1].name)
    return path


def _write_rank_state(writer: CheckpointWriter, rank: int, loaders: List[Any]) -> None:
    writer.save_object(f"rng_rank{rank}", rng_state())
    writer.save_object(f"dataloader_rank{rank}", [dl.state_dict() for dl in loaders])


def _read_rank_state(path: Path, meta: Dict[str, Any], strategy: Any) -> tuple:
    """This rank's RNG and loader states. On a different number of processes the loader position
    is the global sample count (the same in every rank's file); RNG states come from rank
    ``rank % old_world_size`` (exactness across a world-size change covers samples, not RNG)."""
    old_world = int(meta.get("world_size", 1))
    rank = strategy.global_rank
    source = rank if old_world == strategy.world_size else rank % old_world
    if old_world != strategy.world_size and strategy.is_global_zero:
        log.warning("trainforge: resuming a checkpoint written by %d process(es) on %d; the data position "
                    "continues from the same global sample, but the random streams (dropout, later epochs' "
                    "shuffle order) continue from rank 0's and differ from an uninterrupted run on %d",
                    old_world, strategy.world_size, strategy.world_size)
    return load_object(path, f"rng_rank{source}"), load_object(path, f"dataloader_rank{0 if old_world != strategy.world_size else source}")


# ---- asynchronous saves (strategies/async_save.py) -------------------------------------------------
def _open_writer(acc: "Accelerator", path: os.PathLike | str, async_save: bool, kind: str) -> Any:
    """A CheckpointWriter, or its staging stand-in for an asynchronous save; either way only after
    the save in flight (if any) is committed: one save at a time."""
    if async_save:
        return acc.async_checkpointer.open(path, kind=kind)
    acc.wait_for_checkpoint()
    strategy = acc.strategy
    return CheckpointWriter(path, rank=strategy.global_rank, world_size=strategy.world_size, barrier=strategy.barrier,
                            kind=kind)


# ---- Trainer ------------------------------------------------------------------------------------
def save_trainer_checkpoint(trainer: "Trainer", path: os.PathLike | str, async_save: bool = False) -> Path:
    strategy = trainer.strategy
    writer = _open_writer(trainer.accelerator, path, async_save, kind="trainer")
    state: Dict[str, Any] = {"path": str(writer.final_dir), "extra": {}}
    trainer._fire(Event.SAVE_CHECKPOINT, state)  # callbacks and the module may add to state["extra"]
    strategy.save_checkpoint(writer, trainer.model, trainer.optimizers)
    state.update({
        "progress": trainer.progress.state_dict(),
        "schedulers": [cfg["scheduler"].state_dict() for cfg in trainer.lr_scheduler_configs],
        "precision": trainer.accelerator.precision.state_dict(),
        "accumulation_step": trainer.accelerator.step,
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
    })
    if trainer.datamodule is not None:
        state["datamodule"] = trainer.datamodule.state_dict()
    if strategy.is_global_zero:
        writer.save_object("trainer_state", state)
    _write_rank_state(writer, strategy.global_rank, [trainer.train_dataloader])
    p = trainer.progress
    return writer.finalize({"step": p.global_step, "epoch": p.epoch, "batch_idx": p.batch_idx,
                            "strategy": strategy.name,
                            "precision": trainer.precision, "kind": "trainer",
                            "run_id": getattr(trainer, "run_id", None)})


def load_trainer_checkpoint(trainer: "Trainer", ckpt_path: str, required: bool = True) -> Optional[Path]:
    """Restore everything but RNG now; RNG is restored by the loop just before the next batch."""
    root = checkpoint_root(trainer)
    if required and str(ckpt_path) == "last" and not list_checkpoints(root):
        raise CheckpointError(f"fit(ckpt_path='last'): there is no checkpoint under {root} yet. To resume when one "
                              "exists and start fresh otherwise, use Trainer(resume='auto') and leave ckpt_path out")
    path = resolve_checkpoint(root, ckpt_path, missing_ok=not required)
    if path is None:
        if trainer.is_global_zero:
            log.info("trainforge: no checkpoint under %s; starting from scratch", checkpoint_root(trainer))
        return None
    meta = read_metadata(path)
    if meta.get("kind", "trainer") != "trainer":
        raise CheckpointError(f"{path} was written by Accelerator.save_state; load it with Accelerator.load_state")
    strategy = trainer.strategy
    strategy.load_checkpoint(path, trainer.model, trainer.optimizers)
    state = load_object(path, "trainer_state")
    trainer.progress.load_state_dict(state["progress"])
    for cfg, sched_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
        cfg["scheduler"].load_state_dict(sched_state)
    trainer.accelerator.precision.load_state_dict(state["precision"])
    trainer.accelerator.step = int(state.get("accumulation_step", 0))
    for cb in trainer.callbacks:
        if cb.state_key in state["callbacks"]:
            cb.load_state_dict(state["callbacks"][cb.state_key])
    if trainer.datamodule is not None and "datamodule" in state:
        trainer.datamodule.load_state_dict(state["datamodule"])
    trainer._fire(Event.LOAD_CHECKPOINT, state)
    rng, (loader_state,) = _read_rank_state(path, meta, strategy)
    trainer.train_dataloader.load_state_dict(loader_state, world_size=strategy.data_parallel_size,
                                              rank=strategy.data_parallel_rank)
    trainer._pending_rng = rng
    if trainer.is_global_zero:
        log.info("trainforge: resumed from %s (epoch %d, step %d)", path, trainer.progress.epoch,
                 trainer.progress.global_step)
    return path


def restore_pending_rng(owner: Any) -> None:
    rng = getattr(owner, "_pending_rng", None)
    if rng is not None:
        set_rng_state(rng)
        owner._pending_rng = None


# ---- Accelerator ----------------------------------------------------------------------------------
def save_accelerator_state(acc: "Accelerator", output_dir: os.PathLike | str, async_save: bool = False) -> Path:
    strategy = acc.strategy
    if len(acc._models) > 1:
        raise ConfigurationError(f"save_state got {len(acc._models)} prepared models; it saves one trained model "
                                 "(save others with save_model)")
    writer = _open_writer(acc, output_dir, resolve_async_save(async_save, strategy.root_device), kind="accelerator")
    model = acc._models[0] if acc._models else None
    optimizers = [o.optimizer for o in acc._optimizers]
    if model is not None:
        strategy.save_checkpoint(writer, model, optimizers)
    if strategy.is_global_zero:
        writer.save_object("trainer_state", {
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "precision": acc.precision.state_dict(), "accumulation_step": acc.step,
            "custom": [o.state_dict() for o in acc._custom_objects]})
    _write_rank_state(writer, strategy.global_rank, acc._dataloaders)
    return writer.finalize({"strategy": strategy.name,
                            "precision": acc.precision.name, "kind": "accelerator"}, update_latest=False)


def load_accelerator_state(acc: "Accelerator", input_dir: os.PathLike | str) -> Path:
    path = resolve_checkpoint(Path(input_dir).parent, input_dir)
    meta = read_metadata(path)
    strategy = acc.strategy
    if acc._models:
        strategy.load_checkpoint(path, acc._models[0], [o.optimizer for o in acc._optimizers])
    state = load_object(path, "trainer_state")
    for sched, sd in zip(acc._schedulers, state["schedulers"]):
        sched.load_state_dict(sd)
    acc.precision.load_state_dict(state["precision"])
    acc.step = int(state["accumulation_step"])
    if len(state["custom"]) != len(acc._custom_objects):
        raise CheckpointError(f"{path} holds {len(state['custom'])} registered object(s) but "
                              f"{len(acc._custom_objects)} are registered now; register the same objects in the "
                              "same order before load_state")
    for obj, sd in zip(acc._custom_objects, state["custom"]):
        obj.load_state_dict(sd)
    rng, loader_states = _read_rank_state(path, meta, strategy)
    for dl, sd in zip(acc._dataloaders, loader_states):
        dl.load_state_dict(sd, world_size=strategy.data_parallel_size, rank=strategy.data_parallel_rank)
    set_rng_state(rng)
    return path


def _project_root(acc: "Accelerator") -> Path:
    if not acc.automatic_checkpoint_naming:
        raise ConfigurationError("save_state()/load_state() without a directory need Accelerator(project_dir=..., "
                                 "automatic_checkpoint_naming=True); or pass the directory")
    return Path(acc.project_dir) / "checkpoints"


def save_project_checkpoint(acc: "Accelerator", async_save: bool = False) -> Path:
    """Accelerate's automatic naming: ``checkpoints/checkpoint_<i>``, i one more than the newest;
    the oldest beyond ``total_limit`` deleted by rank 0 once the new one is committed."""
    from trainforge.strategies.checkpoint_io import delete_checkpoint

    root = _project_root(acc)
    existing = _numbered(root)
    is_async = resolve_async_save(async_save, acc.strategy.root_device)
    path = save_accelerator_state(acc, root / f"checkpoint_{existing[-1][0] + 1 if existing else 0}", is_async)
    if acc.total_limit is not None and acc.is_main_process:
        # the new directory may not be committed yet: keep total_limit - 1 committed ones beside it
        old = [p for _, p in _numbered(root) if p != path]
        for stale in old[:max(0, len(old) - (acc.total_limit - 1))]:
            if is_async:
                acc.async_checkpointer.after_commit(lambda stale=stale: delete_checkpoint(stale))
            else:
                delete_checkpoint(stale)
    if not is_async:
        acc.wait_for_everyone()
    return path


def newest_project_checkpoint(acc: "Accelerator") -> Path:
    root = _project_root(acc)
    existing = _numbered(root)
    if not existing:
        raise CheckpointError(f"load_state(): no checkpoint_<i> under {root} yet; save_state() first")
    return existing[-1][1]


def _numbered(root: Path) -> List[tuple]:
    out = []
    for p in list_checkpoints(root) if root.exists() else []:
        suffix = p.name[len("checkpoint_"):]
        if p.name.startswith("checkpoint_") and suffix.isdigit():
            out.append((int(suffix), p))
    return sorted(out)


# ---- consolidated weights ------------------------------------------------------------------------
def save_weights(strategy: Any, model: Any, path: os.PathLike | str, max_shard_size: Optional[int] = None) -> Path:
    """One safetensors file (or shards + HF index) of the full model, plus ``config.json`` when the
    model carries a Hugging Face config, so ``transformers`` can load the directory."""
    writer = CheckpointWriter(path, rank=strategy.global_rank, world_size=strategy.world_size,
                              barrier=strategy.barrier, kind="weights")
    weights = strategy.module_state_dict(model)
    if strategy.is_global_zero:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
        writer.save_tensors("model", weights, **kwargs)
        config = getattr(strategy.unwrap(model), "config", None)
        if hasattr(config, "to_json_string"):
            (writer.tmp_dir / "config.json").write_text(config.to_json_string())
    return writer.finalize({"strategy": strategy.name, "kind": "weights"},
                           update_latest=False)
