"""``MegatronStrategy(tensor_parallel_size="auto", pipeline_parallel_size="auto")``: the (pp, dp, tp)
layout chosen from the memory estimate of ``layout.py`` once the model is known.

``choose_auto_layout`` tabulates every layout of the world size (sizes given as ints are kept:
``tensor_parallel_size=2, pipeline_parallel_size="auto"`` only chooses pp), measures one micro-batch's
activations of the language model on the meta device (Megatron's formula when ``model_shape`` is
given for a model without a transformers config), and takes the fastest row that fits the device:
``device_memory=`` if given, else the CUDA device's total memory, else the host's RAM divided by the
processes of this node (``LOCAL_WORLD_SIZE``). Tensor parallelism stays within a node of
``LOCAL_WORLD_SIZE`` ranks. The sequence length and micro-batch size come from ``seq_len=`` /
the training loader (its ``batch_size`` and its first sample's last dimension).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from torch import nn

from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.memory_estimate import format_bytes
from trainforge.strategies.parallel.dims import ParallelDims
from trainforge.strategies.parallel.layout import (
    ModelShape,
    choose_layout,
    estimate_layouts,
    format_layouts,
    measure_activation_bytes,
)

log = logging.getLogger("trainforge")
SHAPE_KEYS = ("layers", "hidden", "heads")


def loader_shape(loader: Any) -> Tuple[Optional[int], Optional[int]]:
    """(batch size, sequence length) of a map-style loader: its ``batch_size`` and the last
    dimension of its first sample's first tensor (``input_ids`` for a dict); None where unknown."""
    import torch

    batch = getattr(loader, "batch_size", None)
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return batch, None
    try:
        sample = dataset[0]
    except Exception:
        # a dataset that cannot be indexed: seq_len= is required
        return batch, None
    if isinstance(sample, Mapping):
        sample = [sample["input_ids"]] if "input_ids" in sample else list(sample.values())
    elif torch.is_tensor(sample):
        sample = [sample]
    first = (
        next((t for t in sample if torch.is_tensor(t) and t.dim() >= 1), None)
        if isinstance(sample, (list, tuple))
        else None
    )
    return batch, (int(first.shape[-1]) if first is not None else None)


def language_model(module: nn.Module) -> Optional[nn.Module]:
    """The outermost submodule with a transformers config (the TrainingModule may hold it)."""
    for _, sub in module.named_modules():
        if (
            getattr(getattr(sub, "config", None), "num_hidden_layers", None) is not None
            or getattr(getattr(sub, "config", None), "n_layer", None) is not None
        ):
            return sub
    return None


def device_memory_per_rank(device: Any, local_world_size: int) -> Tuple[int, str]:
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory, "CUDA device total"
    import psutil

    return psutil.virtual_memory().total // max(local_world_size, 1), f"host RAM / {local_world_size} local process(es)"


def check_auto_options(seq_len: Any, device_memory: Any, model_shape: Any) -> None:
    """Types of the 'auto' settings, checked in the constructor (before any process starts)."""
    for name, value in (("seq_len", seq_len), ("device_memory", device_memory)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            unit = "tokens per sequence" if name == "seq_len" else "bytes per device"
            raise ConfigurationError(f"{name}={value!r} must be None or an int >= 1 ({unit})")
    if model_shape is not None and (
        not isinstance(model_shape, Mapping)
        or sorted(model_shape) != sorted(SHAPE_KEYS)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in model_shape.values())
    ):
        raise ConfigurationError(
            f"model_shape={model_shape!r} must be a dict of positive ints with keys "
            f"{', '.join(SHAPE_KEYS)} (transformer layers, hidden size, attention heads), "
            "e.g. {'layers': 12, 'hidden': 768, 'heads': 12}"
        )


def choose_auto_layout(
    module: nn.Module,
    sizes: Dict[str, Any],
    *,
    world_size: int,
    device: Any,
    precision: str,
    seq_len: Optional[int],
    micro_batch_size: Optional[int],
    device_memory: Optional[int],
    model_shape: Optional[Mapping[str, int]],
    schedule: str,
    num_microbatches: Optional[int],
    activation_checkpointing: bool,
    sequence_parallel: bool,
    log_table: bool,
) -> ParallelDims:
    """The fastest layout that fits; sizes given as ints restrict the table to them."""
    if seq_len is None or micro_batch_size is None:
        raise ConfigurationError(
            f"tensor_parallel_size={sizes['tp']!r}, pipeline_parallel_size={sizes['pp']!r} chooses the layout from "
            f"the activation memory of one micro-batch, but its sequence length ({seq_len}) / batch size "
            f"({micro_batch_size}) is unknown (no map-style training loader seen yet); pass "
            "MegatronStrategy(..., seq_len=TOKENS) and prepare the model together with its training loader "
            "(or give the sizes as ints)"
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    params = sum(p.numel() for p in module.parameters())
    model, measured = language_model(module), None
    if model_shape is not None:
        shape = ModelShape(params, model_shape["layers"], model_shape["hidden"], model_shape["heads"])
    elif model is None:
        raise ConfigurationError(
            f"tensor/pipeline_parallel_size='auto' needs the model's shape: {type(module).__name__} holds no "
            "transformers model (with a config); pass MegatronStrategy(..., model_shape={'layers': L, 'hidden': H, "
            "'heads': A}) to use Megatron's activation formula, or give the sizes as ints"
        )
    else:
        shape = ModelShape.of(model, params)
    micro = max(micro_batch_size // (num_microbatches or 1), 1)
    if model is not None and model_shape is None:
        measured = measure_activation_bytes(model, seq_len, micro, precision)
    rows = estimate_layouts(
        shape,
        world_size,
        seq_len=seq_len,
        micro_batch_size=micro,
        num_microbatches=num_microbatches,
        precision=precision,
        ranks_per_node=local,
        schedule=schedule,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=activation_checkpointing,
        measured_activations=measured,
    )
    rows = [r for r in rows if all(sizes[k] == "auto" or sizes[k] == getattr(r, k) for k in ("tp", "pp", "dp"))]
    if not rows:
        raise ConfigurationError(
            f"no (pp, dp, tp) layout of world_size={world_size} matches the sizes given "
            f"(tp={sizes['tp']!r}, pp={sizes['pp']!r}, dp={sizes['dp']!r}) for a model of "
            f"{shape.layers} layers and {shape.heads} heads on {local} rank(s) per node"
        )
    source = "given"
    if device_memory is None:
        device_memory, source = device_memory_per_rank(device, local)
    chosen = choose_layout(rows, device_memory)
    if log_table:
        log.info(
            "trainforge: megatron 'auto' layout for %s (%d parameters), micro-batch %d x %d tokens, precision "
            "%s, device memory %s (%s):\n%s",
            type(model or module).__name__,
            params,
            micro,
            seq_len,
            precision,
            format_bytes(device_memory),
            source,
            format_layouts(rows, device_memory, chosen),
        )
    return ParallelDims.resolve(tp=chosen.tp, pp=chosen.pp, dp=chosen.dp, world_size=world_size)
