"""Callbacks: checkpointing, tracking, monitoring, progress. Imported lazily, so a tracker's
backend library is needed only when that tracker is used."""
from __future__ import annotations

import importlib
from typing import Any

from callbacks.base import Callback

_EXPORTS = {
    "ModelCheckpoint": "callbacks.checkpoint",
    "ProgressBar": "callbacks.progress",
    "EarlyStopping": "callbacks.early_stopping",
    "LearningRateMonitor": "callbacks.lr_monitor",
    "GradientNormMonitor": "callbacks.grad_norm",
    "MemoryMonitor": "callbacks.memory",
    "MemoryLeakWarning": "callbacks.memory",
    "ThroughputMonitor": "callbacks.throughput",
    "Timer": "callbacks.timer",
    "RNGSync": "callbacks.rng_sync",
    "TrackerCallback": "callbacks.trackers.base",
    "FailurePolicy": "callbacks.trackers.base",
    "TrackerWarning": "callbacks.trackers.base",
    "CSVLogger": "callbacks.trackers.csv",
    "MLflowLogger": "callbacks.trackers.mlflow",
    "CometLogger": "callbacks.trackers.comet",
    "TensorBoardLogger": "callbacks.trackers.tensorboard",
}

__all__ = ["Callback", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'callbacks' has no attribute {name!r}")
