"""Adapter-only checkpoints and PEFT's own format.

**Resumable checkpoints** (``save_state`` / ``ModelCheckpoint`` / ``Trainer.save_checkpoint``) take
``trainable_only``:

- ``None`` (default): trainable-only when the model holds a ``peft.PeftModel`` (LoRA and the other
  PEFT adapters) and has frozen parameters; everything otherwise.
- ``True``: any model with frozen parameters (``requires_grad=False``) is saved without them.
- ``False``: the whole model, always.

Why PEFT models only by default: a PEFT model's base is by construction a pretrained model the
script loads again (``base_model_name_or_path``), and the adapter is the product, as with
transformers' Trainer and PEFT's own ``save_pretrained``. A normal model with a few frozen layers
saves little by leaving them out, and those layers are often randomly initialised or changed by the
script (frozen after epoch k, re-initialised heads): a checkpoint that cannot be resumed without the
very same base is a worse default than a larger one, and Lightning's and Accelerate's checkpoints hold
the whole model. Either way the checkpoint records which base it expects
(``strategies/checkpoint/frozen.py``) and a resume onto another is refused by name.

**Weights for inference** (``Accelerator.save_model`` / ``Trainer.save_weights``) take
``adapter_only``: ``None`` writes PEFT's format (``adapter_model.safetensors`` and
``adapter_config.json``, loadable with ``peft.PeftModel.from_pretrained(base, directory)``) for a model
holding a ``PeftModel`` and the whole model otherwise; ``True`` insists on PEFT's format, ``False``
writes the whole model. FSDP2 shards are gathered to rank 0 one tensor at a time, frozen ones never.

``peft`` is never imported by trainforge before a model built with it exists: a ``PeftModel`` is
recognised through ``sys.modules`` (a model of that class means the user imported peft).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from torch import nn

from trainforge.strategies.checkpoint.frozen import RECORD, base_record, check_base, frozen_parameters
from trainforge.strategies.checkpoint.io import CheckpointWriter, load_object
from trainforge.strategies.errors import CheckpointError, ConfigurationError

log = logging.getLogger("trainforge")


def peft_models(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, PeftModel)`` for each ``peft.PeftModel`` in ``module`` (itself included, name "")."""
    peft = sys.modules.get("peft")
    cls = getattr(peft, "PeftModel", None)
    if cls is None:
        return []
    return [(name, m) for name, m in module.named_modules() if isinstance(m, cls)]


def base_model_name(module: nn.Module) -> Optional[str]:
    """The pretrained base's name or path when the model knows it (PEFT's config, else transformers')."""
    for _, model in peft_models(module):
        configs = cast(Dict[str, Any], model.peft_config)  # a PeftModel's {adapter name: config}
        for config in configs.values():
            if getattr(config, "base_model_name_or_path", None):
                return str(config.base_model_name_or_path)
    for sub in module.modules():
        name = getattr(getattr(sub, "config", None), "_name_or_path", None)
        if isinstance(name, str) and name:
            return name
    return None


def _check_flag(name: str, value: Any) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        raise ConfigurationError(f"{name}={value!r} must be None (decided by the model), True or False")
    return value


def trainable_only_for(strategy: Any, model: nn.Module, value: Optional[bool]) -> bool:
    """Whether a resumable checkpoint of ``model`` leaves its frozen parameters out (module docstring)."""
    _check_flag("trainable_only", value)
    unwrapped = strategy.unwrap(model)
    wanted = value if value is not None else bool(peft_models(unwrapped))
    if not wanted or not frozen_parameters(unwrapped):
        return False
    if not strategy.trainable_only_checkpoints:
        if value:
            raise ConfigurationError(
                f"trainable_only=True: strategy {strategy.name!r} writes the whole model in its checkpoints "
                "(trainable-only ones are written by the single-device, DDP and FSDP strategies); pass "
                "trainable_only=False, or train with one of those"
            )
        return False
    return True


def save_model_state(
    strategy: Any, writer: Any, model: nn.Module, optimizers: Sequence[Any], trainable_only: bool
) -> None:
    """The model and optimizer part of a resumable checkpoint: whole, or trainable-only with the
    record of the frozen base (every rank calls it)."""
    if not trainable_only:
        strategy.save_checkpoint(writer, model, optimizers)
        return
    unwrapped = strategy.unwrap(model)
    record = base_record(unwrapped, base_model_name(unwrapped), "PEFT" if peft_models(unwrapped) else None)
    strategy.save_trainable(writer, model, optimizers)
    if strategy.is_global_zero:
        writer.save_object(RECORD, record)


def load_model_state(
    strategy: Any, path: Path, meta: Dict[str, Any], model: nn.Module, optimizers: Sequence[Any]
) -> None:
    """Restore what ``save_model_state`` wrote; a trainable-only checkpoint only onto the base it
    records (``check_base``), before anything is restored."""
    if not meta.get("trainable_only"):
        strategy.load_checkpoint(path, model, optimizers)
        return
    if not strategy.trainable_only_checkpoints:
        raise CheckpointError(
            f"{path} holds only the trainable parameters (its frozen base is not in it); strategy "
            f"{strategy.name!r} cannot load such a checkpoint: resume it with the single-device, DDP or "
            "FSDP strategy"
        )
    unwrapped = strategy.unwrap(model)
    check_base(path, load_object(path, RECORD), unwrapped, base_model_name(unwrapped))
    strategy.load_trainable(path, model, optimizers)


# ---- PEFT's own format ------------------------------------------------------------------------------
def wants_adapter(strategy: Any, model: nn.Module, adapter_only: Optional[bool]) -> bool:
    _check_flag("adapter_only", adapter_only)
    found = peft_models(strategy.unwrap(model))
    if adapter_only and len(found) != 1:
        what = "holds no peft.PeftModel" if not found else f"holds {len(found)} PeftModels ({[n for n, _ in found]})"
        raise ConfigurationError(
            f"adapter_only=True: {type(strategy.unwrap(model)).__name__} {what}; PEFT's format is written for "
            "one model built with peft.get_peft_model(base, config). Pass adapter_only=False for the whole model"
        )
    return len(found) == 1 if adapter_only is None else adapter_only


def save_adapter(strategy: Any, model: nn.Module, path: os.PathLike | str) -> Path:
    """``adapter_model.safetensors`` + ``adapter_config.json`` of each adapter (the default one at the top,
    others in a sub-directory of their name, as PEFT lays them out), gathered on rank 0."""
    prefix, peft_model = peft_models(strategy.unwrap(model))[0]
    writer = CheckpointWriter(
        path, rank=strategy.global_rank, world_size=strategy.world_size, barrier=strategy.barrier, kind="weights"
    )
    weights = strategy.trainable_state_dict(model)  # rank 0; every rank takes part in the gathering
    if strategy.is_global_zero:
        from peft.utils import get_peft_model_state_dict

        start = f"{prefix}." if prefix else ""
        own = {k[len(start) :]: v for k, v in weights.items() if k.startswith(start)}
        configs = cast(Dict[str, Any], peft_model.peft_config)
        for name, config in configs.items():
            folder = "" if name == "default" else f"{name}/"
            state = get_peft_model_state_dict(peft_model, state_dict=own, adapter_name=name)
            writer.save_tensors(f"{folder}adapter_model", state)
            config = copy.deepcopy(config)
            config.inference_mode = True  # as PEFT saves it: loaded for inference unless is_trainable=True
            config.save_pretrained(str(writer.tmp_dir / folder))
            writer.track(f"{folder}adapter_config.json")
    return writer.finalize({"strategy": strategy.name, "kind": "weights", "format": "peft"}, update_latest=False)
