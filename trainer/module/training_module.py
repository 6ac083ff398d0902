"""``TrainingModule``: the user's model, its steps and its optimizers (an ``nn.Module``).

It also receives every lifecycle event first, through the Trainer's one dispatcher, with
Lightning's hook signatures (``trainer/loop/module_hooks.py``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Type, TypeVar

import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError, TrainforgeError, check_metric_name
from trainforge.trainer.checkpoint.module_checkpoint import class_only, init_arguments, load_weights, read_checkpoint
from trainforge.trainer.loop.manual import ManualOptimizer
from trainforge.trainer.loop.module_hooks import ModuleHooks
from trainforge.trainer.loop.step_hooks import LoopHooks
from trainforge.trainer.module.export import export_onnx, export_torchscript, module_all_gather
from trainforge.trainer.module.hparams import AttributeDict, HyperparametersMixin

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.loop.trainer import Trainer

M = TypeVar("M", bound="TrainingModule")


class TrainingModule(ModuleHooks, LoopHooks, HyperparametersMixin, nn.Module):
    """The model to train, its steps and its optimizers: an ``nn.Module`` that the ``Trainer`` runs.

    Subclass it; implement ``training_step(batch, batch_idx)``, which returns the loss (a tensor, a dict with
    a ``"loss"`` key, or None to skip the batch), and ``configure_optimizers()``; ``validation_step``, ``test_step``, ``predict_step`` and
    every lifecycle hook are optional. The constructor takes no arguments: call ``super().__init__()`` first,
    then build the layers (or build them in ``configure_model`` to create them only when a run starts).

    ``configure_optimizers`` returns an optimizer, ``(optimizer, scheduler)``, or
    ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched, "interval": "step"|"epoch",
    "frequency": 1, "name": ...}}``. It runs after the strategy has placed and wrapped the module, so it sees
    the final device and parameters.

    The module receives every lifecycle event first, before the callbacks, with Lightning's hook signatures
    (``on_train_epoch_end(self)``, ...). Inside a step, ``self.log(name, value)`` records a metric,
    ``self.trainer``, ``self.device``, ``self.global_step`` and ``self.current_epoch`` describe the run, and
    with ``self.automatic_optimization = False`` the step drives its optimizers itself (``self.optimizers()``,
    ``self.manual_backward(loss)``). ``save_hyperparameters()`` records the subclass's constructor arguments,
    so ``load_from_checkpoint`` can build it again from a checkpoint.
    """

    _trainer: Optional[Trainer]  # set with object.__setattr__: not a submodule

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_trainer", None)  # not a submodule, not in state_dict
        self.hparams: Any = AttributeDict()  # save_hyperparameters (trainer/module/hparams.py)

    # ---- what users implement ------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError

    def configure_model(self) -> None:
        """Build layers here (or in ``setup(stage)``) to create them only when a run starts (Lightning):
        called after ``setup``, before the model is placed and ``configure_optimizers`` runs, on
        every ``fit``/``validate``/``test``/``predict``, so it must not rebuild what exists."""

    @classmethod
    def load_from_checkpoint(
        cls: Type[M],
        checkpoint_path: Any,
        map_location: Any = None,
        hparams_file: Any = None,
        strict: Optional[bool] = None,
        weights_only: Optional[bool] = None,
        **kwargs: Any,
    ) -> M:
        """A new module from a trainforge checkpoint directory or a Lightning ``.ckpt`` file, built
        with the hyperparameters it saved (``self.save_hyperparameters()``), ``kwargs`` replacing
        them, then given its weights (``trainer/checkpoint/module_checkpoint.py``)."""
        loaded = read_checkpoint(checkpoint_path, map_location, hparams_file, weights_only)
        module = cls(**init_arguments(cls, loaded, kwargs))
        if type(module).configure_model is not TrainingModule.configure_model:
            module.configure_model()
        module.on_load_checkpoint(loaded.checkpoint)
        load_weights(module, loaded, strict)
        return module

    if not TYPE_CHECKING:  # called on an instance it is an error, as in Lightning
        load_from_checkpoint = class_only(load_from_checkpoint)

    # ---- what users call -----------------------------------------------------------------------
    @property
    def trainer(self) -> Trainer:
        if self._trainer is None and not self.__dict__.get("_jit_is_scripting"):
            raise TrainforgeError(
                f"{type(self).__name__} is not attached to a Trainer; "
                "self.trainer, self.log and friends work inside Trainer.fit/validate/test/predict"
            )
        # None only while torch.jit reads the attributes (to_torchscript), as in Lightning
        return self._trainer  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return self._trainer.device if self._trainer is not None else torch.device("cpu")

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def logger(self) -> Any:
        """The trainer's first tracker (Lightning's ``self.logger``; ``.experiment`` is its backend object:
        ``callbacks/trackers/experiment.py``), or None without a trainer or with ``logger=False``."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> List[Any]:
        """Every tracker of the trainer (Lightning's ``self.loggers``); [] without a trainer."""
        return list(self._trainer.loggers) if self._trainer is not None else []

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: Optional[bool] = None,
        on_epoch: Optional[bool] = None,
        prog_bar: bool = False,
        sync_dist: bool = False,
        batch_size: Optional[int] = None,
        reduce_fx: str = "mean",
        rank_zero_only: bool = False,
        logger: bool = True,
        add_dataloader_idx: bool = True,
    ) -> None:
        """Record a scalar metric, with Lightning's rules.

        Every logged value is in ``trainer.callback_metrics`` at once (callbacks such as ``ModelCheckpoint``
        and ``EarlyStopping`` monitor it there) and is sent to the trackers (the LOG event). In training the
        default is per step; in validation/test per epoch, where the epoch value is ``reduce_fx`` over the
        batches. In an epoch-end hook the value is logged for that epoch. With ``on_step=True`` and
        ``on_epoch=True`` the two are ``<name>_step`` and ``<name>_epoch``. A ``torchmetrics.Metric``
        (an attribute of the module) is logged as Lightning logs it: its ``compute()`` over every rank at
        the epoch end.

        Args:
            name: the metric's name, e.g. ``"train/loss"`` (a non-empty string; ``/`` groups it in the
                trackers).
            value: a scalar: a 0-d tensor, a Python number, or a ``torchmetrics.Metric``.
            on_step: record the value of each step. Default None: True in training, False in
                validation/test.
            on_epoch: accumulate the value over the epoch and record the epoch's value at its end.
                Default None: False in training, True in validation/test.
            prog_bar: also show it in the progress bar (``trainer.progress_bar_metrics``); default False.
            sync_dist: reduce the value over all ranks with ``reduce_fx`` (default False: each rank keeps its
                own value). Not applied to a ``torchmetrics.Metric``, which syncs itself.
            batch_size: the batch's size, for the epoch mean weighted by batch size (default None: read
                from the batch).
            reduce_fx: how the epoch value (and ``sync_dist``) combines values: ``"mean"`` (default,
                weighted by batch size), ``"sum"``, ``"max"`` or ``"min"``.
            rank_zero_only: the value is logged from rank 0 only and never synced (default False).
            logger: send it to the trackers (default True); False keeps it in ``trainer.callback_metrics``
                only.
            add_dataloader_idx: with several evaluation loaders, add Lightning's ``/dataloader_idx_N``
                suffix to the name (default True), so each loader's values stay apart.
        """
        if type(name) is not str or not name.strip():
            check_metric_name(name, "self.log(name)")
        if type(add_dataloader_idx) is not bool:
            raise ConfigurationError(f"self.log(add_dataloader_idx={add_dataloader_idx!r}) must be True or False")
        self.trainer.log_value(
            name,
            value,
            on_step=on_step,
            on_epoch=on_epoch,
            prog_bar=prog_bar,
            sync_dist=sync_dist,
            batch_size=batch_size,
            reduce_fx=reduce_fx,
            rank_zero_only=rank_zero_only,
            logger=logger,
            add_dataloader_idx=add_dataloader_idx,
        )

    # ---- manual optimization (Lightning's automatic_optimization = False; trainer/loop/manual.py) -----
    @property
    def automatic_optimization(self) -> bool:
        value: bool = self.__dict__.get("_automatic_optimization", True)
        return value

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self.__dict__["_automatic_optimization"] = bool(value)

    def optimizers(self) -> Any:
        """The prepared optimizer(s): one object, or a list when configure_optimizers returned several."""
        opts = self.trainer.manual_optimizers()
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        """The scheduler(s) from configure_optimizers: None, one, or a list."""
        scheds = [cfg["scheduler"] for cfg in self.trainer.lr_scheduler_configs]
        return None if not scheds else scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the strategy (scaling, DDP sync, DeepSpeed engine)."""
        self.trainer.manual_backward(loss)

    def log_dict(self, metrics: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the global-zero process only (every process when not attached to a Trainer)."""
        if self._trainer is None or self._trainer.is_global_zero:
            print(*args, **kwargs)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every tensor of ``data`` from all processes, stacked on a new first dim of size world_size
        (one process: unchanged, as in Lightning); ``sync_grads``: gradients flow back to each rank's part."""
        return module_all_gather(self, data, group, sync_grads)

    def freeze(self) -> None:
        """No parameter requires gradients, and the module is in eval mode."""
        for param in self.parameters():
            param.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Every parameter requires gradients, and the module is in train mode."""
        for param in self.parameters():
            param.requires_grad = True
        self.train()

    def to_torchscript(
        self, file_path: Any = None, method: str = "script", example_inputs: Any = None, **kwargs: Any
    ) -> Any:
        """The module as TorchScript (``torch.jit.script`` or, with ``method="trace"``, ``torch.jit.trace``
        on ``example_inputs`` or ``self.example_input_array``), saved to ``file_path`` when given."""
        return export_torchscript(self, file_path, method, example_inputs, **kwargs)

    def to_onnx(self, file_path: Any, input_sample: Any = None, **kwargs: Any) -> Any:
        """``torch.onnx.export`` of the module on ``input_sample`` (default ``self.example_input_array``)."""
        return export_onnx(self, file_path, input_sample, **kwargs)

    def to_tensorrt(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigurationError(
            f"{type(self).__name__}.to_tensorrt: trainforge does not build TensorRT engines; compile the trained "
            "module with torch_tensorrt.compile(module, inputs=[...]) (pip install torch-tensorrt) instead"
        )

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clip the gradients of ``optimizer``'s parameters (after ``manual_backward``, before
        ``step``), by total norm (``"norm"``, the default) or by value, through the strategy: under
        FSDP/Megatron the norm is that of the whole model, AMP gradients are unscaled first.
        ``gradient_clip_val`` None or 0: no clipping (Lightning)."""
        self.trainer.clip_optimizer_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Lightning's hook: called by the automatic loop on every optimizer step, after
        ``on_before_optimizer_step`` (AMP gradients already unscaled), with the Trainer's
        ``gradient_clip_val``/``gradient_clip_algorithm``. Override it to clip your own way (per
        parameter group, a value computed from the step...), typically through
        ``self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm=...)``.
        This default clips as the Trainer's settings say. Not called under manual optimization."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters require gradients until ``untoggle_optimizer(optimizer)``:
        those of the other optimizers are frozen (their ``requires_grad`` is kept and restored)."""
        raw = self._own_optimizer(optimizer, "toggle_optimizer")
        saved: Dict[torch.nn.Parameter, bool] = self.__dict__.get("_toggle_saved") or {}
        if not saved:  # toggling again before untoggling keeps the states from before the first toggle
            for opt in self.trainer.optimizers:
                for group in opt.param_groups:
                    for param in group["params"]:
                        saved.setdefault(param, param.requires_grad)
        for opt in self.trainer.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    param.requires_grad = False
        for group in raw.param_groups:
            for param in group["params"]:
                param.requires_grad = saved[param]
        self.__dict__["_toggle_saved"], self.__dict__["_toggled"] = saved, raw

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Undo ``toggle_optimizer(optimizer)``: every parameter gets its ``requires_grad`` back."""
        raw = self._own_optimizer(optimizer, "untoggle_optimizer")
        toggled = self.__dict__.get("_toggled")
        if toggled is None:
            return
        if toggled is not raw:
            raise ConfigurationError(
                f"untoggle_optimizer({type(raw).__name__}) but the toggled optimizer is another one "
                f"({type(toggled).__name__}, optimizer {self._index_of(toggled)}); untoggle the one you toggled"
            )
        for param, requires_grad in self.__dict__["_toggle_saved"].items():
            param.requires_grad = requires_grad
        self.__dict__["_toggle_saved"], self.__dict__["_toggled"] = {}, None

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``with self.toggled_optimizer(opt):`` toggles it inside the block (Lightning 2.5)."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def _own_optimizer(self, optimizer: Any, what: str) -> torch.optim.Optimizer:
        raw: torch.optim.Optimizer = optimizer.optimizer if isinstance(optimizer, ManualOptimizer) else optimizer
        optimizers: List[torch.optim.Optimizer] = list(self.trainer.optimizers)
        if not any(raw is opt for opt in optimizers):
            raise ConfigurationError(
                f"{what}({type(optimizer).__name__}): not one of the optimizers of this run (give one that "
                f"self.optimizers() returns; configure_optimizers built {len(optimizers)})"
            )
        return raw

    def _index_of(self, optimizer: Any) -> int:
        return next(i for i, opt in enumerate(self.trainer.optimizers) if opt is optimizer)
