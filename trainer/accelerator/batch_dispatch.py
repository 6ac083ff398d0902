"""``dispatch_batches=True``: one process reads the data, every process receives its slice.

For streams that cannot be split (a socket, a generator with side effects) or whose reading is
expensive, as Accelerate's ``DataLoaderDispatcher``: rank 0 iterates the loader, takes
``world_size`` batches (one with ``split_batches``), concatenates them along dim 0 and broadcasts
the result (first the layout: nesting, shapes and dtypes; then the tensors, on the device); rank
``r`` keeps rows ``[r * n, (r + 1) * n)``, so the rank-major gather of a step is the stream's order.

The last group (``R`` rows, not a multiple of the ranks): ``even_batches=True`` gives every rank
``ceil(R / world)`` rows, completing the group with the epoch's first rows, as Accelerate (``first_rows``,
kept in the loader's saved state so a resumed epoch pads alike); the duplicates are counted so
``gather_for_metrics`` drops them.
``even_batches=False`` gives the last ranks fewer rows, or no batch. With the loader's
``drop_last=True`` an incomplete last group is dropped. Batches hold tensors, possibly nested in
dicts, lists and tuples; anything else is refused (it cannot be split by rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from trainforge.strategies.errors import ConfigurationError


@dataclass(frozen=True)
class _Leaf:
    """A tensor's place in the layout rank 0 broadcasts."""

    index: int
    shape: Tuple[int, ...]
    dtype: str


def _layout(data: Any, tensors: List[torch.Tensor], where: str = "batch") -> Any:
    if isinstance(data, torch.Tensor):
        if data.dim() == 0:
            raise ConfigurationError(
                f"dispatch_batches=True cannot split the 0-d tensor at {where} between processes "
                "by rows: give it a batch dimension, or use dispatch_batches=False"
            )
        tensors.append(data)
        return _Leaf(len(tensors) - 1, tuple(data.shape), str(data.dtype).replace("torch.", ""))
    if isinstance(data, dict):
        return {k: _layout(v, tensors, f"{where}[{k!r}]") for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return _like(data, [_layout(v, tensors, f"{where}[{i}]") for i, v in enumerate(data)])
    raise ConfigurationError(
        f"dispatch_batches=True sends tensors (nested in dicts, lists, tuples), but {where} is a "
        f"{type(data).__name__}: turn it into a tensor in the dataset or collate_fn, or use "
        "dispatch_batches=False (every process then reads its own share)"
    )


def _rebuild(layout: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(layout, _Leaf):
        return tensors[layout.index]
    if isinstance(layout, dict):
        return {k: _rebuild(v, tensors) for k, v in layout.items()}
    return _like(layout, [_rebuild(v, tensors) for v in layout])


def _concatenate(batches: List[Any]) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        if len(batches) == 1 or first.dim() == 0:  # nothing to join (a 0-d tensor is refused by _layout)
            return first
        try:
            return torch.cat(batches, dim=0)
        except RuntimeError as e:
            raise ConfigurationError(
                "dispatch_batches=True concatenates the processes' batches, but their shapes differ "
                f"({[tuple(b.shape) for b in batches]}): pad batches to one shape, use split_batches=True (rank 0 "
                "splits one batch), or dispatch_batches=False"
            ) from e
    if isinstance(first, dict):
        return {k: _concatenate([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        return _like(first, [_concatenate(list(parts)) for parts in zip(*batches)])
    return first  # not a tensor: _layout refuses it with a clear message


class BatchDispatcher:
    """Iterates ``loader`` on rank 0 and hands each rank its slice (see the module docstring).

    ``broadcast(obj)`` is the strategy's broadcast from rank 0 (tensors in place, other objects
    pickled between our own processes). Yields ``(batch, padding, loader_state)``; the state is
    rank 0's loader position after the group this batch came from (None on other ranks)."""

    def __init__(
        self,
        loader: Any,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        broadcast: Callable[[Any], Any],
        split_batches: bool = False,
        even_batches: bool = True,
        state_of: Optional[Callable[[], Dict[str, Any]]] = None,
    ) -> None:
        self.loader, self.rank, self.world_size, self.device = loader, rank, world_size, device
        self.broadcast, self.split_batches, self.even_batches = broadcast, split_batches, even_batches
        self.drop_last = bool(getattr(loader, "drop_last", False))
        self.state_of = state_of
        #: The first ``world_size`` rows of the epoch's first group, one tensor per leaf in ``_layout``'s order
        #: (what Accelerate pads the last group with); None until this epoch's first group arrives.
        self.first_rows: Optional[List[torch.Tensor]] = None

    def __iter__(self) -> Iterator[Tuple[Any, int, Optional[Dict[str, Any]]]]:
        iterator = iter(self.loader) if self.rank == 0 else None
        world = self.world_size
        while True:
            batch, state = self._receive(iterator)
            if batch is None:
                return
            rows = _rows_of(batch)
            if self.first_rows is None:
                leaves: List[torch.Tensor] = []
                _layout(batch, leaves)
                self.first_rows = [leaf[:world].clone() for leaf in leaves]
            per = -(-rows // world)
            start = self.rank * per
            padding = 0
            if rows % world and self.even_batches:
                padding = per * world - rows
                piece = _apply(_padded(batch, self.first_rows, padding), lambda t: t[start : start + per])
            else:
                end = min(rows, start + per)
                if end <= start:
                    continue  # even_batches=False: this rank has no row of the last group
                piece = _apply(batch, lambda t: t[start:end])
            yield piece, padding, state

    def _receive(self, iterator: Optional[Iterator[Any]]) -> Tuple[Any, Optional[Dict[str, Any]]]:
        """One group, on every rank (a collective): the concatenated batch, or None at the end."""
        header, state = None, None
        tensors: List[Any] = []
        if self.rank == 0:
            assert iterator is not None, "rank 0 reads the loader"
            wanted = 1 if self.split_batches else self.world_size
            batches = []
            for _ in range(wanted):
                try:
                    batches.append(next(iterator))
                except StopIteration:
                    break
            complete = len(batches) == wanted
            if batches and (complete or not self.drop_last):
                try:  # a bad batch is reported on every rank (the others wait in the broadcast)
                    header = ("batch", _layout(_concatenate(batches), tensors))
                    rows = {t.shape[0] for t in tensors}
                    if len(rows) != 1:
                        raise ConfigurationError(
                            "dispatch_batches=True splits a batch by rows, but its tensors have different first "
                            f"dimensions {sorted(rows)}: give every tensor the batch dimension first, or use "
                            "dispatch_batches=False"
                        )
                except ConfigurationError as e:
                    header = ("error", str(e))
                state = self.state_of() if self.state_of is not None else None
        header = self.broadcast(header)
        if header is None:
            return None, None
        if header[0] == "error":
            raise ConfigurationError(header[1])
        header = header[1]
        if self.rank == 0:
            tensors = [t.to(self.device) for t in tensors]
        else:
            leaves: List[_Leaf] = []
            _collect(header, leaves)
            tensors = [
                torch.empty(leaf.shape, dtype=getattr(torch, leaf.dtype), device=self.device)
                for leaf in sorted(leaves, key=lambda leaf: leaf.index)
            ]
        tensors = [self.broadcast(t) for t in tensors]
        return _rebuild(header, tensors), state


def _padded(batch: Any, first_rows: List[torch.Tensor], padding: int) -> Any:
    """``batch`` with ``padding`` more rows, taken from the epoch's first rows (cycled when they are fewer)."""
    tensors: List[torch.Tensor] = []
    layout = _layout(batch, tensors)
    extended = []
    for tensor, first in zip(tensors, first_rows):
        index = torch.arange(padding, device=first.device) % first.shape[0]
        extended.append(torch.cat([tensor, first.index_select(0, index).to(tensor.device)]))
    return _rebuild(layout, extended)


def _collect(layout: Any, leaves: List[_Leaf]) -> None:
    if isinstance(layout, _Leaf):
        leaves.append(layout)
        return
    for value in layout.values() if isinstance(layout, dict) else layout:
        _collect(value, leaves)


def _rows_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    for value in batch.values() if isinstance(batch, dict) else batch:
        rows = _rows_of(value)
        if rows >= 0:
            return rows
    return -1


def _apply(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return {k: _apply(v, fn) for k, v in data.items()}
    return _like(data, [_apply(v, fn) for v in data])


def _like(container: Any, items: List[Any]) -> Any:
    """``items`` in ``container``'s type (a list, a tuple, a namedtuple)."""
    return type(container)(*items) if hasattr(container, "_fields") else type(container)(items)
