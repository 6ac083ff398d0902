"""ModelSummary: the table of the module's layers printed when fit starts (on rank 0), as Lightning's.

One row per submodule down to ``max_depth`` (1: the module's direct children; -1: every level; 0: no
table): name, type, parameter count and train/eval mode; then the trainable, non-trainable and total
parameter counts, the estimated size of the parameters in MB and how many submodules are in train and
eval mode. The Trainer installs one by default (``Trainer(enable_model_summary=False)`` turns it off);
pass ``ModelSummary(max_depth=N)`` in ``callbacks`` to choose the depth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple

from torch import nn

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

_UNITS = ("", "K", "M", "B", "T")


def human_count(n: int) -> str:
    """``66`` -> ``"66"``, ``1234`` -> ``"1.2 K"``, ``3_400_000`` -> ``"3.4 M"`` (Lightning's style)."""
    value, unit = float(n), 0
    while abs(value) >= 1000 and unit < len(_UNITS) - 1:
        value, unit = value / 1000, unit + 1
    return str(int(n)) if unit == 0 else f"{value:,.1f} {_UNITS[unit]}"


def _params(module: nn.Module) -> Tuple[int, int]:
    """(total, trainable) parameters, each shared parameter once."""
    seen = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() for p in seen), sum(p.numel() for p in seen if p.requires_grad)


def summary_rows(module: nn.Module, max_depth: int = 1) -> List[Tuple[str, str, str, str, str]]:
    """The table's rows: (index, name, type, parameter count, mode), one per submodule down to ``max_depth``."""
    rows: List[Tuple[str, str, str, str, str]] = []
    for name, sub in module.named_modules():
        depth = name.count(".") + 1
        if not name or (max_depth != -1 and depth > max_depth):
            continue
        rows.append((str(len(rows)), name, type(sub).__name__, human_count(_params(sub)[0]), _mode(sub)))
    return rows


def summary_totals(module: nn.Module) -> List[Tuple[str, str]]:
    """(value, label) of the lines under the table: parameter counts, size, modules in train and eval mode."""
    total, trainable = _params(module)
    size_mb = sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values()) / 1e6
    subs = [m for name, m in module.named_modules() if name]
    train = sum(m.training for m in subs)
    return [
        (human_count(trainable), "Trainable params"),
        (human_count(total - trainable), "Non-trainable params"),
        (human_count(total), "Total params"),
        (f"{size_mb:,.3f}", "Total estimated model params size (MB)"),
        (str(train), "Modules in train mode"),
        (str(len(subs) - train), "Modules in eval mode"),
    ]


def summarize(module: nn.Module, max_depth: int = 1) -> str:
    """The summary table of ``module`` as text (see the module docstring)."""
    rows = summary_rows(module, max_depth)
    header = ("", "Name", "Type", "Params", "Mode")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    line = "-" * (sum(widths) + 3 * (len(widths) - 1))
    lines = [" | ".join(c.ljust(w) for c, w in zip(header, widths)), line]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines + [line] + [f"{value:<10} {label}" for value, label in summary_totals(module)])


def _mode(module: nn.Module) -> str:
    return "train" if module.training else "eval"


class ModelSummary(Callback):
    def __init__(self, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ConfigurationError(
                f"ModelSummary(max_depth={max_depth!r}) must be an int: 1 (the module's children, the "
                "default), N levels, -1 (every level) or 0 (no table)"
            )
        self.max_depth = max_depth

    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self.max_depth != 0 and trainer.is_global_zero:
            print(summarize(module, self.max_depth), flush=True)
