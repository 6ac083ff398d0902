"""``TrainingModule``: the user's model, its steps and its optimizers (an ``nn.Module``).

It also receives every lifecycle event first, through the Trainer's one dispatcher, with
Lightning's hook signatures (``trainer/hooks.py``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

import torch
from torch import nn

from trainforge.strategies.errors import TrainforgeError, check_metric_name
from trainforge.trainer.hooks import ModuleHooks

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.trainer import Trainer


class TrainingModule(ModuleHooks, nn.Module):
    """Subclass it; implement ``training_step`` and ``configure_optimizers`` (the rest is optional).

    ``configure_optimizers`` returns an optimizer, ``(optimizer, scheduler)``, or
    ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched, "interval": "step"|"epoch",
    "frequency": 1, "name": ...}}``."""

    _trainer: Optional["Trainer"]  # set with object.__setattr__: not a submodule

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_trainer", None)  # not a submodule, not in state_dict
        self.hparams: Dict[str, Any] = {}

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

    # ---- what users call -----------------------------------------------------------------------
    @property
    def trainer(self) -> "Trainer":
        if self._trainer is None:
            raise TrainforgeError(
                f"{type(self).__name__} is not attached to a Trainer; "
                "self.trainer, self.log and friends work inside Trainer.fit/validate/test/predict"
            )
        return self._trainer

    @property
    def device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return self._trainer.device if self._trainer is not None else torch.device("cpu")

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    def save_hyperparameters(self, *names: str, **values: Any) -> None:
        """Record ``__init__`` arguments (all, or those named) plus ``values`` in ``self.hparams``."""
        frame = sys._getframe(1)  # the caller's: its __init__
        init_args = {
            k: v for k, v in frame.f_locals.items() if k not in ("self", "__class__") and not k.startswith("_")
        }
        if names:
            init_args = {k: init_args[k] for k in names}
        self.hparams.update(init_args)
        self.hparams.update(values)

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
    ) -> None:
        """Record a scalar. In training the default is per step; in validation/test per epoch, where
        the epoch value is ``reduce_fx`` over batches ("mean": weighted by batch size; "sum", "max",
        "min"), with ``sync_dist`` over all ranks too. ``rank_zero_only``: logged from rank 0 only, never
        synced; ``logger=False``: in ``trainer.callback_metrics`` but not sent to the trackers. In an
        epoch-end hook the value is logged for that epoch (see ``trainer/metric_logging.py``)."""
        if type(name) is not str or not name.strip():
            check_metric_name(name, "self.log(name)")
        self.trainer._log(
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
        )

    # ---- manual optimization (Lightning's automatic_optimization = False; trainer/manual.py) -----
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
