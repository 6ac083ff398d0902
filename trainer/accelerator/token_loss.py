"""Token-weighted loss over accumulation windows and ranks (``ItemWindow``, a part the Accelerator builds).

The default loss of the loop is the mean of micro-batch means: each micro-batch's (mean) loss is
divided by the accumulation steps and DDP averages over ranks. When micro-batches hold different
numbers of items (tokens of variable-length padded batches), that weighs an item of a short batch
more than one of a long batch, so the gradient is not the one of the whole global batch (the
accumulation bug transformers 4.46, Composer and torchtune fixed in 2024). It stays the default:
Lightning's ``training_step`` and Accelerate's ``backward`` have no item count, and their users
expect the mean of means.

Opting in: the step returns the loss **summed** over its items with their count,
``{"loss": summed_loss, "num_items": n}`` (Trainer), or calls ``accelerator.backward(summed_loss,
num_items=n)``; ``n`` is a positive int or a one-element integer tensor. The gradient of the
optimizer step is then ``sum of all items' losses / N``, N the items of the whole accumulation
window on all ranks: that of one step on the concatenated global batch with a token-mean loss.

How: the summed losses are back-propagated as they are (not divided by the accumulation steps),
the window's count is kept here, and at the window's sync step (after the backward that syncs, and
again before the Trainer's optimizer step, a no-op when done) the count is all-reduced once and the
gradients are multiplied by ``data_parallel_size / N`` (DDP and FSDP2 average over ranks: the
``Strategy.grad_reduction == "mean"`` they declare). One scalar all-reduce and one read of it per
optimizer step, nothing per micro-batch; without ``num_items`` nothing of this runs.

Why not transformers' way (pre-fetching the window's batches to count N before the first backward):
the loop would read batches ahead of the ones it trains, so a checkpoint inside a window would
record a data position past batches not yet trained, BATCH_START/END would no longer bracket the
batch being read, and the count would have to come from the batch rather than from the step that
computes the loss. Scaling after the window keeps the loop, the data position and the events as
they are, and the count comes with the loss. A checkpoint written inside a window saves this rank's
count (``Accelerator.item_window_state_dict``) with its partial gradients (``trainer/checkpoint/partial_grads.py``), so a
resume from there is bit for bit too; at window ends there is no count to save.

Refused, with a ConfigurationError at the first backward (before any optimizer step), where the
gradients cannot be rescaled exactly afterwards: DeepSpeed (the engine scales and reduces them
itself), pipeline schedules and XLA (``grad_reduction`` None).

Every rank must follow the same contract: the count's all-reduce runs only where steps give ``num_items``,
so a rank returning a plain loss while another returns ``num_items`` would leave that one waiting in it
forever. At the first sync step of several processes the ranks agree once on the contract (one all-gather
of one number, ``agree_on_contract``), and a rank that disagrees is named in a ConfigurationError on every
rank; after that each rank checks its own steps against the agreed contract (a comparison, no collective),
so a rank that switches later fails at once instead of leaving the others waiting.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy

#: The key of ``training_step``'s dict that holds the item count of a summed loss.
ITEMS_KEY = "num_items"


class ItemWindow:
    """The item count of ``strategy``'s current accumulation window: the loss the Accelerator's ``backward``
    hands to the strategy, and the gradients' rescaling at the window's sync step."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        #: Items of the current accumulation window (an int, or an integer tensor when the steps give
        #: tensors); None while no backward of this window had ``num_items``.
        self.count: Any = None
        #: Whether steps give ``num_items``, as every rank agreed at the first sync step (None: not yet).
        self.contract: Optional[bool] = None
        self._gave_items = False  # this rank, before the agreement

    def loss_to_backward(self, loss: torch.Tensor, num_items: Any, accumulation_steps: int) -> torch.Tensor:
        """A mean loss divided by the ``accumulation_steps``, or a summed one as it is (its count kept)."""
        self._follow(num_items is not None)
        if num_items is None:
            if self.count is not None:
                raise ConfigurationError(
                    "backward without num_items inside an accumulation window whose earlier micro-batches "
                    "gave num_items: return the summed loss with num_items from every step (or from none)"
                )
            if accumulation_steps > 1 and not self.strategy.handles_accumulation:
                return loss / accumulation_steps
            return loss
        count = check_num_items(num_items, self.strategy)
        self.count = count if self.count is None else self.count + count
        return loss

    def state_dict(self) -> Dict[str, Any]:
        """This rank's count of the current window (summed over the ranks only at the window's end),
        for a checkpoint written inside the window (``trainer/checkpoint/partial_grads.py``)."""
        count = self.count
        return {"items_in_window": count.detach().cpu() if isinstance(count, torch.Tensor) else count}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        count = state["items_in_window"]
        is_tensor = isinstance(count, torch.Tensor)
        self.count = count.to(self.strategy.root_device) if is_tensor else count

    def end(self, model: Optional[nn.Module], sync_gradients: bool) -> None:
        """On a sync step (``sync_gradients``), after its backward: ``model``'s gradients divided by the
        window's items on all ranks."""
        if sync_gradients and self.contract is None and self.strategy.world_size > 1:
            self.contract = agree_on_contract(self._gave_items, self.strategy)
        if self.count is None or not sync_gradients:
            return
        count, self.count = self.count, None
        if model is None:
            raise ConfigurationError("backward(loss, num_items=...) needs the model: prepare it, or pass model=")
        scale_gradients(model, count, self.strategy)

    def _follow(self, gives_items: bool) -> None:
        """This rank's step against the contract every rank agreed on (before the agreement: noted)."""
        if self.contract is None:
            self._gave_items = self._gave_items or gives_items
        elif gives_items != self.contract:
            rank, world = self.strategy.global_rank, self.strategy.world_size
            raise ConfigurationError(
                f"rank {rank} of {world}: this step {_contract_text(gives_items)}, but every rank "
                f"{_contract_text(self.contract)} at the first optimizer step; the ranks would wait for each other "
                "in the item count's all-reduce. Return num_items from every step of every rank, or from none"
            )


def _contract_text(gives_items: bool) -> str:
    return "returned a summed loss with num_items" if gives_items else "returned a loss without num_items"


def agree_on_contract(gives_items: bool, strategy: Strategy) -> bool:
    """Whether every rank's steps give ``num_items`` (one all-gather of one number), or a ConfigurationError
    naming the ranks that differ, raised on every rank."""
    flags = strategy.all_gather(torch.tensor([int(gives_items)], device=strategy.root_device)).flatten().tolist()
    if len(set(flags)) == 1:
        return bool(flags[0])
    with_items = [r for r, f in enumerate(flags) if f]
    without = [r for r, f in enumerate(flags) if not f]
    raise ConfigurationError(
        f"ranks {with_items} returned a summed loss with num_items ({{'loss': ..., 'num_items': n}}) and ranks "
        f"{without} a loss without it, in the first accumulation window: the ranks with num_items would wait "
        "forever for the others in the item count's all-reduce. Every rank must return num_items, or none "
        "(a mean loss)"
    )


def check_num_items(num_items: Any, strategy: Strategy) -> Any:
    """``num_items`` as an int or a 0-dim integer tensor, or a ConfigurationError saying what is wrong."""
    if strategy.grad_reduction != "mean":
        raise ConfigurationError(
            f"num_items (a loss summed over items, normalised by the items of the whole accumulation window "
            f"on all ranks) is not supported under strategy {strategy.name!r}: it averages or scales gradients "
            "itself, so they cannot be rescaled exactly; use strategy 'ddp', 'fsdp' or one device, or return "
            "the mean loss without num_items"
        )
    if isinstance(num_items, torch.Tensor):
        if num_items.is_floating_point() or num_items.is_complex() or num_items.dtype == torch.bool:
            raise ConfigurationError(
                f"num_items is a {num_items.dtype} tensor; it counts items: give an integer tensor "
                "(e.g. (labels != -100).sum()) or an int"
            )
        if num_items.numel() != 1:
            raise ConfigurationError(f"num_items has shape {tuple(num_items.shape)}; give one count")
        num_items = num_items.detach().reshape(())
        if num_items.device.type == "cpu" and int(num_items) <= 0:  # on a device: checked at the window's end
            raise ConfigurationError(_not_positive(int(num_items)))
        return num_items
    if isinstance(num_items, bool) or not isinstance(num_items, numbers.Integral):
        raise ConfigurationError(
            f"num_items={num_items!r} ({type(num_items).__name__}) must be an int or an integer tensor: "
            "the number of items (tokens) the summed loss adds up"
        )
    if num_items <= 0:
        raise ConfigurationError(_not_positive(int(num_items)))
    return int(num_items)


def _not_positive(n: int) -> str:
    return (
        f"num_items={n}: a summed loss needs a positive item count (return None from training_step to "
        "skip a micro-batch without items)"
    )


def scale_gradients(model: nn.Module, count: Any, strategy: Strategy) -> None:
    """Multiply ``model``'s gradients by ``data_parallel_size / N``, N = ``count`` summed over the ranks
    (one all-reduce of one number; the gradients were averaged over the ranks by the sync)."""
    if strategy.world_size > 1:
        local = torch.as_tensor(count).to(strategy.root_device, torch.int64)
        count = strategy.all_reduce(local.reshape(1), "sum")
    total = int(count)  # the step's one read of the count (a tensor on a device: its only sync)
    if total <= 0:
        raise ConfigurationError(_not_positive(total) + " (the accumulation window's total on all ranks)")
    factor = strategy.data_parallel_size / total
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(factor)
