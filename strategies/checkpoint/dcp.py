"""Sharded checkpoints (torch.distributed.checkpoint) of a DTensor model, shared by FSDPStrategy and
MegatronStrategy: both write ``dcp/`` inside trainforge's checkpoint directory, every rank its own
file, and both read one written by either on any layout (DCP reshards on read).

``flat`` is the optimizer form: per-parameter settings keyed by name (MegatronStrategy writes it,
since each pipeline rank's parameter groups hold other parameters and DCP would keep one rank's
``params`` lists) or torch's nested form (FSDPStrategy's default). A reader takes whichever form the
folder holds. Reading goes through ``dcp_safe`` (restricted unpickling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainforge.strategies.base import check_model_state
from trainforge.strategies.checkpoint.dcp_safe import (
    DCP_ERRORS,
    DCP_METADATA,
    flat_optimizer_state,
    load_metadata,
    safe_load,
)
from trainforge.strategies.errors import CheckpointError

DCP_DIR = "dcp"  # sub-directory of a checkpoint holding the torch.distributed.checkpoint files


def sharded_state(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], flat: bool = False, trainable_only: bool = False
) -> Dict[str, Any]:
    """``{"model": sharded state, "optimizers": {"0": ...}}``, DTensors keyed by parameter name;
    ``trainable_only``: without the frozen parameters (``checkpoint/frozen.py``)."""
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    return {
        "model": get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=trainable_only)),
        "optimizers": {
            str(i): get_optimizer_state_dict(module, opt, options=options) for i, opt in enumerate(optimizers)
        },
    }


def has_sharded(path: Any) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def save_sharded(
    writer: Any,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    flat: bool,
    trainable_only: bool = False,
) -> None:
    """Into ``writer``'s ``dcp/``: synchronously for a CheckpointWriter, with DCP's ``async_save``
    for an asynchronous save's StagingWriter (both implement ``save_sharded``)."""
    writer.save_sharded(sharded_state(module, optimizers, flat, trainable_only), DCP_DIR)


def load_sharded(
    path: Any,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    nested_ok: bool = True,
    trainable_only: bool = False,
) -> None:
    """Restore ``module`` and ``optimizers`` from ``path/dcp``. ``nested_ok=False``: the caller
    cannot take torch's nested optimizer form (pipeline stages), refused with the way out.
    ``trainable_only``: a checkpoint without the frozen parameters, which stay as they are."""
    folder = Path(path) / DCP_DIR
    flat = bool(optimizers) and flat_optimizer_state(folder)
    if optimizers and not nested_ok and not flat:
        raise CheckpointError(
            f"{folder}: its optimizer state is nested (written by FSDPStrategy), which cannot be "
            "split between pipeline stages; resume it without pipeline parallelism, or load the "
            "weights only (load_checkpoint with no optimizers / trainforge merge-weights)"
        )
    state = sharded_state(module, optimizers, flat, trainable_only)
    _check_model_shapes(path, folder, state["model"])
    try:
        safe_load(state, folder)  # restricted unpickling: a crafted .metadata executes nothing
    except CheckpointError:
        raise
    except DCP_ERRORS as e:  # CheckpointException (a BaseException) / RuntimeError: missing keys, bad files
        raise CheckpointError(
            f"{folder}: cannot load the sharded checkpoint into {type(module).__name__} "
            f"({_reason(e)}); was it saved from the same model and optimizers?"
        ) from None
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=not trainable_only))
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state["optimizers"][str(i)], options=options)


def _check_model_shapes(path: Any, folder: Path, model_state: Dict[str, Any]) -> None:
    """The saved shapes (read from ``.metadata``) against the model's, before DCP reads anything: its own
    error for a model of another shape is every rank's traceback inside one CheckpointException."""
    saved = {
        key[len("model.") :]: torch.empty(tuple(entry.size), device="meta")
        for key, entry in load_metadata(folder / DCP_METADATA).state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    expected = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    # a pipeline stage's model holds only its own layers: the others' entries are not unexpected
    check_model_state(path, expected, {k: t for k, t in saved.items() if k in expected})


def _reason(error: BaseException) -> str:
    """Each rank's error of a DCP CheckpointException (whose own text is every rank's traceback)."""
    if isinstance(error, CheckpointException):
        reasons = []
        for rank, failure in sorted(error.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            reasons.append(f"rank {rank}: {type(exc).__name__}: {str(exc).strip()[:300]}")
        return "; ".join(reasons[:2]) + (f"; and {len(reasons) - 2} more rank(s)" if len(reasons) > 2 else "")
    return f"{type(error).__name__}: {str(error).strip()[:500]}"
