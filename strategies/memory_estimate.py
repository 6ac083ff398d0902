"""Per-rank memory of the model states (parameters, gradients, optimizer state) for each strategy.

The arithmetic of the ZeRO paper (Rajbhandari et al. 2020, section 3 and figure 1), with Ψ
parameters, N data-parallel ranks and K optimizer bytes per parameter:

    precision        params  grads  optimizer K (Adam)
    "32"             4       4      8   (fp32 momentum + variance)
    mixed (16/bf16)  2       2      12  (fp32 master weights + momentum + variance)

    DDP / ZeRO-0          (p + g + K) Ψ
    ZeRO-1                (p + g) Ψ + K Ψ / N           optimizer states partitioned
    ZeRO-2 = FSDP grad-op p Ψ + (g + K) Ψ / N           + gradients
    ZeRO-3 = FSDP full    (p + g + K) Ψ / N             + parameters

Offload (ZeRO-Offload / ZeRO-Infinity): ``offload_optimizer`` moves the optimizer partition and
the gradient partition it updates to CPU memory; ``offload_parameters`` (stage 3) also moves the
parameter partition. DeepSpeed's ZeRO optimizers also keep an fp32 master partition in "32"
(``master_weights=True``: 4 + 4 + 12 for Adam), which ``choose_deepspeed`` counts. "bf16-true"
keeps everything in bf16 (2 + 2 + Adam's 2 + 2). Torch AMP under DDP/FSDP keeps fp32 parameters
instead (4 + 4 + 8): the same 16 bytes in total, split differently; the rows follow the paper.
Activations, temporary buffers (ZeRO-3's gathered layer, communication buckets) and the CUDA
context are not included: ``recommend`` keeps ``headroom`` of the device free for them.

``estimate_memory`` is what ``DeepSpeedStrategy(stage="auto")`` and ``trainforge estimate-memory``
both use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError, invalid_choice

MIXED = ("16-mixed", "bf16-mixed", "fp8")
PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true", "fp8")
#: fp32 state tensors per parameter kept by the optimizer ("sgd" = SGD with momentum).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 1, "none": 0}
#: Fastest first, after the Hugging Face DeepSpeed guide ("Speed-wise: 0 > 1 > 2 > 2+offload > 3 >
#: 3+offload"); memory use falls along the same list. ``recommend`` takes the first that fits.
SPEED_ORDER = (
    "ddp",
    "zero1",
    "zero2",
    "fsdp-grad-op",
    "zero2-offload",
    "zero3",
    "fsdp-full",
    "zero3-offload",
    "zero3-offload-all",
)
DEEPSPEED_ROWS = ("zero1", "zero2", "zero2-offload", "zero3", "zero3-offload", "zero3-offload-all")
DEFAULT_HEADROOM = 0.25  # fraction of device memory left for activations and buffers


@dataclass(frozen=True)
class MemoryRow:
    """Bytes per rank for one way of training; ``strategy`` + ``options`` build it."""

    name: str
    strategy: str
    options: Dict[str, Any] = field(hash=False)
    params: int
    grads: int
    optimizer: int
    cpu: int  # offloaded bytes per rank, in host memory

    @property
    def device(self) -> int:
        """Model-state bytes on the accelerator, per rank."""
        return self.params + self.grads + self.optimizer


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once); works on the meta device."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def bytes_per_param(
    precision: str = "32", optimizer: str = "adam", master_weights: bool = False
) -> Tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter for ``precision`` and ``optimizer``.
    ``master_weights``: an fp32 master copy is kept even in "32" (DeepSpeed's ZeRO optimizers do)."""
    if precision not in PRECISIONS:
        raise invalid_choice("precision", precision, PRECISIONS)
    if optimizer not in OPTIMIZER_STATES:
        raise invalid_choice(
            "optimizer", optimizer, OPTIMIZER_STATES, "'sgd' is SGD with momentum, 'none' an optimizer without state"
        )
    states = OPTIMIZER_STATES[optimizer]
    if precision == "32":
        return 4, 4, 4 * states + (4 if master_weights else 0)
    if precision == "bf16-true":
        return 2, 2, 2 * states
    return 2, 2, 4 + 4 * states  # mixed: fp32 master weights + fp32 states


def optimizer_kind(optimizer: Any) -> str:
    """The ``OPTIMIZER_STATES`` key that describes a torch optimizer (Adam-like when unsure)."""
    name = type(getattr(optimizer, "optimizer", optimizer)).__name__.lower()
    if "sgd" in name:
        groups = getattr(optimizer, "param_groups", None) or [{}]
        return "sgd" if any(g.get("momentum", 0) for g in groups) else "none"
    return "adam"  # Adam, AdamW, Adafactor-like and unknown ones: two states is the safe guess


def estimate_memory(
    model_or_param_count: Union[nn.Module, int],
    world_size: int,
    precision: str = "32",
    optimizer: str = "adam",
    *,
    rows: Optional[Iterable[str]] = None,
    master_weights: bool = False,
) -> List[MemoryRow]:
    """Per-rank model-state bytes of every row in ``SPEED_ORDER`` (or of ``rows``), in that order.
    ``master_weights``: see ``bytes_per_param`` (the paper's fp32 rows have no master copy)."""
    psi = model_or_param_count if isinstance(model_or_param_count, int) else count_parameters(model_or_param_count)
    if isinstance(psi, bool) or psi < 0:
        raise ConfigurationError(
            f"model_or_param_count={model_or_param_count!r} must be an nn.Module or a parameter count >= 0"
        )
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigurationError(f"world_size={world_size!r} must be an int >= 1 (the number of processes)")
    p, g, k = bytes_per_param(precision, optimizer, master_weights)
    n = world_size

    def part(nbytes: int) -> int:  # one rank's partition, rounded up as DeepSpeed pads partitions
        return -(-psi * nbytes // n)

    table: Dict[str, Tuple[str, str, Dict[str, Any], int, int, int, int]] = {
        "ddp": ("DDP", "ddp", {}, psi * p, psi * g, psi * k, 0),
        "zero1": ("ZeRO-1", "deepspeed", {"stage": 1}, psi * p, psi * g, part(k), 0),
        "zero2": ("ZeRO-2", "deepspeed", {"stage": 2}, psi * p, part(g), part(k), 0),
        "fsdp-grad-op": ("FSDP grad-op", "fsdp", {"sharding_strategy": "shard_grad_op"}, psi * p, part(g), part(k), 0),
        "zero2-offload": (
            "ZeRO-2 + offload opt",
            "deepspeed",
            {"stage": 2, "offload_optimizer": True},
            psi * p,
            0,
            0,
            part(g) + part(k),
        ),
        "zero3": ("ZeRO-3", "deepspeed", {"stage": 3}, part(p), part(g), part(k), 0),
        "fsdp-full": ("FSDP full", "fsdp", {"sharding_strategy": "full_shard"}, part(p), part(g), part(k), 0),
        "zero3-offload": (
            "ZeRO-3 + offload opt",
            "deepspeed",
            {"stage": 3, "offload_optimizer": True},
            part(p),
            0,
            0,
            part(g) + part(k),
        ),
        "zero3-offload-all": (
            "ZeRO-3 + offload opt+params",
            "deepspeed",
            {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
            0,
            0,
            0,
            part(p) + part(g) + part(k),
        ),
    }
    wanted = list(rows) if rows is not None else list(SPEED_ORDER)
    unknown = [r for r in wanted if r not in table]
    if unknown:
        raise invalid_choice("rows", unknown[0], SPEED_ORDER)
    return [MemoryRow(*table[key]) for key in wanted]


def fits(
    row: MemoryRow,
    device_memory: Optional[int],
    cpu_memory: Optional[int] = None,
    ranks_per_node: int = 1,
    headroom: float = DEFAULT_HEADROOM,
) -> bool:
    """True when the row's device bytes leave ``headroom`` of ``device_memory`` free and its
    offloaded bytes (times the ranks sharing the host) fit in ``cpu_memory``. None = unknown = fits."""
    device_fits = device_memory is None or row.device <= device_memory * (1.0 - headroom)
    cpu_fits = cpu_memory is None or row.cpu * ranks_per_node <= cpu_memory * (1.0 - headroom)
    return device_fits and cpu_fits


def recommend(
    rows: Sequence[MemoryRow],
    device_memory: Optional[int],
    cpu_memory: Optional[int] = None,
    ranks_per_node: int = 1,
    headroom: float = DEFAULT_HEADROOM,
) -> Optional[MemoryRow]:
    """The first of ``rows`` (give them fastest first) that ``fits``; None when none does."""
    for row in rows:
        if fits(row, device_memory, cpu_memory, ranks_per_node, headroom):
            return row
    return None


def available_memory(device: Union[str, torch.device], ranks_per_node: int = 1) -> Tuple[int, int]:
    """(device bytes free for one rank, host bytes available to the whole node).

    CUDA: ``torch.cuda.mem_get_info`` (free bytes of this rank's GPU). CPU: psutil's available RAM
    divided by the ranks that share it (the device *is* host memory there)."""
    import psutil

    device = torch.device(device)
    host = int(psutil.virtual_memory().available)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), host
    return host // max(1, ranks_per_node), host


def format_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_table(
    rows: Sequence[MemoryRow],
    device_memory: Optional[int] = None,
    cpu_memory: Optional[int] = None,
    ranks_per_node: int = 1,
    chosen: Optional[MemoryRow] = None,
    headroom: float = DEFAULT_HEADROOM,
) -> str:
    """The rows as a fixed-width text table (per rank), with a ``fits`` column when memory is given."""
    head = ["strategy", "params", "grads", "optimizer", "device total", "cpu offload"]
    if device_memory is not None or cpu_memory is not None:
        head.append("fits")
    lines = []
    for row in rows:
        cells = [row.name, *map(format_bytes, (row.params, row.grads, row.optimizer, row.device, row.cpu))]
        if len(head) == 7:
            cells.append("yes" if fits(row, device_memory, cpu_memory, ranks_per_node, headroom) else "no")
        if chosen is not None and row.name == chosen.name:
            cells[0] = "* " + cells[0]
        lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*c) for c in lines)])


def choose_deepspeed(
    param_count: int,
    world_size: int,
    precision: str,
    optimizer: str,
    device_memory: Optional[int],
    cpu_memory: Optional[int],
    ranks_per_node: int = 1,
    headroom: float = DEFAULT_HEADROOM,
) -> Tuple[MemoryRow, str]:
    """``DeepSpeedStrategy(stage="auto")``: the fastest ZeRO row that fits, and the reasoning as
    one table. ``cpu_memory=None`` means training runs on the CPU itself, where offloading to
    the CPU gains nothing, so offload rows are not considered. With nothing fitting, the row
    using the least device memory is taken (and the text says so)."""
    estimate_precision = "bf16-mixed" if precision == "bf16-true" else precision
    names = DEEPSPEED_ROWS if cpu_memory is not None else tuple(r for r in DEEPSPEED_ROWS if "offload" not in r)
    # DeepSpeed's ZeRO optimizers keep an fp32 master partition in every precision (measured:
    # benchmarks/memory.py shows 4 + 4 + 12 bytes per parameter for fp32 Adam at one process)
    rows = estimate_memory(param_count, world_size, estimate_precision, optimizer, rows=names, master_weights=True)
    row = recommend(rows, device_memory, cpu_memory, ranks_per_node, headroom)
    verdict = f"-> {row.name}: the fastest option whose model states fit" if row is not None else ""
    if row is None:
        row = min(rows, key=lambda r: (r.device, r.cpu))
        verdict = f"-> {row.name}: nothing fits, taking the option with the least device memory (expect OOM)"
    head = (
        f"{param_count:,} parameters, {world_size} process(es), precision {precision}, optimizer {optimizer}; "
        f"free device memory per rank {format_bytes(device_memory)}, host memory {format_bytes(cpu_memory)}; "
        f"keeping {headroom:.0%} free for activations"
    )
    table = format_table(rows, device_memory, cpu_memory, ranks_per_node, chosen=row, headroom=headroom)
    return row, f"{head}\n{table}\n{verdict}"
