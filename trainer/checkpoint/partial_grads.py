"""The partial gradients of a checkpoint written inside an accumulation window.

A checkpoint can be written after micro-batch k < N of a window: ``ModelCheckpoint(train_time_interval=...)``
at any batch end, a monitor save after a validation run mid-window (``val_check_interval`` in batches),
``Accelerator.save_state()`` anywhere in a user's loop. Recording ``accumulation_step`` alone is not
enough for the resume to be the uninterrupted run bit for bit: the gradients of micro-batches 1..k
(and, for a loss summed over items, ``trainer/accelerator/token_loss.py``, the window's item count) are part of
the next optimizer step. So they are saved, and restored before the next micro-batch.

Why save them rather than re-run or drop micro-batches 1..k: re-running would need the loader to step
back (and the RNG streams of those micro-batches); dropping them changes the step. Saving is exact
and costs only inside a window: at a window boundary (every optimizer-step save, the usual case)
nothing is written and nothing read.

What is saved, per rank: ``grads_rank{r}.pt`` next to ``rng_rank{r}.pt`` (``torch.save``, read with
``weights_only=True``, listed in the manifest and verified like every other file) holding this rank's
``param.grad`` by parameter name and its item count. Per rank because under DDP each rank accumulates
locally (``no_sync``): the ranks' gradients differ until the window's sync step all-reduces them.
``trainer_state.pt`` records the world size and accumulation steps they belong to.

Refused, with an error naming the fix (save at an optimizer-step boundary):

* a save inside a window under a strategy that does not keep the window's gradients in ``param.grad``
  (``Strategy.window_grads_in_params`` False): FSDP2 accumulates unsharded gradients in its private
  per-parameter state (``FSDPParam.unsharded_accumulated_grad``) until the sync step, DeepSpeed in
  its engine, pipeline schedules per stage; nothing there can be saved through a public API;
* a load on another number of processes: one rank's partial sum cannot be split over, or merged
  into, other ranks' (the all-reduce that would combine them happens only at the window's end), and
  a load with other accumulation steps (the window would end elsewhere).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from trainforge.strategies.checkpoint.io import load_object
from trainforge.strategies.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.accelerator.accelerator import Accelerator

log = logging.getLogger("trainforge")

#: ``trainer_state.pt``'s key: present only for a checkpoint written inside an accumulation window.
STATE_KEY = "partial_gradients"


def grads_file(rank: int) -> str:
    return f"grads_rank{rank}"


def check_mid_window_save(acc: Accelerator) -> None:
    """Before anything is written: a save inside a window where the partial gradients cannot be saved
    is refused (every rank is at the same micro-batch, so every rank refuses together)."""
    if acc.step == 0 or acc.strategy.window_grads_in_params:
        return
    raise ConfigurationError(
        f"a checkpoint inside an accumulation window (after micro-batch {acc.step} of "
        f"{acc.gradient_accumulation_steps}) cannot be resumed exactly under strategy {acc.strategy.name!r}: "
        "it keeps the window's partial gradients in its own state, which cannot be saved. Save at an "
        "optimizer-step boundary (ModelCheckpoint(every_n_steps=...); Accelerator: call save_state when "
        "accelerator.sync_gradients is True, after the optimizer step)"
    )


def save_partial_gradients(acc: Accelerator, writer: Any, model: Optional[nn.Module], state: Dict[str, Any]) -> None:
    """Inside a window: write this rank's gradients and item count, and record them in ``state``
    (rank 0's ``trainer_state``). At a window boundary: nothing."""
    if acc.step == 0 or model is None:
        return
    grads = {name: p.grad.detach() for name, p in acc.unwrap_model(model).named_parameters() if p.grad is not None}
    writer.save_object(grads_file(acc.strategy.global_rank), {"grads": grads, "items": acc.item_window_state_dict()})
    state[STATE_KEY] = {"world_size": acc.strategy.world_size, "accumulation_steps": acc.gradient_accumulation_steps}


PendingGrads = Tuple[List[Tuple[nn.Parameter, Optional[torch.Tensor]]], Dict[str, Any]]


def read_partial_gradients(
    acc: Accelerator, path: Path, state: Dict[str, Any], model: Optional[nn.Module]
) -> Optional[PendingGrads]:
    """Read and check this rank's partial gradients before anything is restored; None when the
    checkpoint was written at a window boundary. ``restore_partial_gradients`` applies them."""
    saved = state.get(STATE_KEY)
    step = int(state.get("accumulation_step", 0))
    if saved is None or model is None:
        if step and model is not None and acc.strategy.is_global_zero:
            log.warning(
                "trainforge: %s was written inside an accumulation window (micro-batch %d) by an older "
                "trainforge that did not save its partial gradients; that window's optimizer step will "
                "use the gradients of its remaining micro-batches only",
                path,
                step,
            )
        return None
    strategy = acc.strategy
    old_world, old_steps = int(saved["world_size"]), int(saved["accumulation_steps"])
    where = f"{path} was written inside an accumulation window (after micro-batch {step} of {old_steps})"
    if old_world != strategy.world_size:
        raise CheckpointError(
            f"{where} on {old_world} process(es), each holding its own partial gradients, which cannot be "
            f"split or merged over {strategy.world_size}. Resume it on {old_world} process(es), or resume "
            "from a checkpoint at a window boundary (an optimizer step's, e.g. ModelCheckpoint(every_n_steps=...))"
        )
    if old_steps != acc.gradient_accumulation_steps:
        raise CheckpointError(
            f"{where}; {acc.gradient_accumulation_steps} accumulation steps are set now, so the window would end "
            f"elsewhere. Resume with {old_steps} accumulation steps, or from a checkpoint at a window boundary"
        )
    if not strategy.window_grads_in_params:
        raise ConfigurationError(
            f"{where}; strategy {strategy.name!r} keeps a window's gradients in its own state, so they cannot "
            "be restored. Resume it with strategy 'ddp' or one device, or from a checkpoint at a window boundary"
        )
    name = grads_file(strategy.global_rank)
    saved_rank = load_object(path, name)
    file = path / f"{name}.pt"
    if not isinstance(saved_rank, dict) or not isinstance(saved_rank.get("grads"), dict) or "items" not in saved_rank:
        raise CheckpointError(f"{file}: not a partial-gradients file (a dict of 'grads' and 'items'); it is corrupted")
    grads: Dict[str, Any] = saved_rank["grads"]
    params = dict(acc.unwrap_model(model).named_parameters())
    unknown = sorted(set(grads) - set(params))
    if unknown:
        raise CheckpointError(f"{file}: gradients of {unknown[:5]}, which the model does not have")
    pending: List[Tuple[nn.Parameter, Optional[torch.Tensor]]] = []
    for pname, param in params.items():
        grad = grads.get(pname)
        if grad is not None and (not isinstance(grad, torch.Tensor) or grad.shape != param.shape):
            got = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise CheckpointError(
                f"{file}: the gradient of {pname!r} has shape {got}, the parameter {tuple(param.shape)}; "
                "the checkpoint belongs to another model"
            )
        pending.append((param, grad))
    return pending, saved_rank["items"]


def restore_partial_gradients(acc: Accelerator, pending: Optional[PendingGrads]) -> None:
    """Each parameter's gradient as it was saved (None where it had none), and the window's item count."""
    if pending is None:
        return
    grads, items = pending
    with torch.no_grad():
        for param, grad in grads:
            param.grad = None if grad is None else grad.to(device=param.device, dtype=param.dtype)
    acc.load_item_window_state_dict(items)
