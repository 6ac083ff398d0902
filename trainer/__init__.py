"""The loop floor: Trainer, TrainingModule, Accelerator and what they need (``trainforge.trainer``).
Users import these names from ``trainforge`` itself."""

from trainforge.strategies.errors import CheckpointError, ConfigurationError, LaunchError, TrainforgeError
from trainforge.strategies.materialize import load_pretrained
from trainforge.strategies.precision import PRECISIONS, Precision
from trainforge.trainer.accelerate_state import DistributedType, PartialState
from trainforge.trainer.accelerate_utils import find_executable_batch_size, skip_first_batches
from trainforge.trainer.accelerator import Accelerator
from trainforge.trainer.datamodule import DataModule
from trainforge.trainer.events import Event
from trainforge.trainer.module import TrainingModule
from trainforge.trainer.preemption import TrainingStopped
from trainforge.trainer.seed import seed_everything
from trainforge.trainer.trainer import Trainer
from trainforge.trainer.tuner import Tuner


def notebook_launcher(*args, **kwargs):  # noqa: D103 - documented in trainforge.trainer.notebook
    from trainforge.trainer.notebook import notebook_launcher as launch

    return launch(*args, **kwargs)


__all__ = [
    "Trainer",
    "Tuner",
    "TrainingModule",
    "DataModule",
    "Accelerator",
    "DistributedType",  # and the next three: accelerate's top-level names (also in trainforge.utils)
    "PartialState",
    "skip_first_batches",
    "find_executable_batch_size",
    "Event",
    "Precision",
    "PRECISIONS",
    "seed_everything",
    "load_pretrained",
    "notebook_launcher",
    "TrainforgeError",
    "ConfigurationError",
    "CheckpointError",
    "LaunchError",
    "TrainingStopped",
]
