"""Manual optimization (Lightning's ``automatic_optimization = False``): ``training_step`` steps
its own optimizers -- several of them, as GANs do -- through ``self.optimizers()``,
``self.lr_schedulers()`` and ``self.manual_backward(loss)``.

The optimizers handed to the module are the prepared ones (the strategy's step: grad scaler,
DeepSpeed engine...); each ``step()`` counts one ``global_step`` (as Lightning counts them),
``max_steps`` included. Schedulers are stepped by the user (Lightning). Gradient accumulation and
clipping are the user's job too (``self.clip_gradients(opt, gradient_clip_val, gradient_clip_algorithm)``
clips through the strategy, :meth:`ManualOptimization.clip_gradients`): the Trainer's
``accumulate_grad_batches`` and ``gradient_clip_val`` are rejected with a clear error, as Lightning
does. DeepSpeed takes one optimizer per model.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Set

from trainforge.callbacks.events import Event
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    # type hints only: TrainingModule imports this module, and the Accelerator imports TrainingModule
    from trainforge.trainer.accelerator.accelerator import Accelerator
    from trainforge.trainer.loop.metric_logging import MetricLogging
    from trainforge.trainer.loop.settings import LoopConfig, Progress


class ManualOptimization:
    """The manual-optimization half of the loop, a part the Trainer builds once and binds to each fit
    (``bind``: the module, the prepared model and optimizers, the step function). ``ManualOptimizer``
    (below, same module) calls back into it; the module reaches it through the Trainer's public
    ``manual_optimizers()``, ``manual_backward()`` and ``clip_optimizer_gradients()``."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: LoopConfig,
        progress: Progress,
        fire: Callable[..., None],
        logging: MetricLogging,
    ) -> None:
        self.accelerator, self.strategy = accelerator, accelerator.strategy
        self.config, self.progress, self.fire, self.logging = config, progress, fire, logging
        self.module: Any = None
        self.model: Any = None
        self.prepared: List[Any] = []
        self.training_step: Any = None
        # ids of the optimizers stepped since the last backward
        self._stepped: Optional[Set[int]] = None
        self._warned_double_step = False

    def bind(self, module: Any, model: Any, prepared_optimizers: List[Any], training_step: Any) -> None:
        """What one fit trains: the module, its prepared model and optimizers, and its training step."""
        self.module, self.model, self.training_step = module, model, training_step
        self.prepared = list(prepared_optimizers)

    @property
    def optimizers(self) -> List[Any]:
        return [o.optimizer for o in self.prepared]

    def check_config(self) -> None:
        cfg = self.config
        if cfg.accumulate_grad_batches != 1:
            raise ConfigurationError(
                f"accumulate_grad_batches={cfg.accumulate_grad_batches} with manual optimization "
                "(automatic_optimization = False): accumulate in training_step yourself (step the "
                "optimizers every N batches), as in Lightning"
            )
        if cfg.gradient_clip_val is not None:
            raise ConfigurationError(
                f"gradient_clip_val={cfg.gradient_clip_val} with manual optimization: clip in "
                "training_step (self.clip_gradients(opt, gradient_clip_val=..., gradient_clip_algorithm='norm') "
                "after manual_backward), as in Lightning"
            )

    def manual_optimizers(self) -> list:
        """What ``TrainingModule.optimizers()`` hands out: each optimizer, stepping through this part."""
        return [ManualOptimizer(opt, self) for opt in self.optimizers]

    def manual_backward(self, loss: Any) -> None:
        """``TrainingModule.manual_backward``: backward through the strategy, with the backward events."""
        self._stepped = set()
        self.fire(Event.BEFORE_BACKWARD, loss)
        self.strategy.prepare_for_manual_backward(self.model, loss)
        self.accelerator.backward(loss, self.model)
        self.fire(Event.AFTER_BACKWARD)

    def clip_gradients(self, optimizer: Any, clip_val: Any, algorithm: Any) -> None:
        """``TrainingModule.clip_gradients``: Lightning's arguments and defaults (the Trainer's
        ``gradient_clip_val``/``gradient_clip_algorithm``; None or 0: nothing is clipped), clipped
        with the strategy's ``clip_gradients`` as the automatic loop does, AMP gradients unscaled first."""
        raw = optimizer.optimizer if isinstance(optimizer, ManualOptimizer) else optimizer
        clip_val, algorithm = self._clip_settings(optimizer, raw, clip_val, algorithm)
        if clip_val == 0:
            return
        if self.accelerator.precision.scaler is not None:
            # once per step: the step does not unscale again
            self.accelerator.precision.unscale_(raw)
        params = [p for group in raw.param_groups for p in group["params"]]
        if algorithm.lower() == "norm":
            self.strategy.clip_gradients(params, max_norm=float(clip_val))
        else:
            self.strategy.clip_gradients(params, clip_value=float(clip_val))

    def _clip_settings(self, optimizer: Any, raw: Any, clip_val: Any, algorithm: Any) -> tuple[float, str]:
        """``clip_gradients``' value and algorithm, defaulted from the Trainer's settings and checked against them."""
        if not any(raw is opt for opt in self.optimizers):
            raise ConfigurationError(
                f"clip_gradients({type(optimizer).__name__}): not one of the optimizers of this run (give one "
                "that self.optimizers() returns)"
            )
        cfg = self.config
        if clip_val is None:
            clip_val = cfg.gradient_clip_val or 0.0
        elif cfg.gradient_clip_val is not None and cfg.gradient_clip_val != clip_val:
            raise ConfigurationError(
                f"clip_gradients(gradient_clip_val={clip_val!r}) but the Trainer has gradient_clip_val="
                f"{cfg.gradient_clip_val!r}: set one of them"
            )
        if isinstance(clip_val, bool) or not isinstance(clip_val, (int, float)) or not clip_val >= 0:
            raise ConfigurationError(
                f"clip_gradients(gradient_clip_val={clip_val!r}): give a number >= 0 (0 or None: no clipping)"
            )
        if algorithm is None:
            algorithm = cfg.gradient_clip_algorithm if cfg.gradient_clip_val is not None else "norm"
        if not isinstance(algorithm, str) or algorithm.lower() not in ("norm", "value"):
            raise ConfigurationError(
                f"clip_gradients(gradient_clip_algorithm={algorithm!r}): give 'norm' (total norm) or 'value'"
            )
        if cfg.gradient_clip_val is not None and algorithm.lower() != cfg.gradient_clip_algorithm:
            raise ConfigurationError(
                f"clip_gradients(gradient_clip_algorithm={algorithm!r}) but the Trainer has "
                f"gradient_clip_algorithm={cfg.gradient_clip_algorithm!r}: set one of them"
            )
        return clip_val, algorithm

    def run_step(self, batch: Any, batch_idx: int) -> Any:
        """One batch: the user's training_step does backward and steps; metrics are popped at the
        log points the automatic loop uses. Returns what training_step returned."""
        before = self.progress.global_step
        self._stepped = set()
        with self.accelerator.autocast():
            output = self.training_step(batch, batch_idx)
        after, every = self.progress.global_step, self.config.log_every_n_steps
        if after // every > before // every:
            self.logging.emit_step_metrics()
        return output

    def optimizer_step(self, raw: Any, closure: Any) -> Any:
        module = self.module
        if module is None:  # handed out by fit, which sets the module first
            raise AttributeError("'NoneType' object has no attribute 'automatic_optimization' (trainer.module)")
        if module.automatic_optimization:
            # two updates per batch, counted twice
            raise ConfigurationError(
                f"{type(module).__name__} calls self.optimizers().step() under automatic optimization, "
                "where the Trainer steps the optimizer itself after training_step returns the loss: remove the "
                "call, or set self.automatic_optimization = False and step (and backward) by hand"
            )
        if closure is not None:
            closure()
        stepped = self._stepped if self._stepped is not None else set()
        # the same gradients applied twice
        if id(raw) in stepped and not self._warned_double_step:
            self._warned_double_step = True
            warnings.warn(
                f"{type(raw).__name__}.step() ran twice without a manual_backward in between (batch "
                f"{self.progress.batch_idx} of training_step): the same gradients were applied twice and "
                "global_step counted both; step once per backward",
                UserWarning,
                stacklevel=3,
            )
        stepped.add(id(raw))
        self._stepped = stepped
        if self.accelerator.precision.scaler is not None:
            self.accelerator.precision.unscale_(raw)
        self.fire(Event.BEFORE_OPTIMIZER_STEP, raw)
        out = self.strategy.optimizer_step(raw)
        self.progress.global_step += 1
        return out


class ManualOptimizer:
    """What ``self.optimizers()`` returns: the optimizer, whose ``step`` also fires
    ``on_before_optimizer_step`` and counts a global step, and ``zero_grad`` ``on_before_zero_grad``."""

    def __init__(self, optimizer: Any, manual: ManualOptimization) -> None:
        self.optimizer, self._manual = optimizer, manual

    def step(self, closure: Any = None) -> Any:
        return self._manual.optimizer_step(self.optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._manual.fire(Event.BEFORE_ZERO_GRAD, self.optimizer)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, state_dict ...
        return getattr(self.optimizer, name)
