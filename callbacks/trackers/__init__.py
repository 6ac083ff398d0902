"""Experiment trackers (callbacks): MLflow, Comet, TensorBoard and CSV, with one failure policy.

Backends are imported lazily, when a tracker is constructed, so this package imports without them.
"""
from callbacks.trackers.base import FailurePolicy, TrackerCallback, TrackerWarning
from callbacks.trackers.comet import CometLogger
from callbacks.trackers.csv import CSVLogger
from callbacks.trackers.mlflow import MLflowLogger
from callbacks.trackers.tensorboard import TensorBoardLogger

__all__ = [
    "CSVLogger",
    "CometLogger",
    "FailurePolicy",
    "MLflowLogger",
    "TensorBoardLogger",
    "TrackerCallback",
    "TrackerWarning",
]
