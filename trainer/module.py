"""``TrainingModule``: the user's model, its steps and its optimizers (an ``nn.Module``).

It also receives every lifecycle event first (it inherits the Callback hooks), so there is one
hook mechanism for modules and callbacks.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

import torch
from torch import nn

from callbacks.base import Callback
from strategies.errors import TrainforgeError, check_metric_name

if TYPE_CHECKING:  # pragma: no cover
    from trainer.trainer import Trainer


class TrainingModule(nn.Module, Callback):
    """Subclass it; implement ``training_step`` and ``configure_optimizers`` (the rest is optional).

    ``configure_optimizers`` returns an optimizer, ``(optimizer, scheduler)``, or
    ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched, "interval": "step"|"epoch",
    "frequency": 1, "name": ...}}``."""

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

    # ---- what users call -----------------------------------------------------------------------
    @property
    def trainer(self) -> "Trainer":
        if self._trainer is None:
            raise TrainforgeError(f"{type(self).__name__} is not attached to a Trainer; "
                                  "self.trainer, self.log and friends work inside Trainer.fit/validate/test/predict")
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
        frame = inspect.currentframe().f_back
        init_args = {k: v for k, v in frame.f_locals.items() if k not in ("self", "__class__") and not k.startswith("_")}
        if names:
            init_args = {k: init_args[k] for k in names}
        self.hparams.update(init_args)
        self.hparams.update(values)

    def log(self, name: str, value: Any, *, on_step: Optional[bool] = None, on_epoch: Optional[bool] = None,
            prog_bar: bool = False, sync_dist: bool = False, batch_size: Optional[int] = None) -> None:
        """Record a scalar. In training the default is per step; in validation/test per epoch, where
        the epoch value is the mean over batches weighted by batch size (``sync_dist``: over all ranks)."""
        if type(name) is not str or not name.strip():
            check_metric_name(name, "self.log(name)")
        self.trainer._log(name, value, on_step=on_step, on_epoch=on_epoch, prog_bar=prog_bar,
                          sync_dist=sync_dist, batch_size=batch_size)

    def log_dict(self, metrics: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # nn.Module and Callback both define state_dict/load_state_dict: the module's (weights) win by
    # the MRO, which is what users and checkpoints expect.
    state_dict = nn.Module.state_dict
    load_state_dict = nn.Module.load_state_dict
