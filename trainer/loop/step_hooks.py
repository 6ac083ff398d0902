"""Lightning's hooks with a default behaviour: the module may override how the loop steps, zeroes,
back-propagates, schedules, moves batches and switches modes, and the Trainer calls the override
where Lightning does (tests/trainer/test_hook_coverage.py walks Lightning 2.6's whole hook list).

``LoopHooks`` holds the defaults (a ``TrainingModule`` inherits them); ``overridden`` tells the loop
whether the module replaced one; ``ClosureOptimizer``/``StepClosure`` are what an overridden
``optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)`` receives; ``BatchTransfer`` runs
``on_before_batch_transfer``/``transfer_batch_to_device``/``on_after_batch_transfer``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, NamedTuple, Optional

import torch

from trainforge.strategies.errors import ConfigurationError


def step_scheduler(scheduler: Any, metric: Any) -> None:
    """``scheduler.step()``, or ``scheduler.step(metric)`` for a monitored one (Lightning's default)."""
    if metric is None:
        scheduler.step()
    else:
        scheduler.step(metric)


class LoopHooks:
    """Lightning's overridable loop hooks, with Lightning's defaults (a ``TrainingModule`` inherits them)."""

    # ---- the optimizer step (automatic optimization) ------------------------------------------------
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Step ``optimizer`` on the window's last batch: ``optimizer.step(closure=optimizer_closure)``.
        Override it to change the learning rate around the step (warm-up) or to skip steps; the closure
        (``training_step``, ``optimizer_zero_grad``, backward, ``on_before_optimizer_step`` and clipping) must
        run, through ``optimizer.step(closure=...)`` or by calling it."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Zero the gradients before the backward of a window's first batch (Lightning's place)."""
        optimizer.zero_grad()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss``, already divided for accumulation and scaled for fp16 (Lightning)."""
        loss.backward(*args, **kwargs)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step ``scheduler`` when its interval is due; ``metric`` is the monitored value (ReduceLROnPlateau)."""
        step_scheduler(scheduler, metric)

    # ---- evaluation modes ------------------------------------------------------------------------
    def on_validation_model_zero_grad(self) -> None:
        """Before validation inside fit, at a window boundary: free the gradients (Lightning)."""
        self.zero_grad()  # type: ignore[attr-defined]

    def on_validation_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_validation_model_train(self) -> None:
        """Called after validation only when overridden; the default restores each submodule's mode."""
        self.train()  # type: ignore[attr-defined]

    def on_test_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_test_model_train(self) -> None:
        """Called after test only when overridden; the default restores each submodule's mode."""
        self.train()  # type: ignore[attr-defined]

    def on_predict_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    # ---- data ------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Download or write data once per node (local rank 0) before ``setup``; the others wait."""

    def configure_callbacks(self) -> Any:
        """Callbacks the module brings: added to the Trainer's at each stage's start, replacing the
        Trainer's callbacks of the same type (Lightning)."""
        return []

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        from trainforge.strategies.data.utils import move_to_device

        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def overridden(target: Any, name: str, base: type = LoopHooks) -> bool:
    """Whether ``target``'s class replaces ``base``'s ``name``."""
    method = getattr(type(target), name, None)
    return method is not None and method is not getattr(base, name, None)


class StepClosure:
    """The closure an overridden ``optimizer_step`` gets: the batch's ``training_step``, zero_grad and
    backward; it returns the loss. Called at most once per step (a second call is refused: the loop
    runs one forward per batch)."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run, self.calls, self.result = run, 0, None

    def __call__(self) -> Any:
        if self.calls:
            raise ConfigurationError(
                "optimizer_closure was called twice in one optimizer_step: the loop runs one training_step and "
                "backward per batch; call it once (optimizers that re-evaluate the closure, like LBFGS, are not "
                "supported in automatic optimization: use manual optimization)"
            )
        self.calls += 1
        self.result = self._run()
        return self.result


class ClosureOptimizer:
    """The optimizer an overridden ``optimizer_step`` receives (Lightning's ``LightningOptimizer``):
    ``step(closure=...)`` runs the closure, then the loop's step (clipping, the strategy's step, fp16
    scaling); everything else is the prepared optimizer's (``param_groups``, ``state``, ``zero_grad``)."""

    def __init__(self, optimizer: Any, step: Callable[[], None]) -> None:
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_step", step)
        object.__setattr__(self, "stepped", False)

    @property
    def optimizer(self) -> Any:
        """The user's own optimizer (Lightning: ``optimizer.optimizer``)."""
        return getattr(self._optimizer, "optimizer", self._optimizer)

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        if kwargs:
            raise ConfigurationError(
                f"optimizer.step({', '.join(kwargs)}=...) inside optimizer_step: the loop's step takes only "
                "closure=; set such options on the optimizer's param_groups"
            )
        result = closure() if closure is not None else None
        self._step()
        object.__setattr__(self, "stepped", True)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._optimizer, name, value)


class BatchTransfer:
    """Lightning's batch hooks around the move to the device, from the datamodule when it overrides
    them, else from the module: ``on_before_batch_transfer`` (on the loader's device), then
    ``transfer_batch_to_device(batch, device, dataloader_idx)``, then ``on_after_batch_transfer``."""

    def __init__(self, owners: List[Any], device: torch.device) -> None:
        # owners: the datamodule (first, if any) and the module
        self.device = device
        self.hooks = [_owner_of(owners, name) for name in TRANSFER_HOOKS]

    def __call__(self, batch: Any, dataloader_idx: int) -> Any:
        before, transfer, after = self.hooks
        batch = before.on_before_batch_transfer(batch, dataloader_idx)
        batch = transfer.transfer_batch_to_device(batch, self.device, dataloader_idx)
        return after.on_after_batch_transfer(batch, dataloader_idx)


def _owner_of(owners: List[Any], name: str) -> Any:
    """The first of ``owners`` that overrides ``name`` (Lightning prefers the datamodule's), else the last."""
    return next((o for o in owners if overridden(o, name)), owners[-1])


def batch_transfer(module: Any, datamodule: Any, device: torch.device, strategy: Any) -> Optional[BatchTransfer]:
    """A ``BatchTransfer`` when the module or datamodule overrides one of the three hooks, else None
    (the loader moves batches itself). Refused where the strategy's own loader moves them (XLA)."""
    owners = [o for o in (datamodule, module) if o is not None]
    names = [f"{type(o).__name__}.{n}" for o in owners for n in TRANSFER_HOOKS if overridden(o, n)]
    if not names:
        return None
    if getattr(strategy, "device_batches", None) is not None:
        raise ConfigurationError(
            f"{', '.join(names)}: under {type(strategy).__name__} the strategy's own device loader moves "
            "batches, so these hooks cannot run before and around the transfer; do that work in the "
            "DataLoader's collate_fn or in training_step"
        )
    return BatchTransfer(owners, device)


class StepOverrides(NamedTuple):
    """Which of the step's hooks a module replaces, decided once per fit (``step_overrides``)."""

    optimizer_step: bool
    backward: bool


_MANUAL_UNUSED = ("optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping")


def step_overrides(module: Any, strategy: Any) -> StepOverrides:
    """The module's step hooks for this fit, checked: those the strategy cannot run are refused, and those
    manual optimization never calls (as in Lightning) are warned of."""
    names = {name: overridden(module, name) for name in ("optimizer_step", "backward")}
    where = type(module).__name__
    if not module.automatic_optimization:
        unused = [n for n in _MANUAL_UNUSED if overridden(module, n, _base_of(module, n))]
        if unused:
            warnings.warn(
                f"{where} overrides {', '.join(unused)}, which manual optimization (automatic_optimization = False) "
                "never calls, as in Lightning: do that work in training_step",
                UserWarning,
                stacklevel=4,
            )
        return StepOverrides(optimizer_step=False, backward=names["backward"] and _backward_runs(where, strategy))
    if names["optimizer_step"] and strategy.pipelined:
        raise ConfigurationError(
            f"{where}.optimizer_step: under pipeline parallelism the schedule runs every micro-batch's forward and "
            "backward, so there is no closure to hand it; change the learning rate in a scheduler "
            "(configure_optimizers) or in on_before_optimizer_step instead"
        )
    return StepOverrides(
        optimizer_step=names["optimizer_step"], backward=names["backward"] and _backward_runs(where, strategy)
    )


def _backward_runs(where: str, strategy: Any) -> bool:
    """Whether the module's ``backward`` can replace ``loss.backward()`` under ``strategy`` (else refused)."""
    if strategy.own_backward or strategy.pipelined:
        why = "DeepSpeed's engine runs the backward" if strategy.own_backward else "the pipeline schedule runs it"
        raise ConfigurationError(
            f"{where}.backward is overridden, but under {type(strategy).__name__} {why}, so the hook cannot "
            "replace loss.backward(); remove the override (do its work in on_before_backward/on_after_backward)"
        )
    return True


def _base_of(module: Any, name: str) -> type:
    """The class whose ``name`` is the default: LoopHooks', or TrainingModule's for its own methods."""
    from trainforge.trainer.module.training_module import TrainingModule

    return LoopHooks if name in vars(LoopHooks) else TrainingModule


def keep_on_host(prepared: Any, transfer: Optional[Callable[[Any, int], Any]]) -> Any:
    """A prepared loader whose batches the module's transfer hooks move (then it yields them unmoved)."""
    if transfer is not None:
        prepared.device = torch.device("cpu")
    return prepared


def configure_model(module: Any) -> None:
    """The module's ``configure_model()``, or Lightning's deprecated ``configure_sharded_model()`` in its place."""
    from trainforge.trainer.module.training_module import TrainingModule

    own = type(module).configure_model is not TrainingModule.configure_model
    sharded = callable(getattr(type(module), "configure_sharded_model", None))
    if own and sharded:
        raise ConfigurationError(
            f"{type(module).__name__} overrides both configure_model and configure_sharded_model (Lightning's "
            "deprecated name for it); keep configure_model only"
        )
    if sharded:
        warnings.warn(
            f"{type(module).__name__}.configure_sharded_model is Lightning's deprecated name: it runs as "
            "configure_model does; rename it configure_model",
            FutureWarning,
            stacklevel=4,
        )
        module.configure_sharded_model()
    elif own:
        module.configure_model()


def add_module_callbacks(callbacks: List[Any], module: Any) -> None:
    """The module's ``configure_callbacks()`` joined to the Trainer's list, in place (Lightning's rule):
    a Trainer callback of a class one of them is (or subclasses) is replaced; checkpointers stay last."""
    if not overridden(module, "configure_callbacks"):
        return
    from trainforge.callbacks.base import Callback, Checkpointer
    from trainforge.trainer.loop.settings import check_callbacks

    given = module.configure_callbacks()
    own = check_callbacks(given if isinstance(given, (list, tuple)) else [given], Callback)
    replaced = {type(cb) for cb in callbacks if any(issubclass(type(new), type(cb)) for new in own)}
    replaced.discard(Callback)
    merged = [cb for cb in callbacks if type(cb) not in replaced] + own
    callbacks[:] = [c for c in merged if not isinstance(c, Checkpointer)] + [
        c for c in merged if isinstance(c, Checkpointer)
    ]
