"""Accelerate's ``DummyOptim`` and ``DummyScheduler`` (``accelerate.utils``; exported by ``trainforge.utils``): with
the DeepSpeed strategy, a DeepSpeed config's ``optimizer`` (and ``scheduler``) section builds the optimizer (and
scheduler), and the program prepares these stand-ins in their place, as Accelerate 1.15 does:

    optimizer = DummyOptim(model.parameters(), lr=3e-4)      # the config's optimizer.params.lr may say "auto"
    scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

``prepare`` returns the DeepSpeed optimizer (stepped by ``optimizer.step()``) and DeepSpeed's scheduler, which the
engine steps with the optimizer: its ``step()`` does nothing, as Accelerate's ``DeepSpeedSchedulerWrapper``. The
config's ``"auto"`` values are filled as Accelerate fills them (``lr``/``weight_decay`` from the DummyOptim; the
scheduler's warm-up from 0 to the DummyOptim's ``lr`` over ``max(1, warmup_num_steps)`` steps, and
``total_num_steps`` divided by the number of processes unless ``split_batches``). Without a config section, with
another strategy, or mixed with a real optimizer, each is refused, saying what to do."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

from trainforge.strategies.errors import ConfigurationError


class DummyOptim:
    """Stands for the optimizer of the DeepSpeed config's ``optimizer`` section (Accelerate's): ``params`` are
    the parameters (or param groups) it optimizes; ``lr`` and ``weight_decay`` fill the section's ``"auto"``."""

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.params, self.lr, self.weight_decay, self.kwargs = params, lr, weight_decay, kwargs


class DummyScheduler:
    """Stands for the scheduler of the DeepSpeed config's ``scheduler`` section (Accelerate's), or, with
    ``lr_scheduler_callable(optimizer)``, for the scheduler that function builds over DeepSpeed's optimizer."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: Optional[int] = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Optional[Callable[[Any], Any]] = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer, self.total_num_steps, self.warmup_num_steps = optimizer, total_num_steps, warmup_num_steps
        self.lr_scheduler_callable, self.kwargs = lr_scheduler_callable, kwargs


def config_optimizer(strategy: Any, objects: Sequence[Any], num_processes: int, split_batches: bool) -> Any:
    """The ``ConfigOptimizer`` to set the strategy up with when ``objects`` hold a ``DummyOptim`` (None when they
    hold none); the combinations Accelerate refuses are refused here, before any work."""
    optimizer = _one(objects, DummyOptim)
    scheduler = _one(objects, DummyScheduler)
    if optimizer is None:
        if scheduler is not None:
            raise ConfigurationError(
                "prepare() got a DummyScheduler without a DummyOptim: DeepSpeed builds the scheduler over the "
                "optimizer of its config; prepare DummyOptim(model.parameters(), lr=...) with it"
            )
        return None
    from trainforge.strategies.deepspeed import ConfigOptimizer, DeepSpeedStrategy

    if not isinstance(strategy, DeepSpeedStrategy):
        raise ConfigurationError(
            f"prepare() got a DummyOptim with strategy {strategy.name!r}: it stands for the optimizer of a "
            "DeepSpeed config's 'optimizer' section. Use strategy=DeepSpeedStrategy(config={...'optimizer': ...}), "
            "or create a torch optimizer (torch.optim.AdamW(model.parameters(), lr=...))"
        )
    sections = strategy.user_config or {}
    _check_sections(sections, scheduler, objects)
    auto = _auto_values(optimizer, scheduler, num_processes, split_batches)
    callable_scheduler = scheduler.lr_scheduler_callable if scheduler is not None else None
    return ConfigOptimizer(params=optimizer.params, auto=auto, lr_scheduler=callable_scheduler)


def _check_sections(sections: Dict[str, Any], scheduler: Optional[DummyScheduler], objects: Sequence[Any]) -> None:
    if "optimizer" not in sections:
        raise ConfigurationError(
            "prepare() got a DummyOptim, and the DeepSpeed config has no 'optimizer' section for DeepSpeed to "
            "build it from: add one ({'optimizer': {'type': 'AdamW', 'params': {'lr': 'auto'}}}) or create a "
            "torch optimizer instead of the DummyOptim"
        )
    if any(_is_real_optimizer(o) for o in objects):
        raise ConfigurationError(
            "prepare() got a DummyOptim and a torch optimizer: DeepSpeed trains one optimizer, the config's; "
            "prepare only the DummyOptim"
        )
    if scheduler is not None and scheduler.lr_scheduler_callable is None and "scheduler" not in sections:
        raise ConfigurationError(
            "prepare() got a DummyScheduler without lr_scheduler_callable, and the DeepSpeed config has no "
            "'scheduler' section: add one ({'scheduler': {'type': 'WarmupDecayLR', 'params': {...: 'auto'}}}) "
            "or pass DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: ...)"
        )
    if scheduler is not None and scheduler.lr_scheduler_callable is not None and "scheduler" in sections:
        raise ConfigurationError(
            "DummyScheduler(lr_scheduler_callable=...) with a 'scheduler' section in the DeepSpeed config: "
            "DeepSpeed would build one of them only; remove the section or the callable"
        )


def _auto_values(
    optimizer: DummyOptim, scheduler: Optional[DummyScheduler], num_processes: int, split_batches: bool
) -> Dict[str, Any]:
    """What Accelerate 1.15 puts in the config's ``"auto"`` entries (``Accelerator._prepare_deepspeed``)."""
    auto: Dict[str, Any] = {
        "optimizer.params.lr": optimizer.lr,
        "optimizer.params.weight_decay": optimizer.weight_decay,
    }
    if scheduler is None or scheduler.lr_scheduler_callable is not None:
        return auto
    auto.update(
        {
            "scheduler.params.warmup_min_lr": 0,
            "scheduler.params.warmup_max_lr": getattr(scheduler.optimizer, "lr", optimizer.lr),
            "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
        }
    )
    if scheduler.total_num_steps is not None:
        total = scheduler.total_num_steps
        auto["scheduler.params.total_num_steps"] = total if split_batches else math.ceil(total / num_processes)
    return auto


def prepared_stand_ins(
    objects: Sequence[Any], engine: Any, optimizers: List[Any], prepare_optimizer: Callable[[Any], Any]
) -> Dict[int, Any]:
    """``{id(stand-in): what prepare returns for it}`` once DeepSpeed built the optimizer (``optimizers[0]``,
    prepared by ``prepare_optimizer``) and its scheduler (``engine.lr_scheduler``)."""
    out: Dict[int, Any] = {}
    for obj in objects:
        if isinstance(obj, DummyOptim):
            out[id(obj)] = prepare_optimizer(optimizers[0])
        elif isinstance(obj, DummyScheduler):
            out[id(obj)] = EngineScheduler(engine.lr_scheduler)
    return out


class EngineScheduler:
    """DeepSpeed's scheduler as ``prepare`` returns it for a ``DummyScheduler``: the engine steps it with the
    optimizer, so ``step()`` does nothing (Accelerate's ``DeepSpeedSchedulerWrapper``); the rest is the
    scheduler's (``get_last_lr()``, ``state_dict()``)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def _one(objects: Sequence[Any], kind: type) -> Any:
    found = [o for o in objects if isinstance(o, kind)]
    if len(found) > 1:
        raise ConfigurationError(f"prepare() got {len(found)} {kind.__name__}s; DeepSpeed trains one optimizer")
    return found[0] if found else None


def _is_real_optimizer(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer)
