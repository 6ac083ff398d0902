"""Experiment trackers (callbacks): MLflow, Comet, TensorBoard, CSV and Weights & Biases, with one failure policy.

Backends are imported lazily, when a tracker is constructed, so this package imports without them.
"""

from trainforge.callbacks.trackers.base import FailurePolicy, TrackerCallback, TrackerWarning
from trainforge.callbacks.trackers.comet import CometLogger
from trainforge.callbacks.trackers.csv import CSVLogger
from trainforge.callbacks.trackers.mlflow import MLflowLogger
from trainforge.callbacks.trackers.tensorboard import TensorBoardLogger
from trainforge.callbacks.trackers.wandb import WandbLogger

__all__ = [
    "CSVLogger",
    "CometLogger",
    "FailurePolicy",
    "MLflowLogger",
    "TensorBoardLogger",
    "TrackerCallback",
    "TrackerWarning",
    "WandbLogger",
]
