"""Evaluation helpers: split inputs between processes, and drop sampler padding from gathers."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import ConfigurationError


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"world_size={world_size!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigurationError(f"rank={rank!r} is not valid for world_size={world_size}: use 0..{world_size - 1}")


def _length(inputs: Any) -> int:
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0:
            raise ConfigurationError("cannot split a 0-d tensor between processes: give it a first dimension")
        return inputs.shape[0]
    if isinstance(inputs, (list, tuple)):
        return len(inputs)
    if isinstance(inputs, dict):
        lengths = {key: _length(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigurationError(f"all values of the dict must have the same length to be split, got {lengths}")
        return next(iter(lengths.values()), 0)
    raise ConfigurationError(
        f"cannot split a {type(inputs).__name__} between processes: give a list, tuple, tensor, or a dict of them"
    )


def _take(inputs: Any, start: int, end: int, target: int) -> Any:
    if isinstance(inputs, dict):
        return {key: _take(value, start, end, target) for key, value in inputs.items()}
    part = inputs[start:end]
    missing = target - (end - start)
    if missing <= 0:
        return part
    filler = part[-1:] if end > start else inputs[-1:]  # repeat the last element
    if isinstance(inputs, torch.Tensor):
        return torch.cat([part, filler.expand(missing, *filler.shape[1:])])
    return part + type(part)(filler) * missing


def split_between_processes(inputs: Any, rank: int, world_size: int, apply_padding: bool = False) -> Any:
    """This rank's contiguous share of ``inputs`` (list, tuple, tensor on dim 0, or a dict of them).

    Like HF accelerate's: with ``len % world_size`` left over, the first ranks get one more.
    ``apply_padding`` repeats the last element so every rank gets the same length (needed before
    a gather); the duplicates are then the last element on the ranks that got one fewer.
    """
    _check_rank(rank, world_size)
    length = _length(inputs)
    per_rank, extra = divmod(length, world_size)
    start = rank * per_rank + min(rank, extra)
    end = start + per_rank + (1 if rank < extra else 0)
    target = per_rank + (1 if extra else 0) if apply_padding else end - start
    if apply_padding and length == 0:
        raise ConfigurationError("cannot pad an empty input: there is no element to repeat")
    return _take(inputs, start, end, target)


def drop_padding(gathered: Any, num_padding: int, world_size: int) -> Any:
    """Remove sampler padding from the rank-major ``all_gather`` of an epoch's LAST batch.

    ``ResumableDistributedSampler``/``DistributedSampler`` put the ``num_padding`` duplicates
    (see ``num_padding_samples``) at the end of the last batch on the last ``num_padding`` ranks;
    after a gather they sit at ``r * L + L - 1`` (``L`` = rows per rank), not at the very end.
    Works on a tensor (dim 0), a list/tuple, or a dict of them.
    """
    if not isinstance(num_padding, int) or not 0 <= num_padding < max(world_size, 1):
        raise ConfigurationError(
            f"num_padding={num_padding!r} must be in 0..{world_size - 1} "
            f"for world_size={world_size} (padding is less than one sample per rank)"
        )
    if num_padding == 0:
        return gathered
    length = _length(gathered)
    if length % world_size:
        raise ConfigurationError(
            f"a gathered batch of {length} rows cannot come from {world_size} "
            "equal per-rank batches: gather the padded last batch as is"
        )
    rows = length // world_size
    dropped = {r * rows + rows - 1 for r in range(world_size - num_padding, world_size)}
    keep = [i for i in range(length) if i not in dropped]
    return _select(gathered, keep)


def _select(inputs: Any, keep: Sequence[int]) -> Any:
    if isinstance(inputs, dict):
        return {key: _select(value, keep) for key, value in inputs.items()}
    if isinstance(inputs, torch.Tensor):
        return inputs[torch.tensor(keep, dtype=torch.long, device=inputs.device)]
    return type(inputs)(inputs[i] for i in keep)
