"""Per-rank memory of every (pp, dp, tp) layout of one model, activations included, and the layout
``MegatronStrategy(tensor_parallel_size="auto", pipeline_parallel_size="auto")`` picks from them.

Model states (parameters, gradients, optimizer) use ``strategies/memory_estimate.bytes_per_param``:
tensor and pipeline parallelism split them over ``tp x pp`` ranks, and FSDP2 on the ``dp`` dimension
shards each replica's part again over ``dp`` (ZeRO-3). Activations follow Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4), per transformer layer
and micro-batch of ``b`` sequences of ``s`` tokens, hidden size ``h`` and ``a`` heads, in bytes for
16-bit activations (doubled for fp32):

    no parallelism                 s*b*h * (34 + 5*a*s/h)
    tensor parallel t              s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallel t   s*b*h * (34 + 5*a*s/h) / t

The ``5*a*s/h`` terms are the stored ``s x s`` attention scores: fused attention (torch SDPA's
flash/memory-efficient kernels, transformers' default "sdpa") stores none, so they count only with
``eager_attention=True``.

With a pipeline of ``p`` stages under 1F1B the first stage holds ``p`` micro-batches of its ``L/p``
layers (the whole model's ``L`` layers' worth, section 4.2.3); GPipe holds every micro-batch of
the step (``m * L/p``). Activation checkpointing keeps one ``s*b*h`` input per layer instead
(2 bytes each) plus one layer's full activations. Embeddings, logits and buffers are not counted:
``choose_layout`` keeps ``headroom`` of the device free for them, as ``recommend`` does.

Order of preference (fastest first, as Megatron's guidance): the fewest model-parallel ranks
(``tp x pp``); among equals, the smaller pipeline (bubbles) and tensor parallelism within a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.memory_estimate import DEFAULT_HEADROOM, bytes_per_param, format_bytes

PIPELINE_MEMORY = {"1f1b": "first stage holds pp micro-batches", "gpipe": "holds every micro-batch"}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of a transformer."""

    params: int
    layers: int
    hidden: int
    heads: int

    @classmethod
    def of(cls, model: Any, params: int) -> ModelShape:
        """From a transformers config (``num_hidden_layers``/``n_layer``, ``hidden_size``/``n_embd``,
        ``num_attention_heads``/``n_head``); a plain model needs them given (``ModelShape(...)``)."""
        config = getattr(model, "config", None)

        def first(*names: str) -> Optional[int]:
            for name in names:
                value = getattr(config, name, None)
                if isinstance(value, int) and value > 0:
                    return value
            return None

        layers = first("num_hidden_layers", "n_layer", "num_layers")
        hidden = first("hidden_size", "n_embd", "d_model")
        heads = first("num_attention_heads", "n_head", "num_heads")
        if layers is None or hidden is None or heads is None:
            raise ConfigurationError(
                f"{type(model).__name__} has no transformers config giving its layers, hidden size and heads; "
                "pass them: ModelShape(params=..., layers=..., hidden=..., heads=...)"
            )
        return cls(params, layers, hidden, heads)


@dataclass(frozen=True)
class LayoutRow:
    pp: int
    dp: int
    tp: int
    states: int  # parameters + gradients + optimizer, bytes per rank
    activations: int  # peak activation bytes per rank (first pipeline stage)

    @property
    def total(self) -> int:
        return self.states + self.activations

    @property
    def name(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp}"


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layer_activation_bytes(
    shape: ModelShape, seq_len: int, micro_batch: int, precision: str, eager_attention: bool = False
) -> float:
    """Megatron's formula for one layer and one micro-batch, no parallelism (see the module docstring)."""
    s, b, h = seq_len, micro_batch, shape.hidden
    a = shape.heads if eager_attention else 0
    return s * b * h * (34 + 5 * a * s / h) * (2 if precision == "32" else 1)


def measure_activation_bytes(
    model: Any, seq_len: int, micro_batch_size: int, precision: str = "32", eager_attention: bool = False
) -> int:
    """Bytes autograd saves for one forward of a language model on one micro-batch of token ids,
    measured on the meta device (nothing allocated; every saved tensor counted once, views by their
    base). Embeddings and logits included. 16-bit precisions run the model in bf16 (autocast keeps
    some ops in fp32: a slight underestimate). On meta, SDPA takes its math path, which saves the
    ``(..., s, s)`` attention scores; the fused kernels used on GPUs do not, so such tensors are left
    out unless ``eager_attention``."""
    import copy

    import torch

    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise ConfigurationError(
            f"{type(model).__name__} has no config.vocab_size: activations are measured for "
            "language models fed token ids; give --layers/--hidden/--heads for the formula"
        )
    meta = copy.deepcopy(model).to("meta").train()
    if precision != "32":
        meta = meta.to(torch.bfloat16)
    kept: Dict[int, Any] = {}

    def pack(t: Any) -> Any:
        base = t._base if t._base is not None else t
        if eager_attention or tuple(base.shape[-2:]) != (seq_len, seq_len):
            kept.setdefault(id(base), base)
        return t

    ids = torch.randint(0, vocab, (micro_batch_size, seq_len), device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            meta(ids)
    except Exception as e:
        raise ConfigurationError(
            f"{type(model).__name__}(token ids) failed on the meta device ({type(e).__name__}: "
            f"{str(e)[:200]}); give --layers/--hidden/--heads to use the formula"
        ) from None
    return sum(t.numel() * t.element_size() for t in kept.values())


def _tp_share(tp: int, sequence_parallel: bool) -> float:
    """The part of a layer's activations one tensor-parallel rank keeps (Megatron: 10 of the 34
    s*b*h terms stay whole without sequence parallelism)."""
    return 1 / tp if sequence_parallel or tp == 1 else (10 + 24 / tp) / 34


def estimate_layouts(
    shape: ModelShape,
    world_size: int,
    *,
    seq_len: int,
    micro_batch_size: int = 1,
    num_microbatches: Optional[int] = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adam",
    ranks_per_node: Optional[int] = None,
    schedule: str = "1f1b",
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    eager_attention: bool = False,
    measured_activations: Optional[int] = None,
) -> List[LayoutRow]:
    """Every layout of ``world_size`` processes this model allows (tp divides the heads and a
    node's ranks, pp at most the layers), fastest first. ``measured_activations``: one
    micro-batch's bytes for the whole model (``measure_activation_bytes``); else the formula."""
    for name, value in (("world_size", world_size), ("seq_len", seq_len), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name}={value!r} must be an int >= 1")
    if schedule not in PIPELINE_MEMORY:
        schedule = "1f1b"  # interleaved and zero-bubble schedules hold about what 1F1B holds
    node = ranks_per_node or min(world_size, 8)
    p_, g_, k_ = bytes_per_param(precision, optimizer)
    whole = (
        measured_activations
        if measured_activations is not None
        else shape.layers * layer_activation_bytes(shape, seq_len, micro_batch_size, precision, eager_attention)
    )
    boundary = seq_len * micro_batch_size * shape.hidden * (4 if precision == "32" else 2)  # one layer's input
    rows = []
    for tp in _divisors(world_size):
        if tp > node or node % tp or shape.heads % tp:
            continue  # tensor parallelism stays within a node and splits whole heads
        for pp in _divisors(world_size // tp):
            if pp > shape.layers:
                continue
            dp = world_size // (tp * pp)
            states = -(-shape.params * (p_ + g_ + k_) // (tp * pp * dp))
            layers = -(-shape.layers // pp)
            stage = whole * _tp_share(tp, sequence_parallel) * layers / shape.layers  # one micro-batch, one stage
            if activation_checkpointing:  # each layer keeps its input; one layer's full set during recompute
                stage, peak = layers * boundary / (tp if sequence_parallel else 1), stage / layers
            else:
                peak = 0.0
            in_flight = 1 if pp == 1 else (num_microbatches or pp) if schedule == "gpipe" else pp
            rows.append(LayoutRow(pp, dp, tp, int(states), int(stage * in_flight + peak)))
    return sorted(rows, key=lambda r: (r.tp * r.pp, r.pp, r.tp))


def choose_layout(rows: Sequence[LayoutRow], device_memory: int, headroom: float = DEFAULT_HEADROOM) -> LayoutRow:
    """The first (fastest) row whose bytes leave ``headroom`` of the device free; a clear error
    with the table when none does."""
    budget = device_memory * (1.0 - headroom)
    for row in rows:
        if row.total <= budget:
            return row
    raise ConfigurationError(
        f"no (pp, dp, tp) layout fits {format_bytes(int(budget))} per device (of {format_bytes(device_memory)}, "
        f"{headroom:.0%} kept free):\n{format_layouts(rows, device_memory)}\nuse more processes, a smaller "
        "micro-batch or sequence, activation_checkpointing=True, or a lower precision"
    )


def format_layouts(
    rows: Sequence[LayoutRow], device_memory: Optional[int] = None, chosen: Optional[LayoutRow] = None
) -> str:
    lines = [f"{'layout':<24}{'model states':>14}{'activations':>14}{'total':>12}{'fits':>6}"]
    for row in rows:
        fit = "" if device_memory is None else ("yes" if row.total <= device_memory * (1 - DEFAULT_HEADROOM) else "no")
        mark = "  <- chosen" if row == chosen else ""
        lines.append(
            f"{row.name:<24}{format_bytes(row.states):>14}{format_bytes(row.activations):>14}"
            f"{format_bytes(row.total):>12}{fit:>6}{mark}"
        )
    return "\n".join(lines)


def layout_sizes(row: LayoutRow) -> Dict[str, int]:
    return {"tp": row.tp, "pp": row.pp, "dp": row.dp}
