"""trainforge: one training script on a laptop CPU, one GPU, many GPUs and many nodes.

The one top-level package of the install. The repository's trainer/, callbacks/ and strategies/
folders are installed as ``trainforge.trainer``, ``trainforge.callbacks`` and
``trainforge.strategies`` (setup.py ``package_dir``); this module holds the names users import first.
"""

from trainforge import trainer as _trainer
from trainforge.trainer import *  # noqa: F403 - the names listed in trainforge.trainer.__all__
from trainforge.trainer.compat.accelerate import top_level as _accelerate
from trainforge.trainer.compat.accelerate.top_level import *  # noqa: F403 - Accelerate's top-level names

__version__ = "0.1.0"

# One list of the public names: trainforge.trainer's, Accelerate's top-level ones, plus the version.
__all__ = [*_trainer.__all__, *_accelerate.__all__, "__version__"]
