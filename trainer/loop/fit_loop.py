"""The training loop of ``Trainer`` (a mixin, as ``Evaluation`` is): epochs, the one step path
through ``Strategy.forward_backward``, loss checks, optimizer and scheduler steps, when to validate.
The order of events is in ``callbacks/events.py``'s docstring."""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from trainforge.callbacks.base import StepGuard
from trainforge.callbacks.events import Event
from trainforge.strategies.errors import ConfigurationError, TrainforgeError
from trainforge.trainer.accelerator.token_loss import ITEMS_KEY
from trainforge.trainer.loop.evaluation import module_modes, restore_modes
from trainforge.trainer.module.training_module import TrainingModule

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy
    from trainforge.trainer.accelerator.accelerator import Accelerator
    from trainforge.trainer.cluster.stop_signals import StopSignals
    from trainforge.trainer.loop.metrics import MetricStore
    from trainforge.trainer.loop.settings import LoopConfig, Progress

log = logging.getLogger("trainforge")


class FitLoop:
    """Mixed into ``Trainer``: everything here reads and writes the Trainer's own state."""

    if TYPE_CHECKING:  # the Trainer's, for the type checker
        module: Optional[TrainingModule]
        model: Any
        accelerator: Accelerator
        strategy: Strategy
        config: LoopConfig
        progress: Progress
        optimizer: Any
        should_stop: bool
        stop_signals: StopSignals
        train_dataloader: Any
        val_dataloaders: List[Any]
        callbacks: List[Any]
        lr_scheduler_configs: List[Dict[str, Any]]
        num_training_batches: Any  # int, or float("inf") for a loader without length
        callback_metrics: Dict[str, Any]
        _metrics: Dict[str, MetricStore]
        _training_step: Any
        _pipelined: bool
        _running: str
        _batch: Any
        _last_output: Any
        _data_ended: bool
        _none_steps: int
        _warned_none: bool
        _nonfinite_flag: Optional[torch.Tensor]
        _last_flag_check: int

        @property
        def global_step(self) -> int: ...
        @property
        def current_epoch(self) -> int: ...
        @property
        def is_global_zero(self) -> bool: ...
        @property
        def optimizers(self) -> List[torch.optim.Optimizer]: ...
        def _fire(self, event: Event, *args: Any) -> None: ...
        def _emit(self, metrics: Dict[str, float]) -> None: ...
        def _run_manual_step(self, batch: Any, batch_idx: int) -> None: ...
        def _fire_epoch_end(self, event: Event) -> None: ...
        def _roll_back(self, guard: StepGuard) -> None: ...
        def _run_validation(self, loaders: List[Any], step_name: str, max_batches: Optional[int] = None) -> None: ...

    @property
    def _fit_module(self) -> "TrainingModule":
        """The module being fitted (attached by ``fit`` before the loop runs)."""
        module = self.module
        if module is None:
            raise ConfigurationError("no module is attached: the loop runs inside fit(module, ...)")
        return module

    _step_guard: Optional[StepGuard] = None  # callbacks/base.py: set at the loop's start
    _custom_clipping = False  # the module overrides configure_gradient_clipping: set at the loop's start

    def _fit_loop(self) -> None:
        cfg, p, loader = self.config, self.progress, self.train_dataloader
        automatic = self._fit_module.automatic_optimization
        self._step_guard = find_step_guard(self, automatic, cfg.nonfinite_loss)
        # the module's own configure_gradient_clipping (the default only applies the Trainer's settings)
        self._custom_clipping = (
            type(self._fit_module).configure_gradient_clipping is not TrainingModule.configure_gradient_clipping
        )
        train_modes = module_modes(self._fit_module)  # the user's per-submodule modes (a frozen part stays in eval)
        if p.batch_idx >= self.num_training_batches or p.epoch_end_pending:  # resumed at the epoch's last batch
            if p.epoch_end_pending:  # written at BATCH_END: the epoch's end is still to come
                with warnings.catch_warnings():  # the optimizer stepped before the save, not in this process
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                    self._end_epoch()
            else:  # written at EPOCH_END (or by an older version)
                p.epoch, p.batch_idx = p.epoch + 1, 0
        while not self._finished() and (cfg.max_epochs is None or p.epoch < cfg.max_epochs):
            restore_modes(train_modes)
            loader.set_epoch(p.epoch)
            self._fire(Event.EPOCH_START)
            first_batch, first_step = p.batch_idx, p.global_step
            for batch in loader:
                self._train_batch(batch, p.batch_idx)
                p.batch_idx += 1
                # the epoch's last batch: by count, or (a loader without length) when the data ended
                p.epoch_end_pending = int(p.batch_idx >= self.num_training_batches or self._data_ended)
                validated = self._validation_due()
                if validated:
                    self._run_validation(self.val_dataloaders, "validation_step")
                self.stop_signals.poll(self.strategy, p.global_step)  # all ranks stop at one step on a signal
                self._fire(Event.BATCH_END, self._last_output, batch, p.batch_idx - 1)
                self._batch = self._last_output = batch = None  # free them before the next batch arrives
                if not validated and self._stopping_early() and self._validation_epoch():
                    self._run_validation(self.val_dataloaders, "validation_step")  # Lightning validates, then stops
                if self._finished() or p.epoch_end_pending:
                    break
            if p.batch_idx == first_batch == 0:  # a stream that yields nothing (audit N-IT3): say so, save nothing
                raise ConfigurationError(
                    f"train_dataloaders yielded no batch in epoch {p.epoch} on this process: "
                    "nothing can be trained; give it data (an IterableDataset whose stream is "
                    "empty, or a filter that drops everything?)"
                )
            self._warn_none_epoch(p.batch_idx - first_batch)
            # a complete epoch, or one that trainer.should_stop ends (Lightning ends it: epoch-end hooks, epoch
            # metrics and schedulers, current_epoch + 1); a max_steps or stop-signal cut ends fit at that batch
            if p.epoch_end_pending or self._stopping_early():
                self._end_epoch()
                self._refuse_endless(first_step)
            else:
                break
        self._raise_if_flagged()  # a non-finite loss after the last log point (accelerators)
        self._warn_skips()

    def _end_epoch(self) -> None:
        p = self.progress
        if p.batch_idx < self.num_training_batches != float("inf"):  # ended by should_stop: a checkpoint written
            p.batch_idx = int(self.num_training_batches)  # at EPOCH_END resumes at the next epoch (Lightning)
        self._emit(self._metrics["train"].pop_epoch_metrics(self.strategy))
        self._step_schedulers("epoch")
        p.epoch_end_pending = 0  # a checkpoint written from here on already includes the epoch's end
        self._fire_epoch_end(Event.EPOCH_END)
        p.epoch, p.batch_idx = p.epoch + 1, 0

    def _warn_if_nothing_to_train(self) -> None:
        """Audit N-RE7 / L5: a resume past max_epochs, or a second fit of a finished Trainer, returned
        at once without a word. Lightning says so too ("`Trainer.fit` stopped: `max_epochs=2` reached")."""
        cfg, p = self.config, self.progress
        ended = p.batch_idx >= self.num_training_batches or p.epoch_end_pending  # the epoch's batches all ran
        epoch = p.epoch + 1 if ended else p.epoch  # the first epoch that would still train
        at_epochs = cfg.max_epochs is not None and epoch >= cfg.max_epochs
        if (at_epochs or self._finished()) and self.is_global_zero:
            limit = f"max_epochs={cfg.max_epochs}" if at_epochs else f"max_steps={cfg.max_steps}"
            log.warning(
                "trainforge: fit has nothing to train: the run has done %d epoch(s) and %d step(s) (from "
                "the checkpoint or an earlier fit) and %s is reached; raise %s to train more",
                epoch,
                p.global_step,
                limit,
                limit.split("=")[0],
            )

    def _refuse_endless(self, first_step: int) -> None:
        """With max_epochs=None only max_steps ends the run: an epoch that took no optimizer step would
        repeat forever (audit N-MO3: manual optimization that never calls ``opt.step()``)."""
        p = self.progress
        if self.config.max_epochs is None and p.global_step == first_step:
            manual = (
                ""
                if self._fit_module.automatic_optimization
                else (
                    "; under manual optimization global_step counts optimizer steps: call opt.step() in training_step"
                )
            )
            raise TrainforgeError(
                f"epoch {p.epoch - 1} ran its batches without an optimizer step (global_step stays at "
                f"{p.global_step}); with max_epochs=None the run ends only at max_steps={self.config.max_steps}, "
                f"so it would never end{manual}, or set max_epochs"
            )

    def _finished(self) -> bool:
        if (
            self.stop_signals.agreed is not None
        ):  # a stop signal, whatever min_steps says (trainer/cluster/stop_signals.py)
            return True
        max_steps = self.config.max_steps
        if max_steps >= 0 and self.progress.global_step >= max_steps:
            return True
        return self.should_stop and self._can_stop_early()

    def _stopping_early(self) -> bool:
        """``trainer.should_stop`` is set and may be obeyed (min_epochs/min_steps met, no stop signal)."""
        return self.should_stop and self.stop_signals.agreed is None and self._can_stop_early()

    _told_min_stop = False  # the "training will continue" line is logged once per Trainer

    def _can_stop_early(self) -> bool:
        """``should_stop`` is obeyed once ``min_epochs`` epochs and ``min_steps`` steps are done (Lightning)."""
        cfg, p = self.config, self.progress
        met = (cfg.min_epochs is None or p.epoch >= cfg.min_epochs) and (
            cfg.min_steps is None or p.global_step >= cfg.min_steps
        )
        if not met and not self._told_min_stop and self.is_global_zero:
            self._told_min_stop = True
            log.info(
                "trainforge: trainer.should_stop is set, but min_epochs=%s or min_steps=%s is not reached (epoch %d, "
                "step %d); training continues",
                cfg.min_epochs,
                cfg.min_steps,
                p.epoch,
                p.global_step,
            )
        return met

    def _train_batch(self, batch: Any, batch_idx: int) -> None:
        acc, p = self.accelerator, self.progress
        acc.check_checkpoint()  # a failed asynchronous save is raised at the next step
        self._batch, self._running = batch, "train"
        self._fire(Event.BATCH_START, batch, batch_idx)
        # A loader without length flagged its last batch itself (it reads one ahead)
        self._data_ended = self.num_training_batches == float("inf") and acc.gradient_state.end_of_dataloader
        acc.gradient_state.end_of_dataloader = batch_idx + 1 >= self.num_training_batches or self._data_ended
        if not self._fit_module.automatic_optimization:
            return self._run_manual_step(batch, batch_idx)
        with acc.accumulate(self.model):  # the one step path: the strategy's forward_backward
            output = self.strategy.forward_backward(
                self.model, self._training_step, batch, batch_idx, backward=lambda out: self._backward(out, batch_idx)
            )
            if self._pipelined:
                self._after_pipeline_step(output, batch_idx)
            if acc.sync_gradients:
                self._optimizer_step()
        p.accumulation_step = acc.step

    def _backward(self, output: Any, batch_idx: int) -> None:
        """After the forward of an ordinary strategy: the loss in ``output``, BEFORE_BACKWARD, backward."""
        loss = self._loss_of(output, batch_idx)
        self._last_output = output
        if loss is not None and self._step_guard is not None:
            self._step_guard.record(loss)  # decided for every rank at the optimizer step
        if loss is not None and (self._step_guard is not None or self._check_loss(loss, batch_idx)):
            self._fire(Event.BEFORE_BACKWARD, loss)
            items = output.get(ITEMS_KEY) if isinstance(output, dict) else None  # a summed loss's count
            self.accelerator.backward(loss, self.model, num_items=items)
            self._fire(Event.AFTER_BACKWARD)

    def _after_pipeline_step(self, loss: torch.Tensor, batch_idx: int) -> None:
        """Pipeline parallelism: the strategy's schedule ran forward, ``module.loss_fn`` and backward
        of every micro-batch (training_step is not called); the batch loss, the same on every rank,
        is logged as ``train/loss``. BEFORE_BACKWARD does not fire (the backward is inside the schedule)."""
        self._last_output = loss
        self._fit_module.log("train/loss", loss)
        if self._step_guard is not None:
            self._step_guard.record(loss)
        if self._step_guard is not None or self._check_loss(loss, batch_idx):
            self._fire(Event.AFTER_BACKWARD)
        else:
            for opt in self.optimizers:
                opt.zero_grad()

    def _pipeline_loss_name(self, step_name: str) -> str:
        """Validation/test under pipeline parallelism: ``module.loss_fn`` through the stages (forward
        only; validation_step/test_step are not called), logged as ``val/loss`` / ``test/loss``, the
        mean over the epoch and the data-parallel ranks."""
        name = {"validation_step": "val/loss", "test_step": "test/loss"}.get(step_name)
        if name is None:
            raise ConfigurationError(
                f"{step_name} with pipeline parallelism is not built yet (the stages compute "
                "the loss only); predict on one process from the merged weights"
            )
        return name

    def _loss_of(self, output: Any, batch_idx: int) -> Optional[torch.Tensor]:
        """The loss in what training_step returned, or a ConfigurationError at the first bad batch."""
        if type(output) is torch.Tensor and output.requires_grad and output.numel() == 1:
            return output  # the common case, checked in the fewest operations (a per-step path)
        where = f"{type(self._fit_module).__name__}.training_step (batch {batch_idx})"
        if isinstance(output, dict):
            if "loss" not in output:
                raise ConfigurationError(
                    f"{where} returned a dict without a 'loss' key (keys: {sorted(output)[:10]}); "
                    "return {'loss': loss, ...} or the loss tensor itself"
                )
            output = output["loss"]
        if output is None:  # a documented way to skip a batch; a whole epoch of them is reported
            self._none_steps += 1
            return None
        if not isinstance(output, torch.Tensor):
            raise ConfigurationError(
                f"{where} returned a {type(output).__name__} ({output!r:.80}); return the loss "
                "as a tensor (not loss.item()), a dict with 'loss', or None to skip the batch"
            )
        if output.numel() != 1:
            raise ConfigurationError(
                f"{where} returned a loss of shape {tuple(output.shape)}; reduce it to one "
                "value (e.g. loss.mean()) before returning it"
            )
        if not output.requires_grad and self._fit_module.automatic_optimization and torch.is_grad_enabled():
            raise ConfigurationError(
                f"{where} returned a loss that does not require grad (detached, computed under "
                "torch.no_grad(), or from parameters with requires_grad=False): nothing would be "
                "trained; return the loss tensor the model computed"
            )
        return output

    def _warn_none_epoch(self, batches: int) -> None:
        """Once per fit: a whole epoch of training_step returning None trained nothing."""
        if batches and self._none_steps >= batches and not self._warned_none and self.is_global_zero:
            self._warned_none = True
            log.warning(
                "trainforge: %s.training_step returned None for all %d batches of epoch %d, so nothing was "
                "trained (None skips a batch); return the loss",
                type(self._fit_module).__name__,
                batches,
                self.progress.epoch,
            )
        self._none_steps = 0

    def _optimizer_step(self) -> None:
        acc, cfg, optimizer = self.accelerator, self.config, self.optimizer.optimizer
        acc.end_item_window(self.model)  # summed losses: the window's count (if its last backward was skipped)
        guard = self._step_guard
        decision = "step" if guard is None else guard.decide(self.strategy, self.global_step, self.is_global_zero)
        if guard is not None and decision != "step":
            optimizer.zero_grad()  # every rank together: no optimizer or scheduler step, the batches count
            if decision == "rollback":  # the newest checkpoint's weights; the data goes on
                self._roll_back(guard)
            self._emit(guard.metrics())
            return
        if acc.precision.scaler is not None:
            acc.precision.unscale_(optimizer)
        self._fire(Event.BEFORE_OPTIMIZER_STEP, optimizer)
        if self._custom_clipping:  # the module's configure_gradient_clipping decides (Lightning's hook)
            self._fit_module.configure_gradient_clipping(optimizer, cfg.gradient_clip_val, cfg.gradient_clip_algorithm)
        elif cfg.gradient_clip_val is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            if cfg.gradient_clip_algorithm == "norm":
                self.strategy.clip_gradients(params, max_norm=cfg.gradient_clip_val)
            else:
                self.strategy.clip_gradients(params, clip_value=cfg.gradient_clip_val)
        self.strategy.optimizer_step(optimizer)  # what the prepared optimizer does on a sync step
        self._fire(Event.BEFORE_ZERO_GRAD, optimizer)
        optimizer.zero_grad()
        self.progress.global_step += 1
        self._step_schedulers("step")
        if self.progress.global_step % cfg.log_every_n_steps == 0:
            self._raise_if_flagged()
            self._emit(self._metrics["train"].pop_step_metrics(self.strategy))

    def _check_loss(self, loss: torch.Tensor, batch_idx: int) -> bool:
        """Whether to train on ``loss`` (a one-value tensor: ``_loss_of`` checked it)."""
        policy = self.config.nonfinite_loss
        if policy == "off":
            return True
        if loss.device.type != "cpu" and policy == "raise":
            return self._check_loss_async(loss)
        if math.isfinite(loss.item()):
            return True
        if policy == "skip":
            self.progress.skipped_nonfinite += 1
            return False
        raise TrainforgeError(
            f"non-finite loss ({float(loss.detach())}) at epoch {self.current_epoch}, batch {batch_idx}, "
            f"global step {self.global_step}; pass nonfinite_loss='skip' to skip such batches "
            "(they are counted), or lower the learning rate"
        )

    def _check_loss_async(self, loss: torch.Tensor) -> bool:
        """On an accelerator, reading the loss every step would stall the device: non-finite losses
        are flagged on the device and the flag is read at log points (every ``log_every_n_steps``),
        where the error names the range of steps."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._nonfinite_flag = bad if self._nonfinite_flag is None else (self._nonfinite_flag | bad)
        return True

    def _raise_if_flagged(self) -> None:
        flag, self._nonfinite_flag = self._nonfinite_flag, None
        if flag is not None and bool(flag):
            first = self._last_flag_check + 1
            raise TrainforgeError(
                f"non-finite loss in global steps {first}..{self.global_step} (epoch "
                f"{self.current_epoch}); pass nonfinite_loss='skip' to skip such batches (checked "
                "every step), or lower the learning rate"
            )
        self._last_flag_check = self.global_step

    def _step_schedulers(self, interval: str) -> None:
        count = self.global_step if interval == "step" else self.current_epoch + 1
        for cfg in self.lr_scheduler_configs:
            if cfg["interval"] == interval and count % cfg["frequency"] == 0:
                scheduler = cfg["scheduler"]
                plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
                if cfg.get("reduce_on_plateau", plateau):  # parse_optimizers sets it (Lightning's key)
                    key = cfg.get("monitor")
                    if key not in self.callback_metrics:
                        message = (
                            f"{type(scheduler).__name__} monitors {key!r}, not among the logged metrics "
                            f"{sorted(self.callback_metrics)}; log it, or set 'monitor' in its config"
                        )
                        if cfg.get("strict", True):
                            raise ConfigurationError(message + " ('strict': False skips such steps with a warning)")
                        warnings.warn(message + "; this scheduler step is skipped ('strict': False)", UserWarning)
                        continue
                    scheduler.step(float(self.callback_metrics[key]))
                else:
                    scheduler.step()

    def _validation_epoch(self) -> bool:
        """Whether this epoch validates at all (loaders, limit_val_batches, check_val_every_n_epoch)."""
        if not self.val_dataloaders or self.config.limit_val_batches == 0:
            return False
        every_epoch = self.config.check_val_every_n_epoch
        return every_epoch is None or (self.current_epoch + 1) % every_epoch == 0

    def _validation_due(self) -> bool:
        if not self._validation_epoch():
            return False
        every_epoch = self.config.check_val_every_n_epoch
        interval = self.config.val_check_interval
        n = self.num_training_batches
        if n == float("inf"):  # a loader without length: 1.0 means the epoch's end; int counts within the epoch
            return (
                bool(self.progress.epoch_end_pending)
                if isinstance(interval, float)
                else self.progress.batch_idx % interval == 0
            )
        every = max(1, int(n * interval)) if isinstance(interval, float) else interval
        # Lightning: every `every` batches of the epoch (of the run when check_val_every_n_epoch=None),
        # and no extra run at the epoch end when it is not due
        done = self.progress.batch_idx if every_epoch is not None else self.progress.epoch * n + self.progress.batch_idx
        return done % every == 0

    def _warn_skips(self) -> None:
        skipped = self.accelerator.precision.skipped_steps
        if skipped and self.is_global_zero:
            log.warning("trainforge: the fp16 grad scaler skipped %d optimizer step(s) on inf/nan gradients", skipped)
        if self.progress.skipped_nonfinite and self.is_global_zero:
            log.warning("trainforge: %d batch(es) with a non-finite loss were skipped", self.progress.skipped_nonfinite)


def find_step_guard(trainer: Any, automatic_optimization: bool, nonfinite_loss: str) -> Optional[StepGuard]:
    """The fit's ``StepGuard`` among the callbacks (at most one), checked before any work."""
    guards = [cb for cb in trainer.callbacks if isinstance(cb, StepGuard)]
    if len(guards) > 1:
        names = ", ".join(type(g).__name__ for g in guards)
        raise ConfigurationError(
            f"{len(guards)} step guards were passed ({names}); the loop asks one whether to take each "
            "optimizer step: pass one"
        )
    if not guards:
        return None
    guards[0].check(trainer, automatic_optimization, nonfinite_loss)
    return guards[0]
