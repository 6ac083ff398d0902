"""Trainable-only checkpoints: the frozen base is named, not written.

A model whose base is frozen (``requires_grad=False``: a LoRA/PEFT adapter on a pretrained model, a
fine-tune of a few layers) changes only in its trainable parameters, so a checkpoint may hold just
those, their optimizer state and the buffers (which can change without gradients: running
statistics). The frozen base is the one the script builds again on resume; the checkpoint records
which one it expects (``base_record``), and ``check_base`` refuses a model whose base differs:

- the frozen parameters by name, with shape and dtype;
- a CRC32 of up to ``CHECKSUMS`` of them (evenly spaced in the model's order among those of at most
  ``CHECKSUM_MAX_NUMEL`` elements, so that a sharded DTensor gathered whole for it costs at most 64 MB
  in fp32: a 70B Llama's k/v projections and norms, not its embedding), each over at most ``SAMPLE``
  evenly strided elements; gathered whole, the value is the same on every rank whatever the layout;
- the trainable parameters' names (a model without the adapter is named as such);
- the base model's name or path when the model knows it (recorded and shown, not compared: the same
  weights may come from a hub name or a local copy).

Names are the module's state-dict names (wrappers' ``_checkpoint_wrapped_module.`` and torch.compile's
``_orig_mod.`` removed), so a resume with other activation checkpointing or compile settings agrees.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from trainforge.strategies.errors import CheckpointError

RECORD = "frozen_base"  # <checkpoint>/frozen_base.pt (rank 0), read with weights_only=True
CHECKSUMS = 4
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


def _checksum(tensor: torch.Tensor) -> int:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor: collective
    flat = full.detach().reshape(-1)
    if flat.numel() > SAMPLE:
        flat = flat[:: -(-flat.numel() // SAMPLE)]
    data = flat.to("cpu").contiguous().view(torch.uint8)
    return zlib.crc32(data.numpy().tobytes())


def _sampled(frozen: Dict[str, torch.Tensor]) -> List[str]:
    names = [n for n, p in frozen.items() if p.numel() <= CHECKSUM_MAX_NUMEL]
    if not names:  # every frozen tensor is big: the smallest ones
        names = sorted(frozen, key=lambda n: frozen[n].numel())[:CHECKSUMS]
    if len(names) <= CHECKSUMS:
        return list(names)
    return [names[round(i * (len(names) - 1) / (CHECKSUMS - 1))] for i in range(CHECKSUMS)]


def base_record(module: nn.Module, base_model: Optional[str] = None, adapter: Optional[str] = None) -> Dict[str, Any]:
    """What a trainable-only checkpoint of ``module`` expects of the base it resumes onto. Every
    rank calls it (a sharded frozen parameter is gathered for its checksum)."""
    frozen = frozen_parameters(module)
    return {
        "frozen": {n: [list(p.shape), str(p.dtype).replace("torch.", "")] for n, p in frozen.items()},
        "checksums": {n: _checksum(frozen[n]) for n in _sampled(frozen)},
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
    differ = [n for n, crc in record.get("checksums", {}).items() if _checksum(frozen[n]) != crc]
    if differ:
        raise CheckpointError(
            f"{path} was saved without its frozen base, and this model's base holds other weights{bases}: "
            f"the checksum of frozen parameter(s) {_listed(differ)} differs. Load the same pretrained weights "
            "(the same checkpoint, revision and dtype) before resuming, or start a new run"
        )
