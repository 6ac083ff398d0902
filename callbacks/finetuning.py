"""``BaseFinetuning``: freeze parts of the model before training and unfreeze them on a schedule, each unfrozen
part added to the optimizer as a new parameter group (Lightning's ``lightning.pytorch.callbacks.BaseFinetuning``,
with its semantics).

Subclass it and override ``freeze_before_training(module)`` (called at setup, before ``configure_optimizers``:
build the optimizer from the parameters that ``requires_grad``) and ``finetune_function(module, epoch,
optimizer)`` (called at the start of every training epoch, once per optimizer). The groups each optimizer has
are kept by parameter name in the callback's state (Lightning's ``internal_optimizer_metadata``), so a fit
resumed from a checkpoint rebuilds the added groups before the optimizer's state is loaded into them: the
resumed run is exact.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

Modules = Union[nn.Module, Iterable[Any]]
log = logging.getLogger("trainforge")


class BaseFinetuning(Callback):
    """Base class of a freeze/unfreeze schedule (see the module docstring). Example::

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, module):
            self.freeze(module.backbone)

        def finetune_function(self, module, epoch, optimizer):
            if epoch == 2:
                self.unfreeze_and_add_param_group(module.backbone, optimizer, train_bn=True)
    """

    def __init__(self) -> None:
        self._internal_optimizer_metadata: Dict[int, List[Dict[str, Any]]] = {}
        self._restarting = False
        self._attached: Optional[tuple] = None  # (trainer, module) from setup: a resume rebuilds groups with them
        self._unsynced: List[nn.Parameter] = []  # frozen when DDP wrapped the model: DDP never averages their grads

    # ---- what a subclass overrides ----------------------------------------------------------------
    def freeze_before_training(self, pl_module: TrainingModule) -> None:
        """Override: freeze what is trained later (``self.freeze(pl_module.backbone)``)."""
        raise NotImplementedError(f"{type(self).__name__} must override freeze_before_training(self, pl_module)")

    def finetune_function(self, pl_module: TrainingModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        """Override: unfreeze on a schedule (``self.unfreeze_and_add_param_group(..., optimizer)``)."""
        raise NotImplementedError(
            f"{type(self).__name__} must override finetune_function(self, pl_module, epoch, optimizer)"
        )

    # ---- helpers (Lightning's static methods) -------------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> List[nn.Module]:
        """The leaf modules of ``modules`` (a module, a ``ModuleDict`` or nested iterables of them), plus the
        parents that hold parameters of their own."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, nn.Module):
            found: Iterable[nn.Module] = modules.modules()
        elif isinstance(modules, Iterable):
            found = [leaf for m in modules for leaf in BaseFinetuning.flatten_modules(m)]
        else:
            raise ConfigurationError(
                f"BaseFinetuning: {modules!r} is not a torch.nn.Module nor an iterable of modules; pass e.g. "
                "pl_module.backbone or [pl_module.encoder, pl_module.decoder]"
            )
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (BatchNorm's skipped
        unless ``train_bn``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for param in module.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreezes ``modules`` (BatchNorm layers track running statistics again)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freezes one module's own parameters (a BatchNorm stops tracking running statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freezes ``modules``; with ``train_bn`` (default) their BatchNorm layers stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> List[nn.Parameter]:
        """``params`` less those already in one of ``optimizer``'s groups (with a warning naming the fix).
        Compared by value, as Lightning compares them (``torch.equal``)."""
        kept, skipped = [], 0
        for param in params:
            if any(torch.equal(p, param) for group in optimizer.param_groups for p in group["params"]):
                skipped += 1
            else:
                kept.append(param)
        if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
            warnings.warn(
                "The provided params to be frozen already exist within another group of this optimizer. Those "
                "parameters will be skipped.\nHINT: Did you init your optimizer in `configure_optimizer` as such:\n"
                f" {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
                stacklevel=3,
            )
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: torch.optim.Optimizer,
        lr: Optional[float] = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreezes ``modules`` and adds their parameters to ``optimizer`` as a new group, with ``lr`` or
        else the first group's learning rate divided by ``initial_denom_lr``."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        )
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom})

    # ---- hooks ------------------------------------------------------------------------------------
    def on_setup(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        _check_strategy(self, trainer)
        self._attached = (trainer, module)
        self.freeze_before_training(module)
        # the model is wrapped after setup: DDP leaves out what is frozen now, and never averages its gradients
        self._unsynced = [p for p in module.parameters() if not p.requires_grad] if trainer.world_size > 1 else []

    def on_before_optimizer_step(
        self, trainer: TrainerView, module: TrainingModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """The gradients of what was unfrozen after DDP wrapped the model, averaged over the ranks as DDP averages
        the others (Lightning leaves them apart: each rank trains its own copy, and the ranks drift)."""
        for param in self._unsynced:
            if param.requires_grad and param.grad is not None:  # the same on every rank: one model, one graph
                param.grad.copy_(trainer.strategy.all_reduce(param.grad, op="mean"))

    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._restarting:  # not rebuilt at load (no setup before it): rebuild now, as Lightning does
            self._rebuild_groups(trainer, module)

    def on_train_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        for index, optimizer in enumerate(trainer.optimizers):
            before = len(optimizer.param_groups)
            self.finetune_function(module, trainer.current_epoch, optimizer)
            self._store(module, index, before, optimizer.param_groups)

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Lightning's ``internal_optimizer_metadata``, plus what was unfrozen (``trainable`` parameter names,
        BatchNorm layers ``tracking`` running statistics): ``freeze_before_training`` freezes again at the
        setup of a resumed fit, and Lightning's resume then trains the unfrozen parts no more (its weights
        drift from the uninterrupted run's); these flags restored, the resume is exact."""
        module = self._attached[1] if self._attached is not None else None
        flags = {} if module is None else _flags(module)
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata, **flags}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loaded before the optimizers' states (trainer/checkpoint/contents.py): the groups added before the
        checkpoint are rebuilt now, so that the optimizer's saved state fits them."""
        metadata = state_dict.get("internal_optimizer_metadata", {})
        self._internal_optimizer_metadata = {int(k): list(v) for k, v in metadata.items()}
        self._restarting = True
        if self._attached is not None:
            trainer, module = self._attached
            _restore_flags(module, state_dict)
            if trainer.optimizers:
                self._rebuild_groups(trainer, module)

    def _rebuild_groups(self, trainer: TrainerView, module: TrainingModule) -> None:
        named = dict(module.named_parameters())
        for index, optimizer in enumerate(trainer.optimizers):
            if index in self._internal_optimizer_metadata:
                optimizer.param_groups = self._groups_of(self._internal_optimizer_metadata[index], named)
        self._restarting = False

    @staticmethod
    def _groups_of(saved: List[Dict[str, Any]], named: Dict[str, Any]) -> List[Dict[str, Any]]:
        missing = sorted({n for group in saved for n in group["params"]} - set(named))
        if missing:
            raise CheckpointError(
                f"BaseFinetuning: the checkpoint's optimizer groups name parameters this module does not have: "
                f"{missing[:5]}; resume with the module that was trained"
            )
        return [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [named[n] for n in g["params"]]} for g in saved
        ]

    def _store(self, module: TrainingModule, index: int, before: int, groups: List[Dict[str, Any]]) -> None:
        names = {p: n for n, p in module.named_parameters()}

        def by_name(part: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
            return [
                {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
                for g in part
            ]

        if index not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[index] = by_name(groups)
        elif before != len(groups):  # groups added by finetune_function: kept with the others
            self._internal_optimizer_metadata[index].extend(by_name(groups[before:]))


def multiplicative(epoch: int) -> float:
    """``BackboneFinetuning``'s default ``lambda_func``: the backbone's learning rate doubles every epoch."""
    return 2.0


class BackboneFinetuning(BaseFinetuning):
    """Lightning's ``BackboneFinetuning``: the module's ``backbone`` is frozen before training and unfrozen at
    ``unfreeze_backbone_at_epoch`` with the learning rate ``backbone_initial_lr`` (default: the first group's times
    ``backbone_initial_ratio_lr``), then multiplied by ``lambda_func(epoch + 1)`` each epoch, and (``should_align``)
    never above the first group's. ``verbose`` logs both rates (``trainforge`` logger, INFO) rounded to
    ``rounding`` digits."""

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: Optional[float] = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        if isinstance(unfreeze_backbone_at_epoch, bool) or not isinstance(unfreeze_backbone_at_epoch, int):
            raise ConfigurationError(
                f"BackboneFinetuning(unfreeze_backbone_at_epoch={unfreeze_backbone_at_epoch!r}) must be an epoch (int)"
            )
        if not callable(lambda_func):
            raise ConfigurationError(
                f"BackboneFinetuning(lambda_func={lambda_func!r}) must be a function of the epoch, e.g. lambda e: 1.5"
            )
        self.unfreeze_backbone_at_epoch, self.lambda_func = unfreeze_backbone_at_epoch, lambda_func
        self.backbone_initial_ratio_lr, self.backbone_initial_lr = backbone_initial_ratio_lr, backbone_initial_lr
        self.should_align, self.initial_denom_lr, self.train_bn = should_align, initial_denom_lr, train_bn
        self.verbose, self.rounding = verbose, rounding
        self.previous_backbone_lr: Optional[float] = None

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict["previous_backbone_lr"]
        super().load_state_dict(state_dict)

    def on_setup(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        if not isinstance(getattr(module, "backbone", None), nn.Module):
            raise ConfigurationError(
                f"BackboneFinetuning: {type(module).__name__} has no torch.nn.Module attribute 'backbone' (the part "
                "it freezes and unfreezes); name it self.backbone, or subclass BaseFinetuning"
            )
        super().on_setup(trainer, module, stage)

    def freeze_before_training(self, pl_module: TrainingModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: TrainingModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            backbone_lr = (
                self.backbone_initial_lr
                if self.backbone_initial_lr is not None
                else current_lr * self.backbone_initial_ratio_lr
            )
            self.unfreeze_and_add_param_group(
                pl_module.backbone,
                optimizer,
                backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
        elif epoch > self.unfreeze_backbone_at_epoch and self.previous_backbone_lr is not None:
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
        else:
            return
        self.previous_backbone_lr = backbone_lr
        if self.verbose:
            log.info(
                "Current lr: %s, Backbone lr: %s", round(current_lr, self.rounding), round(backbone_lr, self.rounding)
            )


def _flags(module: nn.Module) -> Dict[str, List[str]]:
    return {
        "trainable": [name for name, p in module.named_parameters() if p.requires_grad],
        "tracking": [name for name, m in module.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats],
    }


def _restore_flags(module: nn.Module, state: Dict[str, Any]) -> None:
    """The saved ``requires_grad`` and BatchNorm tracking flags (absent from Lightning's checkpoints: kept as
    ``freeze_before_training`` left them, as Lightning does)."""
    if "trainable" in state:
        trainable = set(state["trainable"])
        for name, param in module.named_parameters():
            param.requires_grad = name in trainable
    if "tracking" in state:
        tracking = set(state["tracking"])
        for name, sub in module.named_modules():
            if isinstance(sub, _BatchNorm):
                sub.track_running_stats = name in tracking


def _check_strategy(callback: BaseFinetuning, trainer: TrainerView) -> None:
    """DeepSpeed is refused (as Lightning refuses it); on several processes, DDP only (see on_before_optimizer_step)."""
    names = {cls.__name__ for cls in type(trainer.strategy).__mro__}
    if "DeepSpeedStrategy" in names:
        raise ConfigurationError(
            f"{type(callback).__name__} (BaseFinetuning) cannot run under DeepSpeed, which builds its own optimizer "
            "from the parameters at setup and takes no groups added later (Lightning refuses it too): use "
            "strategy='ddp', or leave this callback out"
        )
    if trainer.world_size > 1 and "DDPStrategy" not in names:
        raise ConfigurationError(
            f"{type(callback).__name__} (BaseFinetuning) on {trainer.world_size} processes needs strategy='ddp': "
            f"under {type(trainer.strategy).__name__} the parameters unfrozen after the model is wrapped would not "
            "be reduced like the others. Use strategy='ddp', or one process"
        )
