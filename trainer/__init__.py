"""The loop floor: Trainer, TrainingModule, Accelerator and what they need (``trainforge.trainer``).
Users import these names from ``trainforge`` itself."""

from trainforge.callbacks.events import Event
from trainforge.strategies.errors import CheckpointError, ConfigurationError, LaunchError, TrainforgeError
from trainforge.strategies.materialize import load_pretrained
from trainforge.strategies.precision import PRECISIONS, Precision
from trainforge.trainer.accelerator.accelerator import Accelerator
from trainforge.trainer.accelerator.seed import seed_everything
from trainforge.trainer.cluster.stop_signals import TrainingStopped
from trainforge.trainer.compat.accelerate.state import DistributedType, PartialState
from trainforge.trainer.compat.accelerate.utils import find_executable_batch_size, skip_first_batches
from trainforge.trainer.loop.trainer import Trainer
from trainforge.trainer.loop.tuner import Tuner
from trainforge.trainer.module.datamodule import DataModule
from trainforge.trainer.module.training_module import TrainingModule


# documented in trainforge.trainer.cluster.notebook
def notebook_launcher(*args, **kwargs):
    from trainforge.trainer.cluster.notebook import notebook_launcher as launch

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
