"""Accelerate's collectives, a part the Accelerator builds on its strategy and gradient state: gather
(with ``gather_for_metrics`` dropping the duplicates even sharding added), reduce, broadcast, padding.
Each is one call to the strategy's collectives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainforge.strategies.data.utils import apply_to_tensors

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy
    from trainforge.trainer.accelerator.wrappers import GradientState


class Collectives:
    """The collectives over ``strategy``'s processes; ``gradient_state`` says where a prepared loader's
    padding sits (what ``gather_for_metrics`` drops)."""

    def __init__(self, strategy: Strategy, gradient_state: GradientState) -> None:
        self.strategy, self.gradient_state = strategy, gradient_state

    def gather(self, data: Any) -> Any:
        """Tensors (nested in dicts/lists) from every process, concatenated along dim 0."""
        return apply_to_tensors(data, self._gather_one)

    def _gather_one(self, tensor: torch.Tensor) -> torch.Tensor:
        stacked = self.strategy.all_gather(tensor)
        return stacked if tensor.dim() == 0 else stacked.reshape(-1, *tensor.shape[1:])

    def gather_for_metrics(self, data: Any) -> Any:
        """Like ``gather`` but drops the duplicates that even sharding added on the last batch, so
        every sample of the dataset is counted exactly once. Outside a prepared loader's loop it is
        a plain ``gather`` (as in Accelerate)."""
        state = self.gradient_state
        if not (state.end_of_dataloader and state.active_dataloaders):
            return self.gather(data)
        if state.remainder > 0 and state.padding_order == "strided":  # Accelerate: the last batch's samples
            return apply_to_tensors(data, lambda tensor: self._gather_last(tensor, state.remainder))
        if not state.padding:
            return self.gather(data)
        keep_until = -state.padding
        if state.padding_order == "contiguous":  # a split stream or dispatched batches: the tail of the gather
            return apply_to_tensors(data, lambda tensor: self._gather_one(tensor)[:keep_until])
        # strided: the padding is the tail of the global order
        return apply_to_tensors(data, lambda tensor: self._gather_last(tensor, keep_until))

    def _gather_last(self, tensor: torch.Tensor, keep: int) -> torch.Tensor:
        """The last batch in global order (row j of rank r at j*W + r), sliced ``[:keep]`` (a scalar:
        the per-rank values)."""
        stacked = self.strategy.all_gather(tensor)  # [W, b, ...]; row j of rank r is global j*W + r
        if tensor.dim() == 0:
            return stacked[:keep]
        return stacked.transpose(0, 1).reshape(-1, *tensor.shape[1:])[:keep]

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        return apply_to_tensors(data, lambda t: self.strategy.all_reduce(t, reduction))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.strategy.broadcast(obj, src)

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size on any process (so they can be gathered)."""

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() == 0:
                return tensor
            size = torch.tensor(tensor.shape[dim], device=self.strategy.root_device)
            longest = int(self.strategy.all_reduce(size, "max"))
            if longest == tensor.shape[dim]:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = longest - tensor.shape[dim]
            filler = tensor.new_full(shape, pad_index)
            return torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=dim)

        return apply_to_tensors(data, pad)
