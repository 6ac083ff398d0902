"""HF Accelerate's ``accelerate.utils`` (and ``accelerate.logging`` / ``accelerate.local_sgd``) names for
ported scripts: ``from accelerate.utils import X`` becomes ``from trainforge.utils import X``, with the
same meaning. Names trainforge does differently (``DeepSpeedPlugin``, ``AutocastKwargs``, ...) are here
too and refuse to be built, saying what to use instead. See docs/guides/accelerate.md, "Coming from Accelerate".
"""

from trainforge.trainer.compat.accelerate import imports as _imports
from trainforge.trainer.compat.accelerate.accelerator_args import release_memory
from trainforge.trainer.compat.accelerate.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    FP8RecipeKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    LoggerType,
    MegatronLMPlugin,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from trainforge.trainer.compat.accelerate.deepspeed import DummyOptim, DummyScheduler
from trainforge.trainer.compat.accelerate.imports import *  # noqa: F403 - the is_*_available helpers, imports.__all__
from trainforge.trainer.compat.accelerate.state import DistributedType, PartialState
from trainforge.trainer.compat.accelerate.utils import (
    LocalSGD,
    MultiProcessAdapter,
    find_executable_batch_size,
    get_logger,
    set_seed,
    should_reduce_batch_size,
    skip_first_batches,
)

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LocalSGD",
    "LoggerType",
    "MegatronLMPlugin",
    "MultiProcessAdapter",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
    "find_executable_batch_size",
    "get_logger",
    "release_memory",
    "set_seed",
    "should_reduce_batch_size",
    "skip_first_batches",
    *_imports.__all__,
]
