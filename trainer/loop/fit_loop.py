"""The rules the Trainer's training loop applies, as parts and functions it calls with explicit inputs:
the loss contract and the non-finite-loss policy (``LossChecks``), when ``trainer.should_stop`` may end
fit (``StopRules``), when to validate, stepping the schedulers, the ``StepGuard`` among the callbacks.
The loop itself (epochs, the one step path through ``Strategy.forward_backward``, optimizer steps) is
``Trainer.fit``'s own code in ``trainer/loop/trainer.py``; the order of events is in ``callbacks/events.py``'s
docstring."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from trainforge.callbacks.base import StepGuard
from trainforge.strategies.base import Strategy
from trainforge.strategies.errors import ConfigurationError, TrainforgeError
from trainforge.trainer.cluster.stop_signals import StopSignals
from trainforge.trainer.loop.settings import LoopConfig, Progress
from trainforge.trainer.loop.step_hooks import step_scheduler

log = logging.getLogger("trainforge")


class LossChecks:
    """What ``training_step`` returned, checked: the loss contract (a one-value tensor that requires grad, a
    dict with "loss", or None to skip the batch) and ``nonfinite_loss`` ("raise", "skip", "off"). A part the
    Trainer builds once and binds to each fit's module (``start``)."""

    def __init__(self, config: LoopConfig, progress: Progress, strategy: Strategy) -> None:
        self.config, self.progress, self.strategy = config, progress, strategy
        self.module: Any = None
        # training_step returning None: this epoch's count, and whether the fit said so once
        self._none_steps, self._warned_none = 0, False
        # non-finite losses flagged on the device, read at log points (see _check_async)
        self._nonfinite_flag: Optional[torch.Tensor] = None
        self._last_flag_check = 0

    def start(self, module: Any) -> None:
        self.module = module
        self._none_steps, self._warned_none = 0, False

    def loss_of(self, output: Any, batch_idx: int) -> Optional[torch.Tensor]:
        """The loss in what training_step returned, or a ConfigurationError at the first bad batch."""
        if type(output) is torch.Tensor and output.requires_grad and output.numel() == 1:
            # the common case, checked in the fewest operations (a per-step path)
            return output
        where = f"{type(self.module).__name__}.training_step (batch {batch_idx})"
        if isinstance(output, dict):
            if "loss" not in output:
                raise ConfigurationError(
                    f"{where} returned a dict without a 'loss' key (keys: {sorted(output)[:10]}); "
                    "return {'loss': loss, ...} or the loss tensor itself"
                )
            output = output["loss"]
        if output is None:
            if self.strategy.world_size > 1:
                raise ConfigurationError(_skip_alone(where, self.strategy))
            # a documented way to skip a batch; a whole epoch of them is reported
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
        if not output.requires_grad and self.module.automatic_optimization and torch.is_grad_enabled():
            raise ConfigurationError(
                f"{where} returned a loss that does not require grad (detached, computed under "
                "torch.no_grad(), or from parameters with requires_grad=False): nothing would be "
                "trained; return the loss tensor the model computed"
            )
        return output

    def warn_none_epoch(self, batches: int) -> None:
        """Once per fit: a whole epoch of training_step returning None trained nothing."""
        if batches and self._none_steps >= batches and not self._warned_none and self.strategy.is_global_zero:
            self._warned_none = True
            log.warning(
                "trainforge: %s.training_step returned None for all %d batches of epoch %d, so nothing was "
                "trained (None skips a batch); return the loss",
                type(self.module).__name__,
                batches,
                self.progress.epoch,
            )
        self._none_steps = 0

    def check(self, loss: torch.Tensor, batch_idx: int) -> bool:
        """Whether to train on ``loss`` (a one-value tensor: ``loss_of`` checked it)."""
        policy = self.config.nonfinite_loss
        if policy == "off":
            return True
        if loss.device.type != "cpu" and policy == "raise":
            return self._check_async(loss)
        finite = math.isfinite(loss.item())
        if policy == "skip" and self.strategy.world_size > 1:
            # every rank skips together (one number per step, in this mode only): a rank that skipped alone
            # would leave the others waiting for it in the gradient all-reduce of backward
            flag = torch.tensor([int(finite)], device=self.strategy.root_device)
            finite = bool(self.strategy.all_reduce(flag, "min").item())
        if finite:
            return True
        if policy == "skip":
            self.progress.skipped_nonfinite += 1
            return False
        raise TrainforgeError(
            f"non-finite loss ({float(loss.detach())}) at epoch {self.progress.epoch}, batch {batch_idx}, "
            f"global step {self.progress.global_step}; pass nonfinite_loss='skip' to skip such batches "
            "(they are counted), or lower the learning rate"
        )

    def _check_async(self, loss: torch.Tensor) -> bool:
        """On an accelerator, reading the loss every step would stall the device: non-finite losses
        are flagged on the device and the flag is read at log points (every ``log_every_n_steps``),
        where the error names the range of steps."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._nonfinite_flag = bad if self._nonfinite_flag is None else (self._nonfinite_flag | bad)
        return True

    def raise_if_flagged(self) -> None:
        """A non-finite loss flagged on the device since the last log point, as an error."""
        flag, self._nonfinite_flag = self._nonfinite_flag, None
        if flag is not None and bool(flag):
            first = self._last_flag_check + 1
            raise TrainforgeError(
                f"non-finite loss in global steps {first}..{self.progress.global_step} (epoch "
                f"{self.progress.epoch}); pass nonfinite_loss='skip' to skip such batches (checked "
                "every step), or lower the learning rate"
            )
        self._last_flag_check = self.progress.global_step


def _skip_alone(where: str, strategy: Strategy) -> str:
    return (
        f"{where} returned None on rank {strategy.global_rank} of {strategy.world_size}: a skipped batch is "
        "supported on one process only (as in Lightning 2.x), since a rank that skips its backward leaves the "
        "others waiting for it in the gradient all-reduce. Return a loss on every rank (multiplied by 0 to keep "
        "this rank's batch out of the gradient), or skip non-finite losses with nonfinite_loss='skip', which "
        "every rank decides together"
    )


def check_same_batch_count(strategy: Strategy, count: Any) -> None:
    """Every rank trains as many batches per epoch (once per fit: one all-gather of one number); a rank with
    fewer would leave the others waiting for it in the gradient all-reduce of the batches it lacks."""
    if strategy.world_size == 1:
        return
    mine = -1 if count == float("inf") else int(count)
    counts = strategy.all_gather(torch.tensor([mine], device=strategy.root_device)).flatten().tolist()
    if len(set(counts)) == 1:
        return
    per_rank = ", ".join(f"rank {r}: {'no length' if c < 0 else c}" for r, c in enumerate(counts))
    raise ConfigurationError(
        f"the ranks have different numbers of training batches per epoch ({per_rank}): the ranks with more would "
        "wait forever for the others in the gradient all-reduce. Give every rank as many batches: let trainforge "
        "shard a map-style dataset (a plain DataLoader; its sampler pads the last batches), or make your own "
        "sampler or batch sampler give each rank the same count (pad or drop the remainder)"
    )


class StopRules:
    """When fit ends before its batches do: a stop signal every rank agreed on, ``max_steps``, or
    ``trainer.should_stop`` once ``min_epochs`` and ``min_steps`` are met (Lightning). A part the Trainer
    builds once; ``should_stop`` is handed in at each question (callbacks set it on the Trainer)."""

    def __init__(self, config: LoopConfig, progress: Progress, stop_signals: StopSignals, strategy: Strategy) -> None:
        self.config, self.progress, self.stop_signals, self.strategy = config, progress, stop_signals, strategy
        # the "training will continue" line is logged once per Trainer
        self._told_min_stop = False

    def finished(self, should_stop: bool) -> bool:
        # a stop signal, whatever min_steps says (trainer/cluster/stop_signals.py)
        if self.stop_signals.agreed is not None:
            return True
        max_steps = self.config.max_steps
        if max_steps >= 0 and self.progress.global_step >= max_steps:
            return True
        return should_stop and self._can_stop_early()

    def stopping_early(self, should_stop: bool) -> bool:
        """``trainer.should_stop`` is set and may be obeyed (min_epochs/min_steps met, no stop signal)."""
        return should_stop and self.stop_signals.agreed is None and self._can_stop_early()

    def _can_stop_early(self) -> bool:
        """``should_stop`` is obeyed once ``min_epochs`` epochs and ``min_steps`` steps are done (Lightning)."""
        cfg, p = self.config, self.progress
        met = (cfg.min_epochs is None or p.epoch >= cfg.min_epochs) and (
            cfg.min_steps is None or p.global_step >= cfg.min_steps
        )
        if not met and not self._told_min_stop and self.strategy.is_global_zero:
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

    def warn_if_nothing_to_train(self, num_training_batches: Any, should_stop: bool) -> None:
        """A resume past max_epochs, or a second fit of a finished Trainer, returns at once: said so, as
        Lightning does ("`Trainer.fit` stopped: `max_epochs=2` reached")."""
        cfg, p = self.config, self.progress
        # the epoch's batches all ran
        ended = p.batch_idx >= num_training_batches or p.epoch_end_pending
        # the first epoch that would still train
        epoch = p.epoch + 1 if ended else p.epoch
        at_epochs = cfg.max_epochs is not None and epoch >= cfg.max_epochs
        if (at_epochs or self.finished(should_stop)) and self.strategy.is_global_zero:
            limit = f"max_epochs={cfg.max_epochs}" if at_epochs else f"max_steps={cfg.max_steps}"
            log.warning(
                "trainforge: fit has nothing to train: the run has done %d epoch(s) and %d step(s) (from "
                "the checkpoint or an earlier fit) and %s is reached; raise %s to train more",
                epoch,
                p.global_step,
                limit,
                limit.split("=")[0],
            )

    def refuse_endless(self, first_step: int, automatic_optimization: bool) -> None:
        """With max_epochs=None only max_steps ends the run: an epoch that took no optimizer step would
        repeat forever (manual optimization that never calls ``opt.step()``)."""
        p = self.progress
        if self.config.max_epochs is not None or p.global_step != first_step:
            return
        manual = (
            ""
            if automatic_optimization
            else "; under manual optimization global_step counts optimizer steps: call opt.step() in training_step"
        )
        raise TrainforgeError(
            f"epoch {p.epoch - 1} ran its batches without an optimizer step (global_step stays at "
            f"{p.global_step}); with max_epochs=None the run ends only at max_steps={self.config.max_steps}, "
            f"so it would never end{manual}, or set max_epochs"
        )


def validation_epoch(config: LoopConfig, progress: Progress, loaders: List[Any]) -> bool:
    """Whether this epoch validates at all (loaders, limit_val_batches, check_val_every_n_epoch)."""
    if not loaders or config.limit_val_batches == 0:
        return False
    every_epoch = config.check_val_every_n_epoch
    return every_epoch is None or (progress.epoch + 1) % every_epoch == 0


def validation_due(config: LoopConfig, progress: Progress, loaders: List[Any], num_training_batches: Any) -> bool:
    """Whether validation runs after the batch just trained (val_check_interval, check_val_every_n_epoch)."""
    if not validation_epoch(config, progress, loaders):
        return False
    interval, n = config.val_check_interval, num_training_batches
    if n == float("inf"):
        # a loader without length: 1.0 means the epoch's end; int counts within the epoch
        return bool(progress.epoch_end_pending) if isinstance(interval, float) else progress.batch_idx % interval == 0
    every = max(1, int(n * interval)) if isinstance(interval, float) else interval
    # Lightning: every `every` batches of the epoch (of the run when check_val_every_n_epoch=None),
    # and no extra run at the epoch end when it is not due
    done = progress.batch_idx if config.check_val_every_n_epoch is not None else progress.epoch * n + progress.batch_idx
    return done % every == 0


def step_schedulers(
    configs: List[Dict[str, Any]],
    interval: str,
    count: int,
    metrics: Dict[str, Any],
    step: Callable[[Any, Any], None] = step_scheduler,
) -> None:
    """Step the schedulers of ``interval`` ("step" or "epoch") due at ``count``; a ReduceLROnPlateau
    with the value of its monitored metric among ``metrics``. ``step(scheduler, metric)`` steps one: the
    module's ``lr_scheduler_step`` (Lightning's hook), by default ``scheduler.step([metric])``."""
    for cfg in configs:
        if cfg["interval"] != interval or count % cfg["frequency"] != 0:
            continue
        scheduler = cfg["scheduler"]
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        # parse_optimizers sets it (Lightning's key)
        if not cfg.get("reduce_on_plateau", plateau):
            step(scheduler, None)
            continue
        key = cfg.get("monitor")
        if key not in metrics:
            message = (
                f"{type(scheduler).__name__} monitors {key!r}, not among the logged metrics "
                f"{sorted(metrics)}; log it, or set 'monitor' in its config"
            )
            if cfg.get("strict", True):
                raise ConfigurationError(message + " ('strict': False skips such steps with a warning)")
            warnings.warn(message + "; this scheduler step is skipped ('strict': False)", UserWarning)
            continue
        step(scheduler, float(metrics[key]))


def warn_skips(skipped_by_scaler: int, skipped_nonfinite: int, is_global_zero: bool) -> None:
    """At fit's end: the optimizer steps the fp16 grad scaler skipped and the batches a non-finite loss skipped."""
    if skipped_by_scaler and is_global_zero:
        log.warning(
            "trainforge: the fp16 grad scaler skipped %d optimizer step(s) on inf/nan gradients", skipped_by_scaler
        )
    if skipped_nonfinite and is_global_zero:
        log.warning("trainforge: %d batch(es) with a non-finite loss were skipped", skipped_nonfinite)


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
