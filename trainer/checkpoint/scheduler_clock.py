"""A learning-rate schedule that continues where it stopped when an Accelerator run resumes on
another number of processes (or another batch size, or accumulation).

Accelerate's convention, which the programs ported to trainforge follow: a prepared scheduler
steps once per process per optimizer step (once with ``split_batches``), and the script sizes its
schedule from the length of the unsharded loader (HF ``run_*_no_trainer``:
``num_training_steps=max_train_steps * num_processes``). One scheduler step then stands for
``samples per optimizer step / scheduler steps per optimizer step`` samples — its *unit*. A
checkpoint records that unit; a run that resumes with another unit has its schedule written in
other units, and the scheduler's position is converted so that the same fraction of the schedule
has passed: ``last_epoch * old_unit / new_unit``.

That conversion is exact for ``LambdaLR`` (every HF ``get_scheduler`` schedule): its learning rate
is a function of ``last_epoch``, and its lambdas come from the resuming script, in the new units.
Other schedulers keep lengths in their saved state (``T_max``, ``step_size``, ``total_steps``, ...)
or multiply the previous rate: those resumes are refused with the way out, never continued wrong.
"""

from __future__ import annotations

import logging
from fractions import Fraction
from typing import Any, Dict, List, Optional

import torch

from trainforge.strategies.errors import CheckpointError

log = logging.getLogger("trainforge")


def scheduler_clock(acc: Any, schedulers: List[Any], loaders: List[Any]) -> Optional[Dict[str, Any]]:
    """What one prepared scheduler step stands for in this run (None without a prepared scheduler)."""
    if not schedulers:
        return None
    return {
        "steps_per_optimizer_step": int(schedulers[0].steps_per_call),
        "samples_per_optimizer_step": samples_per_optimizer_step(acc, loaders),
    }


def samples_per_optimizer_step(acc: Any, loaders: List[Any]) -> Optional[int]:
    """Global samples one optimizer step consumes, from the first (training) loader; None without one."""
    if not loaders:
        return None
    first = loaders[0]
    if first.dispatcher is not None:  # rank 0 reads the whole loader: one batch per process unless split
        per_step = (first.loader.batch_size or 1) * (1 if acc.split_batches else acc.num_processes)
    else:
        per_step = first.loader.global_batch_size
    return int(per_step) * int(acc.gradient_accumulation_steps)


def _unit(clock: Dict[str, Any]) -> Optional[Fraction]:
    samples = clock.get("samples_per_optimizer_step")
    return None if samples is None else Fraction(samples, clock["steps_per_optimizer_step"])


def convert_scheduler_states(
    path: Any,
    states: List[Dict[str, Any]],
    saved: Optional[Dict[str, Any]],
    now: Optional[Dict[str, Any]],
    schedulers: List[Any],
    announce: bool = True,
) -> List[Dict[str, Any]]:
    """The saved scheduler states, moved to this run's units (unchanged when the units agree)."""
    if saved is None or now is None:
        return states  # a Trainer checkpoint (one step per optimizer step) or no scheduler prepared
    _check_clock(path, saved)
    if saved == now:
        return states
    old, new = _unit(saved), _unit(now)
    if old is None or new is None:
        if saved["steps_per_optimizer_step"] == now["steps_per_optimizer_step"]:
            return states
        raise CheckpointError(
            f"{path} was saved with {saved['steps_per_optimizer_step']} scheduler step(s) per optimizer step and "
            f"this run makes {now['steps_per_optimizer_step']}, and without a prepared training DataLoader the "
            "samples a step stands for are unknown, so the learning-rate schedule cannot continue where it "
            "stopped. prepare() the training DataLoader before load_state, or resume on the same number of "
            "processes"
        )
    if old == new:
        return states
    converted = [_convert(path, state, sched, old, new, saved, now) for state, sched in zip(states, schedulers)]
    if announce:
        log.warning(
            "trainforge: %s: one learning-rate scheduler step was %s sample(s) and is %s in this run; the "
            "schedule continues at the same point (scheduler position %s -> %s)",
            path,
            old,
            new,
            [s.get("last_epoch") for s in states],
            [s.get("last_epoch") for s in converted],
        )
    return converted


def _check_clock(path: Any, clock: Any) -> None:
    """A checkpoint's clock is data from a file: anything but the fields written here is refused."""
    spc = clock.get("steps_per_optimizer_step") if isinstance(clock, dict) else None
    samples = clock.get("samples_per_optimizer_step", 0) if isinstance(clock, dict) else None
    if not (type(spc) is int and spc > 0 and (samples is None or (type(samples) is int and samples > 0))):
        raise CheckpointError(
            f"{path}: its scheduler_clock {clock!r} is not what trainforge writes ({{'steps_per_optimizer_step': "
            "int > 0, 'samples_per_optimizer_step': int > 0 or None}}); the checkpoint is damaged or was not "
            "written by trainforge. Resume from another checkpoint"
        )


def _convert(
    path: Any,
    state: Dict[str, Any],
    sched: Any,
    old_unit: Fraction,
    new_unit: Fraction,
    saved: Dict[str, Any],
    now: Dict[str, Any],
) -> Dict[str, Any]:
    inner = sched.scheduler  # a PreparedScheduler: only the Accelerator's side records a clock
    if isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return state  # driven by a metric, not by a step count
    ratio = old_unit / new_unit
    position = Fraction(state.get("last_epoch", 0)) * ratio
    if not isinstance(inner, torch.optim.lr_scheduler.LambdaLR) or position.denominator != 1:
        why = (
            f"{type(inner).__name__} keeps its lengths in the saved state"
            if not isinstance(inner, torch.optim.lr_scheduler.LambdaLR)
            else f"its position {state.get('last_epoch')} x {ratio} is not a whole step"
        )
        raise CheckpointError(
            f"{path}: its learning-rate scheduler stepped once per {old_unit} sample(s) "
            f"({saved['samples_per_optimizer_step']} samples per optimizer step, {saved['steps_per_optimizer_step']} "
            f"scheduler step(s) each) and in this run one step is {new_unit} sample(s) "
            f"({now['samples_per_optimizer_step']} / {now['steps_per_optimizer_step']}); {why}, so the schedule "
            "cannot continue exactly where it stopped. Resume with the same per-process batch size x "
            "gradient_accumulation_steps (or use a LambdaLR schedule, e.g. transformers.get_scheduler)"
        )
    converted = dict(state)
    converted["last_epoch"] = int(position)
    converted["_step_count"] = int(position) + 1
    return converted
