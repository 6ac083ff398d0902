"""Lightning's names for trainforge's classes, so that a Lightning program changes only its import lines:
``import lightning as L`` / ``import pytorch_lightning as pl`` becomes ``import trainforge.lightning as L``
(``as pl``), and ``L.LightningModule``, ``L.LightningDataModule``, ``L.Trainer``, ``L.Callback``,
``L.seed_everything`` keep working; ``from lightning.pytorch import Trainer, LightningModule`` becomes
``from trainforge.lightning import ...``. The classes are trainforge's own (``TrainingModule`` is the
LightningModule); docs/guides/lightning.md ("Coming from Lightning") lists what they take and where they differ.

A submodule, not top-level names: ``trainforge`` itself keeps one name per thing. Lightning's modules map to
this package's: ``lightning.pytorch.utilities`` (``rank_zero_only``...) -> ``trainforge.lightning.utilities``,
``lightning.pytorch.cli`` -> ``trainforge.lightning.cli``, ``lightning.pytorch.demos`` ->
``trainforge.lightning.demos``; ``lightning.pytorch.callbacks`` -> ``trainforge.callbacks``."""

from trainforge.callbacks import Callback
from trainforge.trainer import DataModule as LightningDataModule
from trainforge.trainer import Trainer, seed_everything
from trainforge.trainer import TrainingModule as LightningModule

__all__ = ["LightningModule", "LightningDataModule", "Trainer", "Callback", "seed_everything"]
