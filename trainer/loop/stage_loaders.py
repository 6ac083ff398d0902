"""Which DataLoaders a stage runs on: those given, else the datamodule's, else the module's own
(``train_dataloader()``, ``val_dataloader()``, ...), with the datamodule's ``prepare_data``/``setup`` run
first, as Lightning does. ``StageLoaders`` is a part the Trainer builds and calls with the module and
the stage; it keeps the datamodule it set up (``trainer.datamodule``)."""

from __future__ import annotations

from typing import Any, List, Sized, cast

import torch

from trainforge.strategies import Strategy
from trainforge.strategies.errors import ConfigurationError

_LOADER_METHODS = {
    "fit": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


class StageLoaders:
    """The Trainer's loaders of a stage and the datamodule it set up (one per Trainer at a time)."""

    def __init__(self, strategy: Strategy, owner: Any) -> None:
        # owner: the Trainer, handed to the datamodule as Lightning's ``datamodule.trainer``
        self.strategy, self.owner = strategy, owner
        self.datamodule: Any = None

    def prepare_data(self, datamodule: Any, module: Any) -> None:
        """Lightning's ``prepare_data``: the datamodule's (once, when it is new to this Trainer), then the
        module's (at every stage, when it defines one), on local rank 0 of each node; the others wait."""
        from trainforge.trainer.loop.step_hooks import overridden

        calls = []
        if datamodule is not None and datamodule is not self.datamodule:
            calls.append(datamodule.prepare_data)
        if module is not None and overridden(module, "prepare_data"):
            calls.append(module.prepare_data)
        if not calls:
            return
        if self.strategy.local_rank == 0:
            for call in calls:
                call()
        self.strategy.barrier()

    def setup_datamodule(self, datamodule: Any, stage: str) -> None:
        """The datamodule's ``setup(stage)``, once per datamodule (its ``prepare_data`` ran before)."""
        if datamodule is self.datamodule:
            return
        self.datamodule = datamodule
        datamodule.trainer = self.owner
        datamodule.setup(stage)

    def loaders_for(
        self, stage: str, given: Any, datamodule: Any, module: Any, fitting: bool, required: bool = True
    ) -> List[Any]:
        """The loaders a stage runs on: given, else the datamodule's, else the module's own.
        ``fitting``: validation loaders asked for inside fit set the datamodule up for "fit"."""
        if given is not None:
            return as_list(given)
        method = _LOADER_METHODS[stage]
        source = datamodule if datamodule is not None else module
        if datamodule is not None:
            self.prepare_data(datamodule, None)
            self.setup_datamodule(datamodule, "fit" if stage == "validate" and fitting else stage)
        if not callable(getattr(source, method, None)):
            if not required:
                return []
            arg = "train_dataloaders" if stage == "fit" else "dataloaders"
            raise ConfigurationError(
                f"Trainer.{stage}() got no {arg}: pass them, pass datamodule=..., or define "
                f"{type(module).__name__}.{method}()"
            )
        try:
            loaders = getattr(source, method)()
        except NotImplementedError:
            if not required:
                return []
            raise
        return as_list(loaders)


def check_loader(loader: Any, name: str) -> None:
    """A DataLoader with data (an empty one would train or validate on nothing, silently)."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ConfigurationError(f"{name} must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
    try:
        empty = len(loader) == 0
    except TypeError:
        # an IterableDataset without a length
        return
    if empty:
        raise ConfigurationError(
            f"{name} is empty (len == 0, dataset of {len(cast(Sized, loader.dataset))} samples with "
            f"batch_size={loader.batch_size}, drop_last={loader.drop_last}); give it data"
        )


def as_list(loaders: Any) -> List[Any]:
    """One loader or a list or tuple of them, as a list (``None``: none)."""
    if loaders is None:
        return []
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
