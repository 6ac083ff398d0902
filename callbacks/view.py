"""What a callback may use of the trainer it is handed: ``TrainerView``, a typed, documented subset of
``trainforge.Trainer``. The built-in callbacks use nothing else (no ``_`` name, no probing with
``getattr``); ``tests/callbacks/test_view.py`` checks that the Trainer provides all of it. A custom
callback is free to use more of the Trainer, at the risk of following its changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - type hints only
    import torch

    from trainforge.strategies.base import Strategy


@runtime_checkable
class TrainerView(Protocol):
    # where the run is
    stage: str  # "fit", "sanity_check", "validate", "test", "predict"
    should_stop: bool  # set True to stop fit at the next check
    run_id: Optional[str]  # the same on every rank; kept by a resumed run
    default_root_dir: str  # local: logs and trackers write here
    num_training_batches: Any  # int, or float("inf") for a loader without length

    @property
    def default_checkpoint_dir(self) -> str: ...  # <default_root_dir>/checkpoints, or Trainer(default_root_dir=URL)'s
    @property
    def global_step(self) -> int: ...
    @property
    def current_epoch(self) -> int: ...
    @property
    def max_epochs(self) -> Optional[int]: ...  # None: only max_steps ends the fit
    @property
    def batch_idx(self) -> int: ...
    @property
    def log_every_n_steps(self) -> int: ...
    @property
    def stop_requested(self) -> Optional[str]: ...  # "SIGTERM" etc. once every rank stops after this step

    # processes and devices
    strategy: Strategy  # collectives: broadcast, all_reduce, all_gather, barrier
    accelerator: Any  # trainforge.Accelerator (async_checkpointer, save/load)

    @property
    def is_global_zero(self) -> bool: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def precision(self) -> str: ...

    # what is trained
    lr_scheduler_configs: List[Dict[str, Any]]  # Lightning's dicts: scheduler, interval, frequency, name
    train_dataloader: Any
    val_dataloaders: List[Any]
    callbacks: List[Any]  # the fit's callbacks, in order (Lightning's trainer.callbacks)

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]: ...
    @property
    def hparams(self) -> Dict[str, Any]: ...

    # metrics
    callback_metrics: Dict[str, Any]  # the latest value of every logged metric
    logged_metrics: Dict[str, float]  # what was last sent to the trackers

    @property
    def progress_bar_metrics(self) -> Dict[str, float]: ...
    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None: ...

    # saving
    def save_checkpoint(self, path: str, async_save: bool = False, trainable_only: Optional[bool] = None) -> Path: ...
    def save_weights(
        self, path: str, max_shard_size: Optional[int] = None, adapter_only: Optional[bool] = None
    ) -> Any: ...
