"""Trainable-only checkpoints: the frozen base is named, not written.

A model whose base is frozen (``requires_grad=False``: a LoRA/PEFT adapter on a pretrained model, a
fine-tune of a few layers) changes only in its trainable parameters, so a checkpoint may hold just
those, their optimizer state and the buffers (which can change without gradients: running
statistics). The frozen base is the one the script builds again on resume; the checkpoint records
which one it expects (``base_record``), and ``check_base`` refuses a model whose base differs:

- the frozen parameters by name, with shape and dtype;
- a CRC32 of every one of them, over all its elements up to ``SAMPLE`` of them and, beyond, over ``SAMPLE``
  elements evenly strided through the whole tensor (so a base with another value in any tensor is refused,
  and one that differs in a single element of a big tensor may not be). A sharded DTensor contributes the
  same sampled elements: gathered whole when it has at most ``CHECKSUM_MAX_NUMEL`` elements (64 MB in
  fp32), else each rank sends the sampled elements it holds, so the value is the same on every rank whatever
  the layout and no big tensor is gathered. Computed once per tensor and process (a frozen tensor that is
  written to in place is hashed again), so saving a checkpoint at every step costs nothing more;
- the trainable parameters' names (a model without the adapter is named as such);
- the base model's name or path when the model knows it (recorded and shown, not compared: the same
  weights may come from a hub name or a local copy).

Names are the module's state-dict names (wrappers' ``_checkpoint_wrapped_module.`` and torch.compile's
``_orig_mod.`` removed), so a resume with other activation checkpointing or compile settings agrees.
"""

from __future__ import annotations

import weakref
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from trainforge.strategies.errors import CheckpointError

RECORD = "frozen_base"  # <checkpoint>/frozen_base.pt (rank 0), read with weights_only=True
CHECKSUM_MAX_NUMEL = 1 << 24
SAMPLE = 1 << 20
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def frozen_parameters(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``{state-dict name: parameter}`` of the parameters that do not require grad, in model order
    (tied parameters under each of their names)."""
    return {clean_name(n): p for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trainable_names(module: nn.Module) -> List[str]:
    return [clean_name(n) for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]


def without_frozen(state: Dict[str, Any], module: nn.Module) -> Dict[str, Any]:
    """``state`` (a state dict of ``module``) less the frozen parameters; buffers are kept."""
    frozen = frozen_parameters(module)
    return {k: v for k, v in state.items() if clean_name(k) not in frozen}


# id(tensor) -> (the tensor, (storage pointer, version), checksum): a frozen tensor is hashed once, and again
# only once written to. Keyed by id: tensors compare element by element, which a weak dictionary would do.
_known: Dict[int, Tuple[weakref.ref, Tuple[int, int], int]] = {}


def _checksum(tensor: torch.Tensor) -> int:
    """CRC32 of the elements at flat indices 0, k, 2k, ... (k = 1 up to ``SAMPLE`` elements) in their dtype's
    bytes; the same for a plain tensor and any sharding of it as a DTensor (a collective then)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    stamp = (local.data_ptr(), int(tensor._version))
    known = _known.get(id(tensor))
    if known is not None and known[0]() is tensor and known[1] == stamp:
        return known[2]
    step = -(-tensor.numel() // SAMPLE) if tensor.numel() else 1
    if hasattr(tensor, "full_tensor") and not _by_elements(tensor):
        sample = tensor.full_tensor().detach().reshape(-1)[::step]
    elif hasattr(tensor, "full_tensor"):
        sample = _sampled_elements(tensor, step)
    else:
        sample = tensor.detach().reshape(-1)[::step]
    crc = zlib.crc32(sample.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    key = id(tensor)
    _known[key] = (weakref.ref(tensor, lambda _: _known.pop(key, None)), stamp, crc)
    return crc


def _by_elements(tensor: Any) -> bool:
    """Whether a DTensor is hashed from the sampled elements each rank holds (big, sharded with plain
    ``Shard``/``Replicate`` placements over the whole world) rather than gathered whole."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    plain = all(type(p) in (Shard, Replicate) for p in tensor.placements)
    whole_world = dist.is_initialized() and tensor.device_mesh.size() == dist.get_world_size()
    return tensor.numel() > CHECKSUM_MAX_NUMEL and plain and whole_world


def _sampled_elements(tensor: Any, step: int) -> torch.Tensor:
    """The DTensor's elements at flat indices 0, step, 2 step, ... in order, on every rank: each rank finds
    those its shard holds and all ranks exchange them (nothing else is gathered)."""
    import torch.distributed as dist
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local().detach()
    flat = torch.arange(0, tensor.numel(), step, device=local.device)
    coords = torch.unravel_index(flat, tuple(tensor.shape))
    inside = torch.ones_like(flat, dtype=torch.bool)
    for c, o, n in zip(coords, offset, shape):
        inside &= (c >= o) & (c < o + n)
    values = local[tuple(c[inside] - o for c, o in zip(coords, offset))]
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (flat[inside].cpu(), values.cpu()))
    order = torch.cat([p[0] for p in parts])
    merged = torch.cat([p[1] for p in parts])
    # a replicated dimension sends an element several times: keep one of each, in index order
    unique, first = _first_of_each(order)
    if unique.numel() != flat.numel():
        raise CheckpointError(
            f"a {type(tensor).__name__} of shape {list(tensor.shape)} with placements {tensor.placements}: its shards "
            f"hold {unique.numel()} of the {flat.numel()} sampled elements; cannot checksum it"
        )
    return merged[first]


def _first_of_each(index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sorted unique values of ``index``, the position in ``index`` of one occurrence of each)."""
    order = torch.argsort(index, stable=True)
    ranked = index[order]
    keep = torch.ones_like(ranked, dtype=torch.bool)
    keep[1:] = ranked[1:] != ranked[:-1]
    return ranked[keep], order[keep]


def base_record(module: nn.Module, base_model: Optional[str] = None, adapter: Optional[str] = None) -> Dict[str, Any]:
    """What a trainable-only checkpoint of ``module`` expects of the base it resumes onto. Every
    rank calls it (a sharded frozen parameter is gathered for its checksum)."""
    frozen = frozen_parameters(module)
    return {
        "frozen": {n: [list(p.shape), str(p.dtype).replace("torch.", "")] for n, p in frozen.items()},
        "checksums": {n: _checksum(p) for n, p in frozen.items()},
        "trainable": trainable_names(module),
        "base_model": base_model,
        "adapter": adapter,
    }


def _listed(names: Sequence[str], limit: int = 3, quote: bool = True) -> str:
    names = list(names)
    shown = ", ".join(repr(n) if quote else n for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_base(path: Any, record: Any, module: nn.Module, base_model: Optional[str] = None) -> None:
    """CheckpointError naming the first difference between the base ``record`` (written with a
    trainable-only checkpoint at ``path``) and ``module``, before anything is loaded. Every rank
    calls it and reaches the same verdict (checksums are computed on full tensors)."""
    if not (isinstance(record, dict) and isinstance(record.get("frozen"), dict)):
        raise CheckpointError(f"{path}: {RECORD}.pt is not a frozen-base record; the checkpoint is damaged")
    saved_base = record.get("base_model")
    bases = f" (saved from base {saved_base!r}, this model's is {base_model!r})" if saved_base or base_model else ""
    trainable = trainable_names(module)
    params = {clean_name(n) for n, _ in module.named_parameters(remove_duplicate=False)}
    saved_trainable = list(record.get("trainable", []))
    absent = [n for n in saved_trainable if n not in params]
    if absent:
        kind = f"a {record['adapter']} adapter" if record.get("adapter") else "trainable parameters"
        raise CheckpointError(
            f"{path} holds only the trainable parameters of a model with {kind} ({len(saved_trainable)} "
            f"tensors) on a frozen base; this model has no parameter {_listed(absent)}. Build the model it was "
            "saved from before resuming: the same base wrapped with the same adapter (for PEFT: "
            "peft.get_peft_model(base, <the same LoraConfig>)), then load the checkpoint"
        )
    now_frozen = [n for n in saved_trainable if n not in set(trainable)]
    extra = [n for n in trainable if n not in set(saved_trainable)]
    if now_frozen or extra:
        detail = (
            f"{_listed(now_frozen)} trained in the checkpoint but frozen (requires_grad=False) now"
            if now_frozen
            else f"{_listed(extra)} trained now but frozen when the checkpoint was saved (not in it)"
        )
        raise CheckpointError(
            f"{path}: the trainable parameters differ: {detail}. Freeze the same parameters as the run that "
            "saved it, or start a new run from its weights"
        )
    frozen = frozen_parameters(module)
    saved = record["frozen"]
    missing = [n for n in saved if n not in frozen]
    unexpected = [n for n in frozen if n not in saved]
    changed = [
        f"{n}: {tuple(saved[n][0])} {saved[n][1]} in the checkpoint's base, "
        f"{tuple(frozen[n].shape)} {str(frozen[n].dtype).replace('torch.', '')} now"
        for n in saved
        if n in frozen
        and (list(frozen[n].shape) != list(saved[n][0]) or str(frozen[n].dtype).replace("torch.", "") != saved[n][1])
    ]
    if missing or unexpected or changed:
        parts = [
            f"{what} {_listed(items, quote=what != 'different shape or dtype:')}"
            for what, items in (
                ("frozen parameters missing now:", missing),
                ("frozen parameters it did not have:", unexpected),
                ("different shape or dtype:", changed),
            )
            if items
        ]
        raise CheckpointError(
            f"{path} was saved without its frozen base, which differs from this model's{bases}: "
            f"{'; '.join(parts)}. Build the same base (model, size, dtype) before resuming"
        )
    checksums = record.get("checksums", {})
    if not isinstance(checksums, dict) or any(n not in frozen or not isinstance(c, int) for n, c in checksums.items()):
        raise CheckpointError(
            f"{path}: {RECORD}.pt holds no valid checksums of the frozen base; the checkpoint is damaged"
        )
    differ = [n for n, crc in checksums.items() if _checksum(frozen[n]) != crc]
    if differ:
        raise CheckpointError(
            f"{path} was saved without its frozen base, and this model's base holds other weights{bases}: "
            f"the checksum of frozen parameter(s) {_listed(differ)} differs. Load the same pretrained weights "
            "(the same checkpoint, revision and dtype) before resuming, or start a new run"
        )
