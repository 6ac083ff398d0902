"""Which DataLoaders a stage runs on: those given, else the datamodule's, else the module's own
(``train_dataloader()``, ``val_dataloader()``, ...), with the datamodule's ``prepare_data``/``setup`` run
first, as Lightning does. Mixed into ``Trainer``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sized, cast

import torch

from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies import Strategy
    from trainforge.trainer.module.training_module import TrainingModule


class StageLoaders:
    """Mixed into ``Trainer``: reads and sets the Trainer's own ``datamodule``."""

    if TYPE_CHECKING:  # the Trainer's, for the type checker
        strategy: Strategy
        module: Optional[TrainingModule]
        datamodule: Any
        stage: str

    def _setup_datamodule(self, datamodule: Any, stage: str) -> None:
        if datamodule is self.datamodule:
            return
        self.datamodule = datamodule
        datamodule.trainer = self  # Lightning's datamodule.trainer
        if self.strategy.local_rank == 0:
            datamodule.prepare_data()  # once per node; the other processes wait
        self.strategy.barrier()
        datamodule.setup(stage)

    def _loaders_for(self, stage: str, given: Any, datamodule: Any, required: bool = True) -> List[Any]:
        """The loaders a stage runs on: given, else the datamodule's, else the module's own."""
        if given is not None:
            return as_list(given)
        method = {
            "fit": "train_dataloader",
            "validate": "val_dataloader",
            "test": "test_dataloader",
            "predict": "predict_dataloader",
        }[stage]
        source = datamodule if datamodule is not None else self.module
        if datamodule is not None:
            self._setup_datamodule(datamodule, "fit" if stage == "validate" and self.stage == "fit" else stage)
        if not callable(getattr(source, method, None)):
            if not required:
                return []
            arg = "train_dataloaders" if stage == "fit" else "dataloaders"
            raise ConfigurationError(
                f"Trainer.{stage}() got no {arg}: pass them, pass datamodule=..., or define "
                f"{type(self.module).__name__}.{method}()"
            )
        try:
            loaders = getattr(source, method)()
        except NotImplementedError:
            if not required:
                return []
            raise
        return as_list(loaders)

    @staticmethod
    def _check_loader(loader: Any, name: str) -> None:
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise ConfigurationError(f"{name} must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
        try:
            empty = len(loader) == 0
        except TypeError:
            return  # an IterableDataset without a length
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
