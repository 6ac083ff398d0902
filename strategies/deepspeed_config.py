"""The DeepSpeed config, generated from the Trainer's settings and merged with the user's.

Users need no JSON: ``generate_config`` writes every key trainforge knows (batch sizes,
accumulation, clipping, precision, ZeRO stage and offload). A user config (dict or JSON file)
overrides any key; its ``"auto"`` values are filled in from the generated config (as in Hugging
Face's integration). A user value that contradicts an explicit trainforge setting is an error
naming both, because DeepSpeed would silently train differently from what the Trainer's loop
does (e.g. a different accumulation divides the loss by the wrong number)::

    settings = TrainingSettings(micro_batch_size=8, accumulation_steps=4, world_size=2,
                                gradient_clip_val=1.0, precision="bf16-mixed")
    generated = generate_config(settings, ZeroSettings(stage=3))
    config = merge_config(generated, load_user_config("ds.json"), explicit_settings(settings, zero, zero_given))
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

from trainforge.strategies.errors import ConfigurationError, invalid_choice

OFFLOAD_DEVICES = ("cpu", "nvme")
SUPPORTED_PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true")
DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)
QUIET_STEPS = 2**31 - 1  # steps_per_print: DeepSpeed's own progress lines are replaced by our loggers
# Keys Hugging Face configs set to "auto" that depend on the model's hidden size (HF's formulas).
_HIDDEN_SIZE_KEYS = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


@dataclass(frozen=True)
class TrainingSettings:
    """What the Trainer/Accelerator decided; ``None`` = not set by the user."""

    micro_batch_size: Optional[int] = None  # per rank, from the training DataLoader
    accumulation_steps: int = 1
    world_size: int = 1
    gradient_clip_val: Optional[float] = None
    precision: str = "32"


@dataclass(frozen=True)
class ZeroSettings:
    """The strategy's own choices (constructor arguments)."""

    stage: int = 2
    offload_optimizer_device: Optional[str] = None  # None: no offload; else "cpu" | "nvme"
    offload_param_device: Optional[str] = None
    nvme_path: str = "/local_nvme"


@dataclass(frozen=True)
class Explicit:
    """A config value fixed by a trainforge setting: its ``label`` ("the Trainer's
    accumulate_grad_batches") and ``setting`` value, and how to change it."""

    value: Any
    label: str
    setting: Any
    fix: str


def _offload(device: str, nvme_path: str) -> Dict[str, Any]:
    section: Dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def precision_sections(precision: str) -> Dict[str, Dict[str, Any]]:
    """fp16/bf16 sections for a trainforge precision name. "bf16-true" maps to DeepSpeed's bf16
    mode too: DeepSpeed always keeps fp32 master weights in its optimizer."""
    if precision not in SUPPORTED_PRECISIONS:
        raise invalid_choice(
            "precision (with strategy='deepspeed')",
            precision,
            SUPPORTED_PRECISIONS,
            "DeepSpeed has no fp8 training mode here; use precision='bf16-mixed'",
        )
    fp16: Dict[str, Any] = {"enabled": precision == "16-mixed"}
    if fp16["enabled"]:  # dynamic loss scaling, DeepSpeed's documented defaults
        fp16.update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    return {"fp16": fp16, "bf16": {"enabled": precision in ("bf16-mixed", "bf16-true")}}


def generate_config(
    settings: TrainingSettings, zero: ZeroSettings, param_count: Optional[int] = None
) -> Dict[str, Any]:
    """The complete DeepSpeed config for these settings (no user input involved). With
    ``param_count``, the gradient reduction bucket (DeepSpeed allocates it whole: 5e8 elements by
    default) is capped at the model's size: every gradient still fits in one bucket, so the
    communication is unchanged and a small model does not pay gigabytes for it."""
    micro = settings.micro_batch_size or 1  # unknown: DeepSpeed only uses it to count samples
    zero_section: Dict[str, Any] = {"stage": zero.stage}
    if param_count is not None and zero.stage > 0:
        zero_section["reduce_bucket_size"] = max(1, min(DEFAULT_BUCKET, param_count))
    if zero.offload_optimizer_device is not None:
        zero_section["offload_optimizer"] = _offload(zero.offload_optimizer_device, zero.nvme_path)
    if zero.offload_param_device is not None:
        zero_section["offload_param"] = _offload(zero.offload_param_device, zero.nvme_path)
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": settings.accumulation_steps,
        "train_batch_size": micro * settings.accumulation_steps * settings.world_size,
        "gradient_clipping": float(settings.gradient_clip_val or 0.0),  # 0.0: DeepSpeed does not clip
        **precision_sections(settings.precision),
        "zero_optimization": zero_section,
        # The optimizer is the user's torch optimizer (configure_optimizers / prepare): let ZeRO wrap
        # any of them, and let offload run torch's optimizer on CPU instead of requiring
        # DeepSpeedCPUAdam (a C++ op compiled at first use).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": QUIET_STEPS,
        "wall_clock_breakdown": False,
    }
    return config


def explicit_settings(
    settings: TrainingSettings, zero: ZeroSettings, zero_given: Tuple[str, ...] = ()
) -> Dict[str, Explicit]:
    """Dotted config keys whose values trainforge settings fix. ``zero_given`` names the
    ZeroSettings fields the user passed explicitly (the others are defaults a config may override)."""
    out: Dict[str, Explicit] = {
        "gradient_accumulation_steps": Explicit(
            settings.accumulation_steps,
            "the Trainer's accumulate_grad_batches (Accelerator: gradient_accumulation_steps)",
            settings.accumulation_steps,
            'set accumulate_grad_batches to the value you want and write "auto" in the config',
        ),
    }
    sections = precision_sections(settings.precision)
    for name in ("fp16", "bf16"):
        out[f"{name}.enabled"] = Explicit(
            sections[name]["enabled"],
            "precision",
            settings.precision,
            "pass the precision you want to the Trainer/Accelerator (e.g. "
            "precision='bf16-mixed') and write \"auto\" in the config",
        )
    if settings.micro_batch_size is not None:
        fix = 'change the DataLoader\'s batch_size (per process) and write "auto" in the config'
        out["train_micro_batch_size_per_gpu"] = Explicit(
            settings.micro_batch_size, "the DataLoader's batch_size", settings.micro_batch_size, fix
        )
        total = settings.micro_batch_size * settings.accumulation_steps * settings.world_size
        out["train_batch_size"] = Explicit(
            total,
            "batch_size x accumulation x processes",
            f"{settings.micro_batch_size} x {settings.accumulation_steps} x {settings.world_size}",
            fix,
        )
    if settings.gradient_clip_val is not None:
        out["gradient_clipping"] = Explicit(
            float(settings.gradient_clip_val),
            "the Trainer's gradient_clip_val",
            settings.gradient_clip_val,
            'set gradient_clip_val to the value you want and write "auto"',
        )
    zero_keys = {
        "stage": ("zero_optimization.stage", zero.stage),
        "offload_optimizer_device": ("zero_optimization.offload_optimizer.device", zero.offload_optimizer_device),
        "offload_param_device": ("zero_optimization.offload_param.device", zero.offload_param_device),
    }
    for field_name in zero_given:
        if field_name in zero_keys and zero_keys[field_name][1] is not None:
            key, value = zero_keys[field_name]
            out[key] = Explicit(
                value,
                f"DeepSpeedStrategy({field_name}=...)",
                value,
                f"pass the value you want to DeepSpeedStrategy or remove {key} from the config",
            )
    return out


def load_user_config(config: Union[None, str, os.PathLike[str], Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """A deep copy of a dict config, or the parsed JSON file at ``config``; None stays None."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, Path)):
        raise ConfigurationError(f"config={config!r} must be a dict, a path to a DeepSpeed JSON file, or None")
    path = Path(config)
    if not path.is_file():
        raise ConfigurationError(
            f"config={str(config)!r}: no such DeepSpeed config file; give the path of a JSON "
            "file, a dict, or None to use the generated config"
        )
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigurationError(f"config={str(config)!r} is not valid JSON ({e}); fix the file") from None
    if not isinstance(loaded, dict):
        raise ConfigurationError(
            f"config={str(config)!r} holds a {type(loaded).__name__}; a DeepSpeed config is a JSON object"
        )
    return loaded


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def _get(tree: Mapping[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return KeyError
        node = node[part]
    return node


def _set(tree: Dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = copy.deepcopy(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _sections_auto(auto: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"optimizer.params.lr": 1e-3}`` as nested sections, where "auto" values of the user's are looked up."""
    sections: Dict[str, Any] = {}
    for path, value in auto.items():
        _set(sections, path, value)
    return sections


def merge_config(
    generated: Mapping[str, Any],
    user: Optional[Mapping[str, Any]],
    explicit: Mapping[str, Explicit],
    hidden_size: Optional[int] = None,
    optimizer_auto: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """``generated`` overridden by ``user``; "auto" filled from ``generated`` (or from
    ``hidden_size`` for the bucket sizes; dropped when it is unknown); conflicts raise. The user's
    ``optimizer``/``scheduler`` sections are taken only when DeepSpeed builds the optimizer from them
    (``optimizer_auto`` not None: Accelerate's ``DummyOptim``), their "auto" values from ``optimizer_auto``."""
    merged = copy.deepcopy(dict(generated))
    for key in ("optimizer", "scheduler"):
        if user and key in user and optimizer_auto is None:
            raise ConfigurationError(
                f"the DeepSpeed config has an {key!r} section, but trainforge hands DeepSpeed the optimizer and "
                f"scheduler you create (configure_optimizers / prepare); remove {key!r} from the config and create "
                "that optimizer/scheduler in code (deepspeed.ops.adam.DeepSpeedCPUAdam is a torch optimizer too), "
                "or, with the Accelerator, prepare trainforge.utils.DummyOptim / DummyScheduler to let DeepSpeed "
                "build them from the config"
            )
    sections = _sections_auto(optimizer_auto or {})
    if user and _get(user, "checkpoint.load_universal") is True:
        raise ConfigurationError(
            "checkpoint.load_universal=True in the DeepSpeed config makes DeepSpeed read "
            "checkpoint files with torch.load(weights_only=False), which trainforge refuses; "
            "remove it (trainforge checkpoints resume on the same number of processes)"
        )
    for path, value in _leaves(user or {}):
        if value == "auto" and _get(sections, path) is not KeyError:
            _set(merged, path, _get(sections, path))  # the DummyOptim's / DummyScheduler's value
            continue
        if value == "auto":
            if path in _HIDDEN_SIZE_KEYS:
                if hidden_size:
                    _set(merged, path, _HIDDEN_SIZE_KEYS[path](hidden_size))
                continue  # unknown hidden size: leave DeepSpeed's default
            filled = _get(generated, path)
            if filled is KeyError:
                raise ConfigurationError(
                    f'the DeepSpeed config sets {path}="auto", which trainforge cannot fill in '
                    "(no trainforge setting decides it); give a value or remove the key"
                )
            continue  # the generated value is already in ``merged``
        if isinstance(value, Mapping) and _get(merged, path) is not KeyError:
            continue  # an empty section adds nothing to the generated one
        rule = explicit.get(path)
        if rule is not None and not _same(value, rule.value):
            raise ConfigurationError(
                f"the DeepSpeed config sets {path}={value!r}, but {rule.label}={rule.setting!r} means "
                f"{path}={rule.value!r}; {rule.fix}"
            )
        _set(merged, path, value)
    return merged
