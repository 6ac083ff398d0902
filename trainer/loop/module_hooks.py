"""The ``TrainingModule``'s hooks, with Lightning's signatures, and how the dispatcher binds them.

Callbacks take ``(trainer, module, ...)``; the module's hooks take only the event's own arguments,
as a LightningModule's do (``on_train_epoch_end(self)``, ``on_train_batch_end(self, outputs, batch,
batch_idx)``, ``setup(self, stage)``). The Trainer binds each target once per fit
(:func:`bind_module_hook`), so there is still one dispatch point and no per-call branching.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from trainforge.callbacks.events import Event
from trainforge.trainer.loop.step_hooks import LoopHooks

#: Event -> the module's method name, where it differs from the callback's (Lightning's names).
_RENAMED = {Event.SETUP: "setup", Event.TEARDOWN: "teardown"}
#: Events a LightningModule has no hook for: only callbacks receive them.
_CALLBACK_ONLY = {Event.LOG, Event.EXCEPTION, Event.SANITY_CHECK_START, Event.SANITY_CHECK_END}


def module_hook_name(event: Event) -> Optional[str]:
    return None if event in _CALLBACK_ONLY else _RENAMED.get(event, event.value)


#: A callback's methods for an event: the event's own name, and Lightning's callback name where it differs.
_CALLBACK_NAMES = {Event.SETUP: ("on_setup", "setup"), Event.TEARDOWN: ("on_teardown", "teardown")}


def callback_hook_names(event: Event) -> Tuple[str, ...]:
    return _CALLBACK_NAMES.get(event, (event.value,))


Listener = Tuple[str, Callable[..., Any]]


def lightning_order(event: Event, module: List[Listener], callbacks: List[Tuple[Listener, bool]]) -> List[Listener]:
    """One event's listeners in Lightning 2.6's order: the callbacks (in their order), then the module; the
    module first at LOAD_CHECKPOINT. The monitoring callbacks (``callbacks``' flag: checkpointing, early
    stopping) run after the module, as Lightning runs them at ``on_train_epoch_end``; here at every event, so
    that a checkpoint written at BATCH_END holds what the module's ``on_train_batch_end`` did (exact resume)."""
    plain = [listener for listener, monitors in callbacks if not monitors]
    monitoring = [listener for listener, monitors in callbacks if monitors]
    if event is Event.LOAD_CHECKPOINT:
        return module + plain + monitoring
    return plain + module + monitoring


class ModuleHooks:
    """No-op hooks; override the ones you need (Lightning's names and signatures)."""

    def setup(self, stage: str) -> None: ...
    def teardown(self, stage: str) -> None: ...
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, loss: Any) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: Any) -> None: ...
    def on_before_zero_grad(self, optimizer: Any) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None: ...


MODULE_HOOKS = frozenset(name for name in vars(ModuleHooks) if not name.startswith("_"))


def bind_module_hook(module: Any, event: Event) -> Optional[Callable[..., Any]]:
    """The module's hook for ``event`` as a dispatcher listener ``(trainer, module, *args)``, or
    None when the module does not override it."""
    name = module_hook_name(event)
    if name is None or getattr(type(module), name, None) is getattr(ModuleHooks, name):
        return None
    bound = getattr(module, name)
    if _takes_trainer_first(bound):  # the pre-Lightning-signature form: still honoured, loudly
        warnings.warn(
            f"{type(module).__name__}.{name}(trainer, module, ...) uses the callback signature; module "
            f"hooks take Lightning's ({name}{_lightning_signature(name)}). Drop the trainer and module "
            "arguments (self.trainer is available); this form will stop working",
            FutureWarning,
            stacklevel=4,
        )
        return bound
    _check_lightning_signature(module, name, bound)
    return lambda trainer, module, *args: bound(*args)


def _required_arguments(method: Any) -> Optional[List[str]]:
    """The arguments ``method`` cannot be called without (None: it takes ``*args`` or cannot be inspected)."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.default is p.empty and p.kind is not p.VAR_KEYWORD]


def _check_lightning_signature(module: Any, name: str, bound: Any) -> None:
    """A hook that needs more arguments than Lightning 2.x passes (Lightning 1.x's ``on_train_epoch_end(self,
    outputs)``) fails at the start of fit, naming the 2.x signature, not with a TypeError when it fires."""
    required = _required_arguments(bound)
    passed = [p for p in inspect.signature(getattr(ModuleHooks, name)).parameters if p != "self"]
    if required is None or len(required) <= len(passed):
        return
    from trainforge.strategies.errors import ConfigurationError

    extra = required[len(passed) :]
    hint = (
        " Lightning 2.0 removed the epoch's step outputs: keep what you need in a list on the module (append in "
        "the step, read and clear it here)"
        if "outputs" in extra
        else ""
    )
    raise ConfigurationError(
        f"{type(module).__name__}.{name}{inspect.signature(bound)} needs {', '.join(extra)}, which Lightning 2.x "
        f"does not pass: the Trainer calls {name}{_lightning_signature(name)}.{hint}"
    )


def check_training_step(module: Any) -> None:
    """Lightning 1.x's ``training_step(self, batch, batch_idx, optimizer_idx)`` (several optimizers in
    automatic optimization) was removed in Lightning 2.0: refused at the start of fit with the 2.x way."""
    required = _required_arguments(module.training_step)
    if required is None or ("optimizer_idx" not in required and len(required) <= 2):
        return
    from trainforge.strategies.errors import ConfigurationError

    raise ConfigurationError(
        f"{type(module).__name__}.training_step{inspect.signature(module.training_step)} takes "
        f"{', '.join(required[2:]) or 'optimizer_idx'}: Lightning 1.x's form for several optimizers, which Lightning "
        "2.0 removed; the Trainer calls training_step(batch, batch_idx). Set self.automatic_optimization = False "
        "and step each optimizer of self.optimizers() in training_step (manual optimization)"
    )


def _takes_trainer_first(method: Any) -> bool:
    try:
        params = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return False
    return params[:1] == ["trainer"]


def _lightning_signature(name: str) -> str:
    signature = inspect.signature(getattr(ModuleHooks, name)).replace(return_annotation=inspect.Signature.empty)
    return str(signature).replace("self, ", "").replace("(self)", "()")


# Lightning 1.x epoch-end hooks, removed in Lightning 2.0 (which refuses them): their replacements.
REMOVED_HOOKS = {
    "training_epoch_end": "on_train_epoch_end",
    "validation_epoch_end": "on_validation_epoch_end",
    "test_epoch_end": "on_test_epoch_end",
    "predict_epoch_end": "on_predict_epoch_end",
}


def warn_unknown_hooks(module: Any) -> None:
    """A Lightning user's ``on_*`` method that the Trainer never calls would be silently ignored; a
    Lightning 1.x ``*_epoch_end(outputs)`` hook, which would never be called, is refused as Lightning 2.0
    does (tests/trainer/test_lightning_hooks.py,
    ``test_lightning_1x_epoch_end_hooks_are_refused_with_their_replacement``)."""
    check_training_step(module)
    removed = [name for name in REMOVED_HOOKS if callable(getattr(type(module), name, None))]
    if removed:
        from trainforge.strategies.errors import ConfigurationError

        raise ConfigurationError(
            f"{type(module).__name__} defines {', '.join(removed)}, which Lightning 2.0 removed and the Trainer "
            f"never calls; move the code to {', '.join(REMOVED_HOOKS[n] for n in removed)}(self) and keep the "
            "step outputs you need in a list on the module (clear it there)"
        )
    unknown = sorted(
        name
        for name in dir(type(module))
        if name.startswith("on_")
        and name not in MODULE_HOOKS
        and name not in vars(LoopHooks)
        and callable(getattr(type(module), name))
    )
    if unknown:
        warnings.warn(
            f"{type(module).__name__} defines {', '.join(unknown)}, which the Trainer never calls (its "
            f"module hooks: {', '.join(sorted(MODULE_HOOKS))}); rename or remove "
            f"{'it' if len(unknown) == 1 else 'them'}",
            UserWarning,
            stacklevel=3,
        )


def warn_unknown_callback_hooks(callback: Any, base: type) -> None:
    """A callback's ``on_*`` method that is not a hook of ``base`` (a typo) never runs: warned about, as the
    module's are (tests/trainer/test_lightning_hooks.py, ``test_a_callback_hook_with_a_typo_gets_a_warning``)."""
    unknown = sorted(
        name
        for name in dir(type(callback))
        if name.startswith("on_") and not hasattr(base, name) and callable(getattr(type(callback), name))
    )
    if unknown:
        warnings.warn(
            f"{type(callback).__name__} defines {', '.join(unknown)}, which is not a Callback hook and "
            f"never runs (the hooks are the on_* methods of trainforge.callbacks.Callback); rename or "
            f"remove {'it' if len(unknown) == 1 else 'them'}",
            UserWarning,
            stacklevel=3,
        )


# ---- the steps: Lightning's rule for batch_idx, and validation without a validation_step ------------
STEP_NAMES = frozenset({"training_step", "validation_step", "test_step", "predict_step"})


def takes_batch_idx(step: Callable[..., Any]) -> bool:
    """Whether a (bound) step method is called with ``batch_idx`` after the batch, by Lightning's rule:
    it names ``batch_idx``, takes ``*args``, or takes two positional arguments (``training_step(self,
    batch)`` gets the batch alone)."""
    try:
        params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (
        len(positional) >= 2
        or any(p.kind is p.VAR_POSITIONAL for p in params)
        or any(p.name == "batch_idx" for p in positional)
    )


def step_arguments(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` called as ``step(batch, batch_idx)``, whichever of Lightning's signatures it has."""
    if takes_batch_idx(step):
        return step
    return lambda batch, *rest: step(batch, *rest[1:])


def validation_loaders(module: Any, loaders: Any, pipelined: bool) -> Any:
    """``loaders``, or None with a warning when the module has no ``validation_step`` to run on them
    (Lightning skips the validation loop too). A pipelined strategy validates on its stages' loss."""
    from trainforge.trainer.module.training_module import TrainingModule

    given = loaders if isinstance(loaders, (list, tuple)) else [] if loaders is None else [loaders]
    if not given or pipelined or type(module).validation_step is not TrainingModule.validation_step:
        return loaders
    warnings.warn(
        f"fit has validation dataloaders (given, or from val_dataloader()) but {type(module).__name__} has no "
        "validation_step: validation is skipped, as in Lightning; define validation_step(self, batch, batch_idx) "
        "to validate",
        UserWarning,
        stacklevel=4,
    )
    return None


def takes_dataloader_idx(method: Callable[..., Any]) -> Tuple[bool, bool]:
    """(whether ``method`` can take ``dataloader_idx``: it names it or takes ``*args``, whether it must)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return True, False
    named = params.get("dataloader_idx")
    if named is not None:
        return True, named.default is inspect.Parameter.empty
    return any(p.kind is p.VAR_POSITIONAL for p in params.values()), False


def check_dataloader_idx(module: Any, callbacks: Any, step_name: str, batch_hooks: Any, count: int) -> None:
    """Lightning's rule: with several loaders of a stage, its step and batch hooks get ``dataloader_idx``
    after ``batch_idx`` and must take it; with one, they get none and must not require it."""
    from trainforge.callbacks.base import Callback
    from trainforge.strategies.errors import ConfigurationError
    from trainforge.trainer.module.training_module import TrainingModule

    loader = {"validation_step": "val_dataloader", "test_step": "test_dataloader"}.get(step_name, "predict_dataloader")
    owners: List[Tuple[Any, type, Tuple[str, ...]]] = [(module, TrainingModule, (step_name, *batch_hooks))]
    owners += [(cb, Callback, tuple(batch_hooks)) for cb in callbacks]
    for target, base, names in owners:
        for name in names:
            if getattr(type(target), name, None) is getattr(base, name, None):
                continue  # not overridden: the base class takes it
            can, must = takes_dataloader_idx(getattr(target, name))
            where = f"{type(target).__name__}.{name}()"
            if count > 1 and not can:
                raise ConfigurationError(
                    f"several {loader}s ({count}) are given, but {where} has no dataloader_idx argument (it gets "
                    "the loader's index after batch_idx, as in Lightning); add dataloader_idx=0 to its signature"
                )
            if count == 1 and must:
                raise ConfigurationError(
                    f"one {loader} is given, but {where} requires dataloader_idx (passed only with several "
                    "loaders, as in Lightning); give it a default, dataloader_idx=0, or remove it"
                )
