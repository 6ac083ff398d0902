"""``lightning.pytorch.loggers`` (``pytorch_lightning.loggers``): ``from lightning.pytorch.loggers import
CSVLogger`` becomes ``from trainforge.lightning.loggers import CSVLogger``. ``CSVLogger`` and ``TensorBoardLogger``
take Lightning's arguments and write Lightning's files (``<save_dir>/<name>/version_<N>/``: ``metrics.csv``,
``hparams.yaml``, the event files); the other trackers are trainforge's, under Lightning's names (``MLFlowLogger``),
with the arguments docs/guides/lightning.md lists. ``Logger`` is the trackers' base class."""

from trainforge.callbacks.trackers.base import TrackerCallback as Logger
from trainforge.callbacks.trackers.comet import CometLogger
from trainforge.callbacks.trackers.csv import CSVLogger
from trainforge.callbacks.trackers.mlflow import MLflowLogger as MLFlowLogger
from trainforge.callbacks.trackers.tensorboard import TensorBoardLogger
from trainforge.callbacks.trackers.wandb import WandbLogger

__all__ = ["CSVLogger", "CometLogger", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
