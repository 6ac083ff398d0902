"""``Accelerator``: HF Accelerate's thin wrapper for users who keep their own loop.

Converting a raw loop takes about five lines::

    accelerator = Accelerator(precision="bf16-mixed", gradient_accumulation_steps=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:                       # sharded, on the device, set_epoch handled
        with accelerator.accumulate(model):    # no gradient sync until the window ends
            loss = model(batch)
            accelerator.backward(loss)         # scaled for accumulation and fp16
            optimizer.step(); optimizer.zero_grad()   # act only on the window's last micro-batch

The Trainer runs on this same object, so placement, precision, accumulation and checkpointing
have one code path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import warnings
from typing import Any, Callable, ContextManager, Dict, List, Optional, Union

import torch
from torch import nn

from trainforge.strategies import Strategy, resolve_strategy
from trainforge.strategies.base import RunSettings
from trainforge.strategies.checkpoint.async_save import AsyncCheckpointer
from trainforge.strategies.data.utils import apply_to_tensors
from trainforge.strategies.devices import check_device_matches, normalize_accelerator
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.materialize import init_module_context
from trainforge.strategies.precision import Precision
from trainforge.trainer.accelerator.collectives import Collectives
from trainforge.trainer.accelerator.data import DataPreparation, data_options
from trainforge.trainer.accelerator.process_control import ProcessControl
from trainforge.trainer.accelerator.token_loss import ItemWeightedLoss
from trainforge.trainer.accelerator.wrappers import (
    GradientState,
    PreparedDataLoader,
    PreparedOptimizer,
    PreparedScheduler,
)
from trainforge.trainer.cluster.stop_signals import SignalsArg, StopSignals
from trainforge.trainer.compat.accelerate.accelerator_args import AccelerateCompat, AccelerateOptions, release_memory
from trainforge.trainer.inference.api import BigModelInference
from trainforge.trainer.loop.module_hooks import STEP_NAMES, step_arguments


class Accelerator(DataPreparation, Collectives, BigModelInference, ProcessControl, ItemWeightedLoss, AccelerateCompat):
    """Accelerate's options also accepted: ``even_batches`` (False: no padding duplicates on the
    last batch; ranks may get one batch fewer), ``split_batches`` (True: the loader's batch size is
    the global batch, split between processes; schedulers then step once per optimizer step),
    ``project_dir`` + ``automatic_checkpoint_naming`` + ``total_limit`` (or a ``project_config``
    object with those attributes): ``save_state()`` with no path writes
    ``<project_dir>/checkpoints/checkpoint_<i>`` and keeps the newest ``total_limit``,
    ``load_state()`` with no path loads the newest. ``dispatch_batches`` (None: True for an
    IterableDataset on several processes, as Accelerate): rank 0 reads the loader and every process
    receives its slice of each step (``trainer/accelerator/batch_dispatch.py``); False: every process reads its own
    share (an IterableDataset's stream is split by ``strategies/data/iterable.py``). These three
    also come in ``dataloader_config`` (``trainforge.utils.DataLoaderConfiguration``, or Accelerate's).
    Accelerate's ``mixed_precision``, ``cpu``, ``log_with``, ``kwargs_handlers``, ``rng_types`` and
    ``device_placement`` too: see ``trainer/compat/accelerate/accelerator_args.py``."""

    def __init__(
        self,
        strategy: Union[str, Strategy, None] = None,
        precision: Optional[str] = None,
        gradient_accumulation_steps: Optional[int] = None,
        seed: int = 0,
        *,
        accelerator: Optional[str] = None,
        even_batches: bool = True,
        split_batches: bool = False,
        dispatch_batches: Optional[bool] = None,
        dataloader_config: Any = None,
        project_dir: Optional[str] = None,
        project_config: Any = None,
        automatic_checkpoint_naming: bool = False,
        total_limit: Optional[int] = None,
        mixed_precision: Optional[str] = None,
        cpu: bool = False,
        log_with: Any = None,
        kwargs_handlers: Optional[List[Any]] = None,
        rng_types: Optional[List[str]] = None,
        device_placement: bool = True,
        stop_signals: SignalsArg = None,
        **accelerate_only: Any,
    ) -> None:
        from trainforge.trainer.cli.launch_settings import launch_defaults, strategy_kwargs

        compat = AccelerateOptions(
            precision=precision,
            mixed_precision=mixed_precision,
            accelerator=accelerator,
            cpu=cpu,
            kwargs_handlers=kwargs_handlers,
            rng_types=rng_types,
            device_placement=device_placement,
            log_with=log_with,
            dataloader_config=dataloader_config,
            project_config=project_config,
            others=accelerate_only,
        )
        precision, accelerator = compat.precision, compat.accelerator
        even_batches, split_batches, dispatch_batches = data_options(
            *compat.loader_arguments(even_batches, split_batches, dispatch_batches)
        )
        project_dir, automatic_checkpoint_naming, total_limit = compat.project_arguments(
            project_dir, automatic_checkpoint_naming, total_limit
        )  # and log_with, checked against the logging directory
        defaults = launch_defaults()  # what `trainforge launch` was told; explicit arguments win
        strategy = strategy if strategy is not None else defaults.get("strategy", "auto")
        precision = precision if precision is not None else defaults.get("precision", "32")
        accum = (
            gradient_accumulation_steps
            if gradient_accumulation_steps is not None
            else defaults.get("gradient_accumulation_steps", 1)
        )
        if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
            raise ConfigurationError(
                f"gradient_accumulation_steps={accum!r} must be an int >= 1 (1 means no accumulation)"
            )
        kwargs = strategy_kwargs(strategy, defaults) if isinstance(strategy, str) else {}
        strategy, kwargs = compat.strategy_arguments(strategy, kwargs)
        self.strategy = resolve_strategy(strategy, **kwargs)
        accelerator = accelerator if accelerator is not None else defaults.get("accelerator", "auto")
        normalize_accelerator(accelerator)  # a bad value fails here, before any process group starts
        check_device_matches(accelerator, self.strategy.requested_device)
        self.strategy.setup_environment(accelerator)
        self.precision = Precision(precision, self.strategy.root_device)
        self.gradient_accumulation_steps = accum
        self.run_settings = RunSettings(
            precision=self.precision, accumulation_steps=accum, device_placement=compat.device_placement
        )
        self.strategy.configure(self.run_settings)
        self.gradient_state = GradientState()
        self._no_sync_is_noop = type(self.strategy).no_backward_sync is Strategy.no_backward_sync
        self.seed = seed
        self.step = 0  # micro-batches into the current accumulation window
        self._models: List[nn.Module] = []
        self._optimizers: List[PreparedOptimizer] = []
        self._schedulers: List[PreparedScheduler] = []
        self._dataloaders: List[PreparedDataLoader] = []
        self._custom_objects: List[Any] = []
        self.even_batches, self.split_batches, self.dispatch_batches = even_batches, split_batches, dispatch_batches
        if automatic_checkpoint_naming and project_dir is None:
            raise ConfigurationError(
                "automatic_checkpoint_naming=True needs project_dir=<directory> (checkpoints "
                "go to <project_dir>/checkpoints/checkpoint_<i>)"
            )
        if total_limit is not None and (not isinstance(total_limit, int) or total_limit < 1):
            raise ConfigurationError(f"total_limit={total_limit!r} must be an int >= 1 or None (keep all)")
        self.project_dir, self.total_limit = project_dir, total_limit
        self.automatic_checkpoint_naming = automatic_checkpoint_naming
        self._async_checkpointer: Optional[AsyncCheckpointer] = None  # created by the first async save
        self.setup_accelerate(compat)
        self.stop_signals = StopSignals(stop_signals, "Accelerator(stop_signals)", install=True)  # stop_requested

    # ---- topology --------------------------------------------------------------------------------
    device = property(lambda self: self.strategy.root_device)
    process_index = property(lambda self: self.strategy.global_rank)
    local_process_index = property(lambda self: self.strategy.local_rank)
    num_processes = property(lambda self: self.strategy.world_size)
    is_main_process = property(lambda self: self.strategy.is_global_zero)
    is_local_main_process = property(lambda self: self.strategy.local_rank == 0)
    sync_gradients = property(lambda self: self.gradient_state.sync_gradients)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        self.strategy.barrier()

    def update_run_settings(self, **changes: Any) -> None:
        """Hand the strategy new ``RunSettings`` with ``changes`` (the Trainer's clipping; the
        micro-batch size, known once the training loader is prepared)."""
        fields = [f.name for f in dataclasses.fields(RunSettings)]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise ConfigurationError(f"update_run_settings({unknown[0]}=...): not a run setting; choose from {fields}")
        self.run_settings = dataclasses.replace(self.run_settings, **changes)
        self.strategy.configure(self.run_settings)

    # ---- prepare ---------------------------------------------------------------------------------
    def init_module(self, empty_init: Optional[bool] = None) -> ContextManager[None]:
        """``Trainer.init_module``'s: build the model inside with ``empty_init=True`` and ``prepare``
        materialises it (FSDP: shard by shard); ``trainforge.load_pretrained`` gives it its weights."""
        return init_module_context(self.strategy, empty_init)

    def prepare(self, *objects: Any) -> Any:
        """Models, optimizers, schedulers and dataloaders, in any order; returns them in that order."""
        loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader)]
        if loaders and self.run_settings.micro_batch_size is None:
            self.update_run_settings(micro_batch_size=loaders[0].batch_size)  # before setup: DeepSpeed's config
        models = [o for o in objects if isinstance(o, nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        if models:  # a layout chosen from the model ("auto" sizes) decides the loaders' shards
            self.strategy.plan_layout(models[0], loaders[0] if loaders else None)
        if len(models) > 1 and self.strategy.world_size > 1 and optimizers:
            raise ConfigurationError(
                "prepare() got several models with optimizers; prepare one trained model per "
                "call (frozen models can be prepared in a separate call)"
            )
        result: Dict[int, Any] = {}
        optimizers_out = optimizers
        for model in models:
            result[id(model)], optimizers_out = self._setup_model(model, optimizers)
            self._autocast_forward(result[id(model)])
        for original, opt in zip(optimizers, optimizers_out):
            result[id(original)] = self._prepared_optimizer(opt)
        out = []
        for obj in objects:
            if id(obj) in result:
                out.append(result[id(obj)])
            elif _is_scheduler(obj):
                out.append(self._prepare_scheduler(obj))
            elif isinstance(obj, torch.utils.data.DataLoader):
                out.append(self.prepare_data_loader(obj))
            else:
                out.append(obj)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model_with_optimizers(
        self, model: nn.Module, build: Callable[[], Any]
    ) -> "tuple[nn.Module, List[PreparedOptimizer]]":
        """The Trainer's order: place and wrap ``model``, then call ``build()`` for its optimizers,
        so they see the final device and parameters (fused AdamW on CUDA, FSDP's DTensors)."""
        wrapped, built = self._setup_model(model, build)
        return wrapped, [self._prepared_optimizer(opt) for opt in built]

    def _autocast_forward(self, model: nn.Module) -> None:
        """Accelerate's mixed precision: a model prepared under ``bf16``/``fp16``/``fp8`` computes its
        forward under autocast and returns float32 tensors, with or without ``accelerator.autocast()``
        around the call. Not where the backend owns precision (DeepSpeed), nor twice."""
        module = self.unwrap_model(model)
        if self.precision.autocast_dtype is None or self.strategy.loss_scaling_in_backend:
            return
        if getattr(module.forward, "_trainforge_autocast", False):
            return
        forward = getattr(module.forward, "__func__", None)
        if forward is None:  # a forward set on the instance: wrap it as it is
            bound = module.forward

            def forward(self_: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return bound(*args, **kwargs)

        precision = self.precision

        def autocast_forward(self_: nn.Module, *args: Any, **kwargs: Any) -> Any:
            with precision.autocast():
                out = forward(self_, *args, **kwargs)
            return apply_to_tensors(out, _to_float32)

        autocast_forward._trainforge_autocast = True  # type: ignore[attr-defined]
        # bound to the module: a deepcopy of the model binds the copy (copy handles MethodType)
        setattr(module, "forward", types.MethodType(autocast_forward, module))

    def _setup_model(self, model: nn.Module, optimizers: Any) -> "tuple[nn.Module, List[Any]]":
        wrapped, built = self.strategy.setup(model, optimizers)
        # What the backend took over from the precision (DeepSpeed: loss scaling, half-precision inputs).
        if self.strategy.loss_scaling_in_backend:
            self.precision.scaler = None
        if self.strategy.input_dtype is not None:
            self.precision.input_dtype = self.strategy.input_dtype
        self._models.append(wrapped)
        return wrapped, built

    def _prepared_optimizer(self, optimizer: Any) -> PreparedOptimizer:
        prepared = PreparedOptimizer(optimizer, self.strategy, self.gradient_state)
        self._optimizers.append(prepared)
        return prepared

    def _prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        steps = 1 if self.split_batches else self.num_processes  # Accelerate: once per process per step
        prepared = PreparedScheduler(scheduler, self.gradient_state, steps_per_call=steps)
        self._schedulers.append(prepared)
        return prepared

    # ---- the step --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: Optional[nn.Module] = None, num_items: Any = None) -> None:
        """``num_items``: ``loss`` is summed over that many items (tokens): ``trainer/accelerator/token_loss.py``."""
        model = model if model is not None else (self._models[0] if self._models else None)
        self.strategy.backward(self.loss_to_backward(loss, num_items), model)  # a mean divided by the steps
        self.end_item_window(model)  # a no-op unless num_items were given and this micro-batch syncs

    def forward_backward(
        self, model: nn.Module, batch: Any, loss_fn: Optional[Callable[[Any, Any], Any]] = None
    ) -> torch.Tensor:
        """Forward, loss and backward of one batch ``(inputs, target)``: ``loss_fn(model(*inputs),
        target)`` (default ``model.loss_fn``) under autocast, then ``backward``; returns the loss. With
        pipeline parallelism the strategy's schedule runs it over micro-batches, stage by stage, and
        the loss returned is the batch mean, the same on every rank: one loop for both."""
        loss_fn = loss_fn if loss_fn is not None else getattr(self.unwrap_model(model), "loss_fn", None)
        if self.strategy.pipelined:
            return self.strategy.forward_backward(model, None, batch, 0, loss_fn=loss_fn)
        if not callable(loss_fn):
            raise ConfigurationError(
                "forward_backward(model, batch) needs loss_fn(output, target): pass loss_fn= or define model.loss_fn"
            )
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ConfigurationError(
                f"forward_backward needs each batch as (inputs, target), got {type(batch).__name__}"
            )
        inputs, target = batch
        with self.autocast():
            loss = loss_fn(model(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,))), target)
        self.backward(loss, model)
        return loss

    def accumulate(self, *models: nn.Module) -> ContextManager:
        """Inside: gradients sync (and optimizers step) only on the window's last micro-batch or the
        dataloader's last batch."""
        self.step += 1
        sync = self.step % self.gradient_accumulation_steps == 0 or self.gradient_state.end_of_dataloader
        if sync:
            self.step = 0
        self.gradient_state.sync_gradients = sync
        if self._no_sync_is_noop:  # one device: nothing to skip, no per-step context objects
            return _NO_SYNC
        return _Accumulate(self.strategy, models or self._models[:1], skip_sync=not sync)

    def autocast(self) -> Any:
        return self.precision.autocast()

    def unscale_gradients(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        for opt in [optimizer] if optimizer is not None else self._optimizers:
            self.precision.unscale_(opt.optimizer if isinstance(opt, PreparedOptimizer) else opt)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
        self.unscale_gradients()
        return self.strategy.clip_gradients(list(parameters), max_norm=max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.unscale_gradients()
        self.strategy.clip_gradients(list(parameters), clip_value=clip_value)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        model = self.strategy.unwrap(model)
        return getattr(model, "_orig_mod", model)  # torch.compile's wrapper

    # ---- state -----------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        bad = [o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ConfigurationError(
                f"register_for_checkpointing got {bad[0]!r}, which has no "
                "state_dict()/load_state_dict(); register objects that have both"
            )
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        """Everything to resume exactly; no ``output_dir``: ``<project_dir>/checkpoints/checkpoint_<i>``, the newest
        ``total_limit`` kept. ``async_save=True``: return once the state is in host memory, written in the background
        (``wait_for_checkpoint``; ``end_training`` and exit wait). ``trainable_only``: leave frozen parameters out."""
        from trainforge.trainer.checkpoint.contents import save_accelerator_state, save_project_checkpoint

        if not safe_serialization:
            warnings.warn(
                "save_state(safe_serialization=False): trainforge always writes weights as safetensors "
                "(and the rest with torch.save, loaded weights_only)",
                UserWarning,
                stacklevel=2,
            )
        if output_dir is None:
            return save_project_checkpoint(self, self._checkpoint_parts(), **kwargs)
        return save_accelerator_state(self, output_dir, self._checkpoint_parts(), **kwargs)

    @property
    def async_checkpointer(self) -> AsyncCheckpointer:
        if self._async_checkpointer is None:
            self._async_checkpointer = AsyncCheckpointer(self.strategy)
        return self._async_checkpointer

    def check_checkpoint(self) -> None:
        """Raise now (CheckpointError) if the asynchronous save in flight has failed; never blocks."""
        if self._async_checkpointer is not None:
            self._async_checkpointer.check()

    def wait_for_checkpoint(self) -> None:
        """Block until the asynchronous save in flight is committed; raise CheckpointError if it failed."""
        if self._async_checkpointer is not None:
            self._async_checkpointer.wait()

    def load_state(self, input_dir: Optional[str] = None, **kwargs: Any) -> Any:
        """With no ``input_dir`` (automatic_checkpoint_naming): the newest project checkpoint."""
        from trainforge.trainer.checkpoint.contents import load_accelerator_state, newest_project_checkpoint

        return load_accelerator_state(
            self,
            input_dir if input_dir is not None else newest_project_checkpoint(self),
            self._checkpoint_parts(),
            **kwargs,
        )

    def _checkpoint_parts(self) -> Any:
        """What save_state/load_state save and restore (``trainer.checkpointing.CheckpointParts``)."""
        from trainforge.trainer.checkpoint.contents import CheckpointParts

        if len(self._models) > 1:
            raise ConfigurationError(
                f"save_state got {len(self._models)} prepared models; it saves one trained model "
                "(save others with save_model)"
            )
        return CheckpointParts(
            "accelerator",
            self._models[0] if self._models else None,
            list(self._optimizers),
            list(self._schedulers),
            list(self._dataloaders),
            custom=list(self._custom_objects),
        )

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """The loader whose next pass starts ``num_batches`` into the epoch, without loading them
        (Accelerate). A loader restored by ``load_state`` already continues where it was saved: asking
        to skip that same position again (or 0 after a checkpoint saved on an epoch's last batch, as
        run_clm_no_trainer.py computes it) is a no-op, logged; anything else an error."""
        return dataloader.skip_first_batches(num_batches)

    def save_model(
        self, model: nn.Module, save_directory: str, max_shard_size: Any = None, adapter_only: Optional[bool] = None
    ) -> Any:
        """The whole model as safetensors, or a PEFT model's adapter in PEFT's format (trainer/checkpoint/adapters.py)."""
        from trainforge.trainer.checkpoint.contents import save_weights

        self.wait_for_checkpoint()  # one save at a time (an async one may be in flight)
        return save_weights(self.strategy, model, save_directory, max_shard_size, adapter_only)

    def free_memory(self, *objects: Any) -> List[Any]:
        """Forget everything prepared (Accelerate's): ``None`` for each of ``objects`` (``model, opt =
        acc.free_memory(model, opt)``), garbage collected, device caches emptied."""
        self.wait_for_checkpoint()
        for held in (self._models, self._optimizers, self._schedulers, self._dataloaders, self._custom_objects):
            held.clear()
        self.step = 0
        return release_memory(*objects)

    def run_step(self, model: nn.Module, method: str, *args: Any) -> Any:
        """Call ``module.<method>(*args)`` through the prepared model's ``forward``, so wrappers that act
        in forward (DDP's reducer, FSDP's parameter gathering) see it."""
        return self.step_function(model, method)(*args)

    def step_function(self, model: nn.Module, method: str) -> Callable[..., Any]:
        """``run_step(model, method, ...)`` as one callable, built once (the Trainer calls it per batch)."""
        user = self.unwrap_model(model)
        step: Callable = getattr(user, method)
        if method in STEP_NAMES:  # training_step(self, batch) is called without batch_idx (Lightning)
            step = step_arguments(step)
        if model is user and not self.strategy.redirect_forward:
            return step

        def through_forward(*args: Any) -> Any:
            original = user.__dict__.get("forward")

            def redirected(*a: Any, **k: Any) -> Any:
                _restore_forward(user, original)
                return step(*a, **k)

            user.forward = redirected
            try:
                return model(*args)
            finally:
                _restore_forward(user, original)

        return through_forward


_NO_SYNC = contextlib.nullcontext()


class _Accumulate:
    """``accumulate``'s context: every micro-batch enters the strategy's ``no_backward_sync`` with
    ``enabled`` = "this micro-batch does not sync" (DeepSpeed needs the call on sync steps too, to
    mark the boundary). A class, not a generator: it runs once per micro-batch."""

    __slots__ = ("strategy", "models", "skip_sync", "contexts")

    def __init__(self, strategy: Strategy, models: Any, skip_sync: bool) -> None:
        self.strategy, self.models, self.skip_sync = strategy, models, skip_sync
        self.contexts: List[ContextManager[Any]] = []

    def __enter__(self) -> None:
        for model in self.models:
            ctx = self.strategy.no_backward_sync(model, enabled=self.skip_sync)
            ctx.__enter__()
            self.contexts.append(ctx)

    def __exit__(self, *exc: Any) -> None:
        while self.contexts:
            self.contexts.pop().__exit__(*exc)


def _restore_forward(module: nn.Module, original: Any) -> None:
    if original is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original


def _is_scheduler(obj: Any) -> bool:
    lr_scheduler = torch.optim.lr_scheduler
    base = getattr(lr_scheduler, "LRScheduler", None) or lr_scheduler._LRScheduler
    return isinstance(obj, (base, lr_scheduler.ReduceLROnPlateau))


def _to_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
