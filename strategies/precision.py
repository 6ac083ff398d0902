"""Numeric precision: autocast, gradient scaling, module conversion.

Names are Lightning's (``"32" "16-mixed" "bf16-mixed" "bf16-true" "fp8"``) with HF Accelerate's
aliases (``"no"``/``"fp32"``, ``"fp16"``, ``"bf16"``), since those are what users already type.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Callable, ContextManager, Dict, Optional

import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError

log = logging.getLogger("trainforge")

PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true", "fp8")
_NO_AUTOCAST = contextlib.nullcontext()
AUTOCAST_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "fp8": torch.bfloat16}
ALIASES = {
    "no": "32",
    "fp32": "32",
    "32-true": "32",
    "32": "32",
    "fp16": "16-mixed",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16-true",
    "fp8": "fp8",
}


def normalize_precision(value: Any) -> str:
    key = str(value).lower().strip()
    if key not in ALIASES:
        raise ConfigurationError(
            f"precision={value!r} is not one of: {', '.join(PRECISIONS)} "
            f"(aliases: 'no'/'fp32' -> '32', 'fp16' -> '16-mixed', 'bf16' -> 'bf16-mixed')"
        )
    return ALIASES[key]


class Precision:
    """One object per run; the strategy calls ``convert_module``, ``backward`` and ``optimizer_step``."""

    def __init__(self, precision: Any = "32", device: torch.device = torch.device("cpu")) -> None:
        self.name = normalize_precision(precision)
        self.device = torch.device(device)
        self.skipped_steps = 0  # optimizer steps skipped by the grad scaler (inf/nan gradients)
        # set by the Trainer for a fit whose module overrides ``backward`` (trainer/loop/step_hooks.py)
        self.module_backward: Optional[Callable[[torch.Tensor], None]] = None
        self.step_was_skipped = False  # the last optimizer step was one of them
        self.scaler: Optional[torch.amp.GradScaler] = None
        # Floating inputs are cast to this dtype (the parameters' own, where autocast does not reach):
        # bf16-true here; a strategy that keeps half-precision parameters sets it too (DeepSpeed).
        self.input_dtype: Optional[torch.dtype] = torch.bfloat16 if self.name == "bf16-true" else None
        if self.name == "16-mixed":
            if self.device.type == "cpu":
                raise ConfigurationError(
                    "precision='16-mixed' needs a GPU: float16 autocast with gradient scaling is not supported "
                    "on CPU. Use precision='bf16-mixed' on CPU (same memory savings, no loss scaling needed)."
                )
            self.scaler = torch.amp.GradScaler(self.device.type)
        if self.name == "fp8":
            self._check_fp8()
        self._unscaled: set = set()

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return AUTOCAST_DTYPES.get(self.name)

    def autocast(self) -> ContextManager:
        dtype = AUTOCAST_DTYPES.get(self.name)
        if dtype is None:
            return _NO_AUTOCAST  # reusable: called once per step
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def convert_module(self, module: nn.Module, fp8_all_gather: bool = False, whole_model: bool = True) -> nn.Module:
        """The module in this precision's form: bf16 parameters for bf16-true; torchao's Float8Linear
        for fp8 (``fp8_all_gather``: FSDP2 gathers those weights in fp8, torchao's
        ``enable_fsdp_float8_all_gather``). fp8 logs how many ``nn.Linear`` layers it converted and refuses
        a model where that is none (``whole_model=False``: a pipeline stage, which may hold none)."""
        if self.name == "bf16-true":
            return module.to(torch.bfloat16)
        if self.name == "fp8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # checked in _check_fp8

            linears = {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear)}
            chosen = [n for n, m in linears.items() if _fp8_filter(m, n)]
            _say_fp8_conversion(type(module).__name__, linears, chosen, whole_model)
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather)
            return convert_to_float8_training(module, config=config, module_filter_fn=_fp8_filter)
        return module

    def convert_input(self, data: Any) -> Any:
        """Floating inputs become ``input_dtype`` (when set) so they match the parameters."""
        dtype = self.input_dtype
        if dtype is None:
            return data
        from trainforge.strategies.data.utils import apply_to_tensors

        return apply_to_tensors(data, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def backward(self, loss: torch.Tensor) -> None:
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        if self.module_backward is not None:
            # the module's Lightning ``backward(loss)`` hook, given the scaled loss as in Lightning
            self.module_backward(scaled)
        else:
            scaled.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients once per step, before clipping or inspecting them."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> Any:
        if self.scaler is None:
            return optimizer.step()
        scale_before = self.scaler.get_scale()
        out = self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))
        self.step_was_skipped = self.scaler.get_scale() < scale_before  # lowered exactly when it skipped
        self.skipped_steps += int(self.step_was_skipped)
        return out

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"name": self.name, "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def _check_fp8(self) -> None:
        """fp8 runs where torch has float8 matmuls: NVIDIA GPUs of compute capability >= 8.9, and the CPU
        (slowly: a laptop runs the script a GPU run will, as every other precision does)."""
        if self.device.type not in ("cuda", "cpu") or (
            self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9)
        ):
            raise ConfigurationError(
                f"precision='fp8' needs an NVIDIA GPU with compute capability >= 8.9 (Ada/Hopper) or the CPU; "
                f"this process runs on {self.device}. Use precision='bf16-mixed' instead."
            )
        try:
            import torchao.float8  # noqa: F401
        except ImportError as exc:
            raise ConfigurationError(
                "precision='fp8' uses torchao's float8 training: pip install torchao (or trainforge[fp8])"
            ) from exc
        if self.device.type == "cpu":
            warnings.warn(
                "precision='fp8' on CPU: torchao's float8 matmuls run on the CPU, far slower than bf16; "
                "use it to check a configuration before a GPU run, precision='bf16-mixed' to train",
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"


def _say_fp8_conversion(model: str, linears: Dict[str, nn.Linear], chosen: list, whole_model: bool) -> None:
    """Log how many Linear layers fp8 converts; a ConfigurationError when a whole model gets none (it would
    train in bf16 autocast while its user believes it measured fp8)."""
    kept = [f"{n} ({m.in_features}->{m.out_features})" for n, m in linears.items() if n not in chosen]
    if not chosen and whole_model:
        what = (
            f"none of its {len(linears)} nn.Linear layer(s) qualifies: {', '.join(kept[:5])}"
            if linears
            else "it has no nn.Linear layer"
        )
        raise ConfigurationError(
            f"precision='fp8' would convert no layer of {model} to float8 ({what}); torchao's float8 matmuls need "
            "nn.Linear layers whose in_features and out_features are multiples of 16 (an lm_head stays bf16). "
            "Use precision='bf16-mixed' for this model, or layer sizes that are multiples of 16"
        )
    log.info(
        "trainforge: precision='fp8' converts %d of the %d nn.Linear layer(s) of %s to float8%s",
        len(chosen),
        len(linears),
        model,
        f"; in bf16: {', '.join(kept[:5])}{' ...' if len(kept) > 5 else ''}" if kept else "",
    )


def _fp8_filter(module: nn.Module, fqn: str) -> bool:
    """fp8 matmuls need both dims divisible by 16; keep the rest (and the output head) in bf16."""
    if not isinstance(module, nn.Linear):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0 and "lm_head" not in fqn
