"""``DataModule``: Lightning's LightningDataModule -- the data of a run in one object.

``fit/validate/test/predict(module, datamodule=dm)`` call ``prepare_data()`` on one process per
node (local rank 0; the others wait), then ``setup(stage)``, then the stage's ``*_dataloader()``.
``state_dict``/``load_state_dict`` are saved in Trainer checkpoints and restored on resume.
"""

from __future__ import annotations

from typing import Any, Dict


class DataModule:
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
