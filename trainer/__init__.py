"""trainforge: one training script on a laptop CPU, one GPU, many GPUs and many nodes."""
from strategies.errors import CheckpointError, ConfigurationError, LaunchError, TrainforgeError
from trainer.accelerator import Accelerator
from trainer.datamodule import DataModule
from trainer.events import Event
from trainer.module import TrainingModule
from trainer.precision import PRECISIONS, Precision
from trainer.seed import seed_everything
from trainer.trainer import Trainer

__version__ = "0.1.0"


def notebook_launcher(*args, **kwargs):  # noqa: D103 - documented in trainer.notebook
    from trainer.notebook import notebook_launcher as launch

    return launch(*args, **kwargs)


__all__ = ["Trainer", "TrainingModule", "DataModule", "Accelerator", "Event", "Precision", "PRECISIONS", "seed_everything",
           "notebook_launcher", "TrainforgeError", "ConfigurationError", "CheckpointError", "LaunchError"]
