"""trainforge: one training script on a laptop CPU, one GPU, many GPUs and many nodes.

The one top-level package of the install. The repository's trainer/, callbacks/ and strategies/
folders are installed as ``trainforge.trainer``, ``trainforge.callbacks`` and
``trainforge.strategies`` (setup.cfg ``package_dir``); this module holds the names users import first.
"""

from trainforge.trainer import (
    PRECISIONS,
    Accelerator,
    CheckpointError,
    ConfigurationError,
    DataModule,
    Event,
    LaunchError,
    Precision,
    Trainer,
    TrainforgeError,
    TrainingModule,
    notebook_launcher,
    seed_everything,
)

__version__ = "0.1.0"

__all__ = [
    "Trainer",
    "TrainingModule",
    "DataModule",
    "Accelerator",
    "Event",
    "Precision",
    "PRECISIONS",
    "seed_everything",
    "notebook_launcher",
    "TrainforgeError",
    "ConfigurationError",
    "CheckpointError",
    "LaunchError",
    "__version__",
]
