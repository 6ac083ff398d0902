"""``DataModule``: Lightning's LightningDataModule -- the data of a run in one object.

``fit/validate/test/predict(module, datamodule=dm)`` call ``prepare_data()`` on one process per
node (local rank 0; the others wait), then ``setup(stage)``, then the stage's ``*_dataloader()``.
``state_dict``/``load_state_dict`` are saved in Trainer checkpoints and restored on resume.
``self.trainer`` is the Trainer using it (None before); ``self.save_hyperparameters()`` and
``self.hparams`` work as in a ``TrainingModule`` (``trainer/module/hparams.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from trainforge.trainer.module.hparams import AttributeDict, HyperparametersMixin

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.loop.trainer import Trainer


class DataModule(HyperparametersMixin):
    trainer: Optional[Trainer] = None  # set by the Trainer that uses it (Lightning's)

    @property
    def hparams(self) -> Any:
        """What ``save_hyperparameters`` recorded: ``self.hparams.batch_size``, ``self.hparams["batch_size"]``."""
        if "_hparams" not in vars(self):  # also when a subclass's __init__ does not call super().__init__()
            vars(self)["_hparams"] = AttributeDict()
        return vars(self)["_hparams"]

    @hparams.setter
    def hparams(self, value: Any) -> None:
        vars(self)["_hparams"] = value

    def prepare_data(self) -> None:
        """Download or write data to disk; runs on one process per node. Do not set state here."""

    def setup(self, stage: str) -> None:
        """Build datasets for ``stage`` ("fit", "validate", "test" or "predict"); runs on every process."""

    def teardown(self, stage: str) -> None: ...

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement train_dataloader()")

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement test_dataloader()")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement predict_dataloader()")

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass
