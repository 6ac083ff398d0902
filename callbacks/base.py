"""The Callback base class: one no-op method per ``Event`` (``callbacks/events.py``, beside it).

A callback talks only to the objects it is handed (``trainer`` and ``module``); this package never
imports ``trainer`` at run time.

Two seams let a callback take part in the loop's own decisions without the loop naming it
(as Composer's ``Algorithm.match/apply`` gives algorithms a seam into the step):

- ``StepGuard``: asked at every optimizer step whether to step, skip it or roll back to the newest
  checkpoint (``LossSpikes`` is one);
- ``Checkpointer``: a callback that writes the run's checkpoints; the loop asks it where they go
  (``ckpt_path="last"``, ``resume="auto"``), which step it saved last (a stop signal's checkpoint),
  and runs it after every other callback at each event (``ModelCheckpoint`` is one). The ``TrainingModule`` receives every event first, through the
same dispatcher, with Lightning's module signatures (``trainer/loop/module_hooks.py``): one hook mechanism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Literal, Optional

if TYPE_CHECKING:  # pragma: no cover - type hints only, see docs/ARCHITECTURE.md "Floors"
    import torch

    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView
    from trainforge.strategies.base import Strategy
    from trainforge.strategies.checkpoint.remote_read import Location

#: What a ``StepGuard`` tells the loop at an optimizer step.
StepDecision = Literal["step", "skip", "rollback"]

#: A key of a callback's ``state_dict``: when present (a sentence saying why), the checkpoint cannot continue
#: training without a callback of the same ``state_key`` (a weight average saved as the model), and a resume
#: without one is refused with that sentence before anything is restored.
RESUME_NEEDS_CALLBACK = "resume_needs_callback"


class Callback:
    """Subclass and override the hooks you need. Callbacks with state implement
    ``state_dict``/``load_state_dict``; the state is saved in checkpoints under ``state_key``.

    ``restore_on_rollback``: whether ``LossSpikes(rollback_after=N)`` restores this callback's state with the
    weights when it rolls back to a checkpoint (True for state that follows the weights, as a weight
    average; False, the default, for state that records what the run did: checkpoints written, time,
    tracker runs)."""

    restore_on_rollback: bool = False
    #: Lightning's "monitoring callback" (checkpointing, early stopping): it runs after the module's hook at
    #: each event (trainer/loop/module_hooks.py, ``lightning_order``), so it sees what the module logged there
    #: and a checkpoint it writes holds what the module's hook did.
    monitors_metrics: bool = False

    @property
    def state_key(self) -> str:
        return type(self).__qualname__

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass

    def on_setup(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None: ...
    def setup(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        """Lightning's name for ``on_setup``: both run (this one after ``on_setup``)."""

    def teardown(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        """Lightning's name for ``on_teardown``: both run (this one after ``on_teardown``)."""

    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_train_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_train_batch_start(
        self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int
    ) -> None: ...
    def on_before_backward(self, trainer: TrainerView, module: TrainingModule, loss: torch.Tensor) -> None: ...
    def on_after_backward(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_before_optimizer_step(
        self, trainer: TrainerView, module: TrainingModule, optimizer: torch.optim.Optimizer
    ) -> None: ...
    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...
    def on_train_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_validation_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_validation_batch_end(
        self,
        trainer: TrainerView,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_sanity_check_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_sanity_check_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_train_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_train_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_before_zero_grad(
        self, trainer: TrainerView, module: TrainingModule, optimizer: torch.optim.Optimizer
    ) -> None: ...
    def on_validation_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_validation_batch_start(
        self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_validation_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_test_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_test_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_test_batch_start(
        self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_end(
        self,
        trainer: TrainerView,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_test_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_test_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_predict_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_predict_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_predict_batch_start(
        self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_end(
        self,
        trainer: TrainerView,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_predict_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_predict_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_log(self, trainer: TrainerView, module: TrainingModule, metrics: Dict[str, float], step: int) -> None: ...
    def on_save_checkpoint(self, trainer: TrainerView, module: TrainingModule, checkpoint: Dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, trainer: TrainerView, module: TrainingModule, checkpoint: Dict[str, Any]) -> None: ...
    def on_fit_end(self, trainer: TrainerView, module: TrainingModule) -> None: ...
    def on_exception(self, trainer: TrainerView, module: TrainingModule, exception: BaseException) -> None: ...
    def on_teardown(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None: ...


class StepGuard(Callback):
    """A callback the loop asks, at every optimizer step, whether to take it.

    The loop hands it every micro-batch loss (``record``), then, after the window's last backward and
    before unscaling, clipping and stepping, asks ``decide``: ``"step"`` (go on), ``"skip"`` (zero the
    gradients; no optimizer or scheduler step; the batches still count) or ``"rollback"`` (skip, then
    restore the newest checkpoint of the fit through the resume path, and call ``rolled_back``). Every
    rank must get the same answer (all-reduce what the decision reads). ``metrics`` are logged after a
    skip or a rollback. At most one guard per fit; ``check`` refuses a fit it cannot guard, before any
    work. ``LossSpikes`` (callbacks/loss_spikes.py) is the built-in one."""

    def check(self, trainer: TrainerView, automatic_optimization: bool, nonfinite_loss: str) -> None:
        """Refuse, with a ``ConfigurationError``, a fit this guard cannot decide for (at fit start)."""

    def record(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (before accumulation scaling); must not synchronise the device."""

    def decide(self, strategy: Strategy, step: int, is_global_zero: bool) -> StepDecision:
        """At an optimizer step, on every rank: the same decision on every rank."""
        return "step"

    def metrics(self) -> Dict[str, float]:
        """What the loop logs after a skip or a rollback (e.g. the run's count of skipped steps)."""
        return {}

    def rolled_back(self, path: str, from_step: int, to_step: int, is_global_zero: bool) -> None:
        """Told after the loop restored ``path`` (``global_step`` went from ``from_step`` to ``to_step``)."""


class Checkpointer(Callback):
    """A callback that writes the run's checkpoints: the seam through which the loop finds them.

    The loop runs every ``Checkpointer`` after the other callbacks at each event (so a checkpoint
    holds every other callback's state of its step) and asks it ``directory`` (where ``ckpt_path="last"``
    and ``resume="auto"`` look: the first checkpointer's), ``last_saved_step``/``last_path`` (the
    checkpoint of a stop signal's step) and ``writes_full_checkpoints`` (whether a rollback could
    restore one). ``ModelCheckpoint`` (callbacks/checkpoint.py) is the built-in one; by default it
    writes under ``trainer.default_checkpoint_dir``, the Trainer's setting."""

    monitors_metrics = True
    #: The global step of the newest checkpoint this callback wrote (-1: none yet) and its path.
    last_saved_step: int = -1
    last_path: Optional[str] = None
    #: The monitored metric (None: none) and the best checkpoint by it, for ``ckpt_path="best"``.
    monitor: Optional[str] = None

    @property
    def best_model_path(self) -> Optional[str]:
        return None

    @property
    def writes_full_checkpoints(self) -> bool:
        """Whether its checkpoints resume a run (False for weights-only exports)."""
        return True

    def directory(self, trainer: TrainerView) -> Location:
        """Where this callback writes (a local path or an fsspec URL)."""
        from trainforge.strategies.checkpoint.remote import location

        return location(trainer.default_checkpoint_dir)
