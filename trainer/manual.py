"""Manual optimization (Lightning's ``automatic_optimization = False``): ``training_step`` steps
its own optimizers -- several of them, as GANs do -- through ``self.optimizers()``,
``self.lr_schedulers()`` and ``self.manual_backward(loss)``.

The optimizers handed to the module are the prepared ones (the strategy's step: grad scaler,
DeepSpeed engine...); each ``step()`` counts one ``global_step`` (as Lightning counts them),
``max_steps`` included. Schedulers are stepped by the user (Lightning). Gradient accumulation and
``gradient_clip_val`` are the user's job too (``self.clip_gradients`` is not provided): both
are rejected with a clear error, as Lightning does. DeepSpeed takes one optimizer per model.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.events import Event

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.trainer import Trainer


def check_manual_config(trainer: "Trainer") -> None:
    cfg = trainer.config
    if cfg.accumulate_grad_batches != 1:
        raise ConfigurationError(
            f"accumulate_grad_batches={cfg.accumulate_grad_batches} with manual optimization "
            "(automatic_optimization = False): accumulate in training_step yourself (step the "
            "optimizers every N batches), as in Lightning"
        )
    if cfg.gradient_clip_val is not None:
        raise ConfigurationError(
            f"gradient_clip_val={cfg.gradient_clip_val} with manual optimization: clip in "
            "training_step (torch.nn.utils.clip_grad_norm_ after manual_backward), as in "
            "Lightning"
        )


class ManualOptimizer:
    """What ``self.optimizers()`` returns: the prepared optimizer, whose ``step`` also fires
    ``on_before_optimizer_step`` and counts a global step, and ``zero_grad`` ``on_before_zero_grad``."""

    def __init__(self, prepared: Any, trainer: "Trainer") -> None:
        self._prepared, self._trainer = prepared, trainer

    def step(self, closure: Any = None) -> Any:
        trainer = self._trainer
        module = trainer.module
        if module is None:  # handed out by fit, which sets the module first
            raise AttributeError("'NoneType' object has no attribute 'automatic_optimization' (trainer.module)")
        if module.automatic_optimization:  # audit N-MO5: two updates per batch, counted twice
            raise ConfigurationError(
                f"{type(module).__name__} calls self.optimizers().step() under automatic optimization, "
                "where the Trainer steps the optimizer itself after training_step returns the loss: remove the "
                "call, or set self.automatic_optimization = False and step (and backward) by hand"
            )
        if closure is not None:
            closure()
        raw = self._prepared.optimizer
        stepped = trainer._manual_stepped_since_backward  # audit N-MO2: the same gradients applied twice
        if id(raw) in stepped and not trainer._warned_double_step:
            trainer._warned_double_step = True
            warnings.warn(
                f"{type(raw).__name__}.step() ran twice without a manual_backward in between (batch "
                f"{trainer.progress.batch_idx} of training_step): the same gradients were applied twice and "
                "global_step counted both; step once per backward",
                UserWarning,
                stacklevel=2,
            )
        stepped.add(id(raw))
        if trainer.accelerator.precision.scaler is not None:
            trainer.accelerator.precision.unscale_(raw)
        trainer._fire(Event.BEFORE_OPTIMIZER_STEP, raw)
        out = trainer.strategy.optimizer_step(raw)
        trainer.progress.global_step += 1
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._trainer._fire(Event.BEFORE_ZERO_GRAD, self._prepared.optimizer)
        self._prepared.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, state_dict ...
        return getattr(self._prepared, name)


def run_manual_step(trainer: "Trainer", batch: Any, batch_idx: int) -> None:
    """One batch: the user's training_step does backward and steps; metrics are popped at the
    log points the automatic loop uses."""
    before = trainer.progress.global_step
    trainer._manual_stepped_since_backward.clear()
    with trainer.accelerator.autocast():
        trainer._last_output = trainer._training_step(batch, batch_idx)
    after, every = trainer.progress.global_step, trainer.config.log_every_n_steps
    if after // every > before // every:
        trainer._emit(trainer._metrics["train"].pop_step_metrics(trainer.strategy))


def manual_backward(trainer: "Trainer", loss: Any) -> None:
    trainer._manual_stepped_since_backward.clear()
    trainer._fire(Event.BEFORE_BACKWARD, loss)
    trainer.strategy.prepare_for_manual_backward(trainer.model, loss)
    trainer.accelerator.backward(loss, trainer.model)
    trainer._fire(Event.AFTER_BACKWARD)
