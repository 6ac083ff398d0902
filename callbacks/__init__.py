"""Callbacks: checkpointing, tracking, monitoring, progress. Imported lazily, so a tracker's
backend library is needed only when that tracker is used."""

from __future__ import annotations

import importlib
from typing import Any

from trainforge.callbacks.base import Callback
from trainforge.callbacks.view import TrainerView

_EXPORTS = {
    "ModelCheckpoint": "trainforge.callbacks.checkpoint",
    "ProgressBar": "trainforge.callbacks.progress",
    "EarlyStopping": "trainforge.callbacks.early_stopping",
    "LearningRateMonitor": "trainforge.callbacks.lr_monitor",
    "GradientNormMonitor": "trainforge.callbacks.grad_norm",
    "MemoryMonitor": "trainforge.callbacks.memory",
    "MemoryLeakWarning": "trainforge.callbacks.memory",
    "ThroughputMonitor": "trainforge.callbacks.throughput",
    "Timer": "trainforge.callbacks.timer",
    "PyTorchProfiler": "trainforge.callbacks.profiler",
    "SimpleProfiler": "trainforge.callbacks.profiler",
    "HangWatchdog": "trainforge.callbacks.hang_watchdog",
    "RNGSync": "trainforge.callbacks.rng_sync",
    "ModelSummary": "trainforge.callbacks.model_summary",
    "WeightAveraging": "trainforge.callbacks.weight_averaging",
    "BaseFinetuning": "trainforge.callbacks.finetuning",
    "BackboneFinetuning": "trainforge.callbacks.finetuning",
    "RichModelSummary": "trainforge.callbacks.rich_display",
    "RichProgressBar": "trainforge.callbacks.rich_display",
    "LossSpikes": "trainforge.callbacks.loss_spikes",
    "EMAWeightAveraging": "trainforge.callbacks.weight_averaging",
    "TrackerCallback": "trainforge.callbacks.trackers.base",
    "FailurePolicy": "trainforge.callbacks.trackers.base",
    "TrackerWarning": "trainforge.callbacks.trackers.base",
    "CSVLogger": "trainforge.callbacks.trackers.csv",
    "MLflowLogger": "trainforge.callbacks.trackers.mlflow",
    "CometLogger": "trainforge.callbacks.trackers.comet",
    "TensorBoardLogger": "trainforge.callbacks.trackers.tensorboard",
    "WandbLogger": "trainforge.callbacks.trackers.wandb",
}

__all__ = ["Callback", "TrainerView", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainforge.callbacks' has no attribute {name!r}")
