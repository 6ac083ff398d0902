"""The Trainer's settings (validated up front, before any work) and its explicit progress counters."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch

from trainforge.strategies.errors import ConfigurationError, invalid_choice

log = logging.getLogger("trainforge")

CLIP_ALGORITHMS = ("norm", "value")
NONFINITE_POLICIES = ("raise", "skip", "off")


@dataclass
class LoopConfig:
    max_epochs: Optional[int] = None
    max_steps: int = -1
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: Union[int, float] = 1.0
    check_val_every_n_epoch: Optional[int] = 1
    limit_train_batches: Union[int, float] = 1.0
    limit_val_batches: Union[int, float] = 1.0
    limit_test_batches: Union[int, float] = 1.0
    limit_predict_batches: Union[int, float] = 1.0
    log_every_n_steps: int = 50
    nonfinite_loss: str = "raise"
    min_epochs: Optional[int] = None  # trainer.should_stop (EarlyStopping) waits for both (Lightning)
    min_steps: Optional[int] = None

    def validate(self) -> None:  # noqa: C901 - one check per setting, each with its own message
        for name in (
            "max_epochs",
            "max_steps",
            "check_val_every_n_epoch",
            "log_every_n_steps",
            "gradient_clip_val",
            "val_check_interval",
            "limit_train_batches",
            "limit_val_batches",
            "limit_test_batches",
            "limit_predict_batches",
            "min_epochs",
            "min_steps",
        ):
            _check_number(name, getattr(self, name))
        for name in ("min_epochs", "min_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigurationError(
                    f"{name}={value!r} must be an int >= 0 or None: fit goes on past trainer.should_stop "
                    f"(EarlyStopping) until {name} is reached"
                )
        if self.max_epochs is None and self.max_steps in (-1, None):
            raise ConfigurationError(
                "neither max_epochs nor max_steps is set, so the run would never end; "
                "pass max_epochs=N or max_steps=N (with both, training stops at the first "
                "one reached)"
            )
        if self.max_epochs is not None and (not isinstance(self.max_epochs, int) or self.max_epochs < 0):
            raise ConfigurationError(f"max_epochs={self.max_epochs!r} must be an int >= 0 or None")
        if not isinstance(self.max_steps, int) or self.max_steps < -1:
            raise ConfigurationError(f"max_steps={self.max_steps!r} must be an int >= 0 (or -1 for no limit)")
        if (
            not isinstance(self.accumulate_grad_batches, int)
            or isinstance(self.accumulate_grad_batches, bool)
            or self.accumulate_grad_batches < 1
        ):
            raise ConfigurationError(
                f"accumulate_grad_batches={self.accumulate_grad_batches!r} must be an int >= 1 "
                "(1 means an optimizer step after every batch)"
            )
        if self.gradient_clip_algorithm not in CLIP_ALGORITHMS:
            raise invalid_choice("gradient_clip_algorithm", self.gradient_clip_algorithm, CLIP_ALGORITHMS)
        if self.gradient_clip_val is not None and not (
            self.gradient_clip_val > 0 and math.isfinite(self.gradient_clip_val)
        ):
            raise ConfigurationError(f"gradient_clip_val={self.gradient_clip_val!r} must be a positive number or None")
        if self.nonfinite_loss not in NONFINITE_POLICIES:
            raise invalid_choice("nonfinite_loss", self.nonfinite_loss, NONFINITE_POLICIES)
        for name in (
            "limit_train_batches",
            "limit_val_batches",
            "limit_test_batches",
            "limit_predict_batches",
            "val_check_interval",
        ):
            _check_fraction_or_count(name, getattr(self, name))
        if self.val_check_interval == 0:
            raise ConfigurationError(
                "val_check_interval=0 would validate after every 0 batches; pass an int >= 1 "
                "(batches) or a fraction in (0, 1] of the epoch (1.0: at its end), and "
                "check_val_every_n_epoch=None with limit_val_batches=0 to turn validation off"
            )
        every = self.check_val_every_n_epoch
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ConfigurationError(
                f"check_val_every_n_epoch={every!r} must be an int >= 1 (validate every N "
                "epochs) or None (validate only by val_check_interval)"
            )
        if not isinstance(self.log_every_n_steps, int) or self.log_every_n_steps < 1:
            raise ConfigurationError(f"log_every_n_steps={self.log_every_n_steps!r} must be an int >= 1")

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _check_number(name: str, value: Any) -> None:
    """Numbers only: a bool (``max_epochs=True``) or a string (``"1.0"`` from a config file) is a mistake."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{name}={value!r} is a bool; pass a number (e.g. {name}=1)")
    if isinstance(value, str):
        raise ConfigurationError(
            f"{name}={value!r} is a string; pass a number: {name}={value.strip()} (convert "
            "values read from a config file or the command line with int() or float())"
        )


def _check_fraction_or_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name}={value!r} must be a fraction in (0, 1] or a batch count >= 1")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ConfigurationError(
            f"{name}={value!r}: a float is a fraction of the epoch and must be in (0, 1]; "
            "pass an int for a number of batches"
        )
    if isinstance(value, int) and value < 0:
        raise ConfigurationError(f"{name}={value!r} must be >= 0")


def loader_length(loader: Any) -> Optional[int]:
    """``len(loader)``, or None for a loader without length (an IterableDataset without ``__len__``)."""
    try:
        return len(loader)
    except TypeError:
        return None


def limited(count: Optional[int], limit: Union[int, float], name: str = "limit_train_batches") -> Union[int, float]:
    """Batches to run out of ``count`` under a ``limit_*_batches`` setting. ``count=None`` (a loader
    without a length, e.g. an IterableDataset without ``__len__``): ``inf`` (until the data ends) or
    an int limit; a fraction of an unknown length is an error."""
    if count is None:
        if isinstance(limit, float):
            if limit == 1.0:
                return float("inf")
            raise ConfigurationError(
                f"{name}={limit!r} is a fraction of the epoch, but the loader has no length "
                "(an IterableDataset without __len__): give a number of batches (int) or "
                "define __len__"
            )
        return limit
    if isinstance(limit, float):
        return count if limit == 1.0 else max(1, int(count * limit))
    return min(count, limit)


@dataclass
class Progress:
    """Where the run is. Incremented by the loop, saved in checkpoints, never inferred."""

    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0  # micro-batches of this epoch already consumed
    accumulation_step: int = 0  # micro-batches into the current accumulation window
    skipped_nonfinite: int = 0
    epoch_end_pending: int = 0  # 1 between the epoch's last batch and its end (scheduler step, EPOCH_END)

    def state_dict(self) -> Dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for key, value in state.items():
            setattr(self, key, int(value))


@dataclass
class OptimizerConfig:
    optimizer: torch.optim.Optimizer
    schedulers: List[Dict[str, Any]] = field(default_factory=list)
    optimizers: List[torch.optim.Optimizer] = field(default_factory=list)  # all of them (manual optimization)


SCHEDULER_INTERVALS = ("step", "epoch")
SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "name", "monitor", "strict", "reduce_on_plateau")  # Lightning's


def parse_optimizers(  # noqa: C901, PLR0915 - each return form Lightning accepts from configure_optimizers
    result: Any, module_name: str, manual: bool = False
) -> OptimizerConfig:
    """What ``configure_optimizers`` may return: an optimizer, ``(optimizer, scheduler)``,
    ``([optimizer], [scheduler])``, or ``{"optimizer": ..., "lr_scheduler": sched | {"scheduler": ...,
    "interval": "step"|"epoch", "frequency": 1, "name": ...}}``. With manual optimization also
    several: ``[opt1, opt2]``, ``([opt1, opt2], [sched1, sched2])`` or a tuple of such dicts."""
    if manual:
        several = _several(result)
        if several is not None:
            parsed = [parse_optimizers(one, module_name) for one in several]
            return OptimizerConfig(
                parsed[0].optimizer, [s for p in parsed for s in p.schedulers], [p.optimizer for p in parsed]
            )
    hint = (
        "return an optimizer, (optimizer, scheduler), or {'optimizer': opt, 'lr_scheduler': "
        "{'scheduler': sched, 'interval': 'step', 'frequency': 1}}"
    )
    optimizer, scheduler = None, None
    if isinstance(result, torch.optim.Optimizer):
        optimizer = result
    elif isinstance(result, dict):
        optimizer, scheduler = result.get("optimizer"), result.get("lr_scheduler")
    elif isinstance(result, (list, tuple)) and len(result) == 2:
        optimizer, scheduler = result
        if isinstance(optimizer, (list, tuple)):
            if len(optimizer) != 1:
                raise ConfigurationError(
                    f"{module_name}.configure_optimizers returned {len(optimizer)} optimizers; "
                    "with automatic optimization the Trainer steps one. Set "
                    "self.automatic_optimization = False in __init__ and step them in "
                    "training_step (self.optimizers(), self.manual_backward(loss)), as in "
                    "Lightning"
                )
            optimizer = optimizer[0]
        if isinstance(scheduler, (list, tuple)):
            scheduler = scheduler[0] if scheduler else None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"{module_name}.configure_optimizers returned {result!r}, which holds no torch.optim.Optimizer; {hint}"
        )
    several = _several(result)
    if several is not None and len(several) > 1:
        raise ConfigurationError(
            f"{module_name}.configure_optimizers returned {len(several)} optimizers; with "
            "automatic optimization the Trainer steps one. Set self.automatic_optimization = "
            "False in __init__ and step them in training_step (self.optimizers(), "
            "self.manual_backward(loss)), as in Lightning"
        )
    schedulers = []
    if scheduler is not None:
        entry = dict(scheduler) if isinstance(scheduler, dict) else {"scheduler": scheduler}
        unknown = sorted(set(entry) - set(SCHEDULER_KEYS), key=str)
        if unknown:
            raise ConfigurationError(
                f"{module_name}.configure_optimizers: lr_scheduler dict has unknown key(s) "
                f"{unknown}; valid keys: {', '.join(SCHEDULER_KEYS)}"
            )
        entry.setdefault("interval", "epoch")
        entry.setdefault("frequency", 1)
        entry.setdefault("name", None)
        entry.setdefault("monitor", None)
        entry.setdefault("strict", True)
        # as in Lightning: step(metric) for a ReduceLROnPlateau, or any scheduler marked reduce_on_plateau=True
        plateau = isinstance(entry.get("scheduler"), torch.optim.lr_scheduler.ReduceLROnPlateau)
        entry.setdefault("reduce_on_plateau", plateau)
        if not isinstance(entry["reduce_on_plateau"], bool):
            raise ConfigurationError(
                f"lr_scheduler reduce_on_plateau={entry['reduce_on_plateau']!r} must be True (step(metric) with "
                "the value of 'monitor') or False"
            )
        if entry["reduce_on_plateau"] and entry["monitor"] is None:
            raise ConfigurationError(
                f"{module_name}.configure_optimizers: a "
                f"{'ReduceLROnPlateau' if plateau else 'scheduler with reduce_on_plateau=True'} steps on a metric; "
                "name it: {'scheduler': sched, 'monitor': 'val/loss'} (a key you self.log)"
            )
        if entry["interval"] not in SCHEDULER_INTERVALS:
            raise invalid_choice("lr_scheduler interval", entry["interval"], SCHEDULER_INTERVALS)
        if not hasattr(entry.get("scheduler"), "step"):
            raise ConfigurationError(
                f"{module_name}.configure_optimizers: lr_scheduler {entry.get('scheduler')!r} has no step(); {hint}"
            )
        owner = getattr(entry["scheduler"], "optimizer", None)
        if isinstance(owner, torch.optim.Optimizer) and owner is not optimizer:
            raise ConfigurationError(
                f"{module_name}.configure_optimizers: the lr_scheduler "
                f"{type(entry['scheduler']).__name__} was built on another optimizer than the one "
                f"returned ({type(owner).__name__} vs {type(optimizer).__name__}), so it would "
                "never change the learning rate used; build it on the returned optimizer"
            )
        if isinstance(entry["frequency"], bool) or not isinstance(entry["frequency"], int) or entry["frequency"] < 1:
            raise ConfigurationError(f"lr_scheduler frequency={entry['frequency']!r} must be an int >= 1")
        schedulers.append(entry)
    return OptimizerConfig(optimizer, schedulers, [optimizer])


def _several(result: Any) -> Optional[List[Any]]:
    """The per-optimizer pieces of a multi-optimizer return, or None for a single optimizer."""
    if isinstance(result, (dict, torch.optim.Optimizer)):
        return None
    if not isinstance(result, (list, tuple)) or not result:
        return None
    if all(isinstance(o, torch.optim.Optimizer) for o in result):
        return list(result) if len(result) > 1 else None
    if all(isinstance(o, dict) for o in result):
        return list(result)
    if len(result) == 2 and isinstance(result[0], (list, tuple)) and len(result[0]) > 1:
        optimizers, schedulers = list(result[0]), list(result[1] or [])
        by_opt = {id(getattr(s, "optimizer", None)): s for s in schedulers}
        return [{"optimizer": o, "lr_scheduler": by_opt[id(o)]} if id(o) in by_opt else o for o in optimizers]
    return None


def resolve_root_dir(path: Optional[str]) -> str:
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigurationError(f"default_root_dir={path!r} must be a directory path (str or pathlib.Path)")
    root = os.path.abspath(path if path is not None else os.path.join(os.getcwd(), "runs"))
    existing = next((p for p in _parents(root) if os.path.exists(p)), None)
    if existing is not None and not os.path.isdir(existing):
        raise ConfigurationError(
            f"default_root_dir={str(path if path is not None else root)!r}: {existing} is a file, "
            "not a directory; give a directory path (checkpoints and logs go under it)"
        )
    os.makedirs(root, exist_ok=True)
    return root


def resolve_root_dirs(path: Optional[str]) -> tuple[str, Optional[str]]:
    """(local root for logs and trackers, URL for checkpoints or None). A URL ``default_root_dir``
    (``s3://bucket/run``: strategies/checkpoint/remote.py) holds the checkpoints; trackers, profiles and hang
    dumps write local files and stay under the local default (``<cwd>/runs``), said once here."""
    from trainforge.strategies.checkpoint.remote import RemotePath, check_not_mangled, check_protocol, is_remote

    check_not_mangled(path, "default_root_dir")
    if not is_remote(path):
        return resolve_root_dir(path), None
    url = RemotePath(str(path)).url
    check_protocol(url)  # an fsspec protocol that is not installed fails here, before any work
    local = resolve_root_dir(None)
    log.info(
        "trainforge: default_root_dir=%r: checkpoints go to %s/checkpoints; logs, trackers, profiles and hang "
        "dumps stay on local disk under %s",
        str(path),
        url,
        local,
    )
    return local, url


def _parents(path: str) -> List[str]:
    """``path`` and its ancestors, nearest first."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def check_callbacks(callbacks: Any, base: type) -> List[Any]:
    """``callbacks`` as a list of instances of ``base``, or a ConfigurationError naming the mistake."""
    if callbacks is None:
        return []
    if isinstance(callbacks, (base, type)) or not isinstance(callbacks, (list, tuple)):
        shown = callbacks.__name__ if isinstance(callbacks, type) else type(callbacks).__name__
        raise ConfigurationError(
            f"callbacks={shown}{'' if isinstance(callbacks, type) else '(...)'} is not a list; "
            f"pass a list: callbacks=[{shown}(...)]"
        )
    for i, cb in enumerate(callbacks):
        if isinstance(cb, type):
            raise ConfigurationError(
                f"callbacks[{i}] is the class {cb.__name__}, not an instance; write "
                f"{cb.__name__}(...) (with its arguments)"
            )
        if not isinstance(cb, base):
            raise ConfigurationError(
                f"callbacks[{i}]={cb!r} is a {type(cb).__name__}, not a Callback; subclass "
                "trainforge.callbacks.Callback"
            )
    return list(callbacks)
