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
import warnings
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Union

import torch
from torch import nn

from trainforge.strategies import Strategy, resolve_strategy
from trainforge.strategies.base import RunSettings
from trainforge.strategies.checkpoint.async_save import AsyncCheckpointer
from trainforge.strategies.data.utils import apply_to_tensors
from trainforge.strategies.devices import check_device_matches, normalize_accelerator
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.precision import Precision
from trainforge.trainer.process_control import ProcessControl
from trainforge.trainer.wrappers import GradientState, PreparedDataLoader, PreparedOptimizer, PreparedScheduler


class Accelerator(ProcessControl):
    """Accelerate's options also accepted: ``even_batches`` (False: no padding duplicates on the
    last batch; ranks may get one batch fewer), ``split_batches`` (True: the loader's batch size is
    the global batch, split between processes; schedulers then step once per optimizer step),
    ``project_dir`` + ``automatic_checkpoint_naming`` + ``total_limit`` (or a ``project_config``
    object with those attributes): ``save_state()`` with no path writes
    ``<project_dir>/checkpoints/checkpoint_<i>`` and keeps the newest ``total_limit``,
    ``load_state()`` with no path loads the newest. ``dispatch_batches`` (None: True for an
    IterableDataset on several processes, as Accelerate): rank 0 reads the loader and every process
    receives its slice of each step (``trainer/dispatch.py``); False: every process reads its own
    share (an IterableDataset's stream is split by ``strategies/data/iterable.py``). These three
    also come in ``dataloader_config`` (Accelerate's ``DataLoaderConfiguration``, duck-typed)."""

    def __init__(self, strategy: Union[str, Strategy, None] = None, precision: Optional[str] = None,
                 gradient_accumulation_steps: Optional[int] = None, seed: int = 0, *,
                 accelerator: Optional[str] = None, even_batches: bool = True,
                 split_batches: bool = False, dispatch_batches: Optional[bool] = None, dataloader_config: Any = None,
                 project_dir: Optional[str] = None, project_config: Any = None,
                 automatic_checkpoint_naming: bool = False, total_limit: Optional[int] = None) -> None:
        from trainforge.trainer.launch_config import launch_defaults, strategy_kwargs

        even_batches, split_batches, dispatch_batches = _data_options(
            even_batches, split_batches, dispatch_batches, dataloader_config)
        defaults = launch_defaults()  # what `trainforge launch` was told; explicit arguments win
        strategy = strategy if strategy is not None else defaults.get("strategy", "auto")
        precision = precision if precision is not None else defaults.get("precision", "32")
        accum = gradient_accumulation_steps if gradient_accumulation_steps is not None else \
            defaults.get("gradient_accumulation_steps", 1)
        if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
            raise ConfigurationError(f"gradient_accumulation_steps={accum!r} must be an int >= 1 "
                                     "(1 means no accumulation)")
        kwargs = strategy_kwargs(strategy, defaults) if isinstance(strategy, str) else {}
        self.strategy = resolve_strategy(strategy, **kwargs)
        accelerator = accelerator if accelerator is not None else defaults.get("accelerator", "auto")
        normalize_accelerator(accelerator)  # a bad value fails here, before any process group starts
        check_device_matches(accelerator, self.strategy._device)
        self.strategy.setup_environment(accelerator)
        self.precision = Precision(precision, self.strategy.root_device)
        self.gradient_accumulation_steps = accum
        self.run_settings = RunSettings(precision=self.precision, accumulation_steps=accum)
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
        if project_config is not None:  # Accelerate's ProjectConfiguration, duck-typed
            project_dir = project_dir or getattr(project_config, "project_dir", None)
            automatic_checkpoint_naming = getattr(project_config, "automatic_checkpoint_naming",
                                                  automatic_checkpoint_naming)
            total_limit = getattr(project_config, "total_limit", total_limit)
        if automatic_checkpoint_naming and project_dir is None:
            raise ConfigurationError("automatic_checkpoint_naming=True needs project_dir=<directory> (checkpoints "
                                     "go to <project_dir>/checkpoints/checkpoint_<i>)")
        if total_limit is not None and (not isinstance(total_limit, int) or total_limit < 1):
            raise ConfigurationError(f"total_limit={total_limit!r} must be an int >= 1 or None (keep all)")
        self.project_dir, self.total_limit = project_dir, total_limit
        self.automatic_checkpoint_naming = automatic_checkpoint_naming
        self._async_checkpointer: Optional[AsyncCheckpointer] = None  # created by the first async save

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
        self.run_settings = dataclasses.replace(self.run_settings, **changes)
        self.strategy.configure(self.run_settings)

    # ---- prepare ---------------------------------------------------------------------------------
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
            raise ConfigurationError("prepare() got several models with optimizers; prepare one trained model per "
                                     "call (frozen models can be prepared in a separate call)")
        result: Dict[int, Any] = {}
        optimizers_out = optimizers
        for model in models:
            result[id(model)], optimizers_out = self._setup_model(model, optimizers)
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

    def prepare_model_with_optimizers(self, model: nn.Module, build: Callable[[], Any]
                                      ) -> "tuple[nn.Module, List[PreparedOptimizer]]":
        """The Trainer's order: place and wrap ``model``, then call ``build()`` for its optimizers,
        so they see the final device and parameters (fused AdamW on CUDA, FSDP's DTensors)."""
        wrapped, built = self._setup_model(model, build)
        return wrapped, [self._prepared_optimizer(opt) for opt in built]

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

    def prepare_data_loader(self, loader: torch.utils.data.DataLoader) -> PreparedDataLoader:
        from trainforge.trainer.seed import seeds_workers, worker_init_fn

        dispatch = self._dispatches(loader)
        if dispatch:  # every rank builds the whole (unsharded) loader; only rank 0 iterates it
            from trainforge.strategies.data.loader import prepare_dataloader

            sharded = prepare_dataloader(loader, rank=0, world_size=1, seed=self.seed)
        else:
            if self.split_batches or not self.even_batches:
                loader = _rebuilt(loader, self.num_processes, self.split_batches)
            sharded = self.strategy.setup_dataloader(loader, seed=self.seed)
            if not self.even_batches and hasattr(sharded.sampler, "pad"):
                _unpadded(sharded.sampler)
            if not self.even_batches and sharded.kind == "stream":
                sharded.dataset.even_batches = False  # a split stream's last round is not completed
        if self.run_settings.micro_batch_size is None:  # the first loader prepared is the training one
            self.update_run_settings(micro_batch_size=loader.batch_size)
        if sharded.num_workers > 0 and sharded.worker_init_fn is None and seeds_workers():
            sharded.worker_init_fn = worker_init_fn
        # The random draws a plain DataLoader makes when an epoch starts (worker base seed, shuffle
        # order) are made by PreparedDataLoader from the user's generator or the global RNG, as torch
        # would; the loader itself gets a private generator, so that recreating its iterator on
        # resume draws nothing from the user's streams.
        sharded.generator = torch.Generator()
        sampler = loader.sampler if loader.batch_size is not None else getattr(loader.batch_sampler, "sampler", None)
        world = self.num_processes
        prepared = PreparedDataLoader(sharded, self.device, self.gradient_state, self.precision,
                                      base_generator=loader.generator,
                                      order_generator=getattr(sampler, "generator", None),
                                      broadcast=(lambda obj: self.strategy.broadcast(obj, 0)) if world > 1 else None,
                                      dispatcher=self._dispatcher(sharded) if dispatch else None,
                                      gather_object=self.strategy.all_gather_object if world > 1 else None,
                                      device_batches=self.strategy.device_batches)
        self._dataloaders.append(prepared)
        return prepared

    def _dispatches(self, loader: torch.utils.data.DataLoader) -> bool:
        """dispatch_batches for this loader: None means True for an IterableDataset (Accelerate's default)."""
        _data_options(self.even_batches, self.split_batches, self.dispatch_batches, None)  # also when set later
        if self.num_processes == 1:
            return False
        dispatch = self.dispatch_batches
        if dispatch is None:
            dispatch = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        if dispatch and self.strategy.data_parallel_size != self.num_processes:
            raise ConfigurationError(
                f"dispatch_batches=True is not built for {type(self.strategy).__name__} with data-parallel size "
                f"{self.strategy.data_parallel_size} of {self.num_processes} processes (it dispatches over all of "
                "them): pass dispatch_batches=False")
        return dispatch

    def _dispatcher(self, loader: Any) -> Any:
        from trainforge.strategies.data.loader import loader_state_dict
        from trainforge.trainer.dispatch import BatchDispatcher

        return BatchDispatcher(loader, rank=self.process_index, world_size=self.num_processes, device=self.device,
                               broadcast=lambda obj: self.strategy.broadcast(obj, 0), split_batches=self.split_batches,
                               even_batches=self.even_batches, state_of=lambda: loader_state_dict(loader))

    def _prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        steps = 1 if self.split_batches else self.num_processes  # Accelerate: once per process per step
        prepared = PreparedScheduler(scheduler, self.gradient_state, steps_per_call=steps)
        self._schedulers.append(prepared)
        return prepared

    # ---- the step --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: Optional[nn.Module] = None) -> None:
        if self.gradient_accumulation_steps > 1 and not self.strategy.handles_accumulation:
            loss = loss / self.gradient_accumulation_steps
        self.strategy.backward(loss, model if model is not None else (self._models[0] if self._models else None))

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Optional[Callable[[Any, Any], Any]] = None
                         ) -> torch.Tensor:
        """Forward, loss and backward of one batch ``(inputs, target)``: ``loss_fn(model(*inputs),
        target)`` (default ``model.loss_fn``) under autocast, then ``backward``; returns the loss. With
        pipeline parallelism the strategy's schedule runs it over micro-batches, stage by stage, and
        the loss returned is the batch mean, the same on every rank: one loop for both."""
        loss_fn = loss_fn if loss_fn is not None else getattr(self.unwrap_model(model), "loss_fn", None)
        if self.strategy.pipelined:
            return self.strategy.forward_backward(model, None, batch, 0, loss_fn=loss_fn)
        if not callable(loss_fn):
            raise ConfigurationError("forward_backward(model, batch) needs loss_fn(output, target): pass loss_fn= or "
                                     "define model.loss_fn")
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ConfigurationError(f"forward_backward needs each batch as (inputs, target), got "
                                     f"{type(batch).__name__}")
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

    # ---- collectives -----------------------------------------------------------------------------
    def gather(self, data: Any) -> Any:
        """Tensors (nested in dicts/lists) from every process, concatenated along dim 0."""
        return apply_to_tensors(data, self._gather_one)

    def _gather_one(self, tensor: torch.Tensor) -> torch.Tensor:
        stacked = self.strategy.all_gather(tensor)
        return stacked if tensor.dim() == 0 else stacked.reshape(-1, *tensor.shape[1:])

    def gather_for_metrics(self, data: Any) -> Any:
        """Like ``gather`` but drops the duplicates that even sharding added on the last batch, so
        every sample of the dataset is counted exactly once. Outside a prepared loader's loop it is
        a plain ``gather`` (as in Accelerate)."""
        state = self.gradient_state
        if not (state.end_of_dataloader and state.padding and state.active_dataloaders):
            return self.gather(data)
        keep_until = -state.padding
        if state.padding_order == "contiguous":  # a split stream or dispatched batches: the tail of the gather
            return apply_to_tensors(data, lambda tensor: self._gather_one(tensor)[:keep_until])

        def gather_last(tensor: torch.Tensor) -> torch.Tensor:
            stacked = self.strategy.all_gather(tensor)        # [W, b, ...]; sample j of rank r is global
            ordered = stacked.transpose(0, 1).reshape(-1, *tensor.shape[1:])  # position j*W + r
            return ordered[:keep_until]                       # the padding is the tail of global order

        return apply_to_tensors(data, gather_last)

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        return apply_to_tensors(data, lambda t: self.strategy.all_reduce(t, reduction))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.strategy.broadcast(obj, src)

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size on any process (so they can be gathered)."""

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() == 0:
                return tensor
            size = torch.tensor(tensor.shape[dim], device=self.device)
            longest = int(self.strategy.all_reduce(size, "max"))
            if longest == tensor.shape[dim]:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = longest - tensor.shape[dim]
            filler = tensor.new_full(shape, pad_index)
            return torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=dim)

        return apply_to_tensors(data, pad)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        from trainforge.strategies.data.loader import split_between_processes

        yield split_between_processes(inputs, self.process_index, self.num_processes, apply_padding=apply_padding)

    # ---- state -----------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        bad = [o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ConfigurationError(f"register_for_checkpointing got {bad[0]!r}, which has no "
                                     "state_dict()/load_state_dict(); register objects that have both")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        """Everything to resume exactly. With no ``output_dir`` (automatic_checkpoint_naming):
        ``<project_dir>/checkpoints/checkpoint_<i>``, the newest ``total_limit`` kept. ``async_save=True``:
        return once the state is copied to host memory; the write and commit go on in the background
        (``wait_for_checkpoint``; ``end_training`` and exit wait for it)."""
        from trainforge.trainer.checkpointing import save_accelerator_state, save_project_checkpoint

        if not safe_serialization:
            warnings.warn("save_state(safe_serialization=False): trainforge always writes weights as safetensors "
                          "(and the rest with torch.save, loaded weights_only)", UserWarning, stacklevel=2)
        if output_dir is None:
            return save_project_checkpoint(self, **kwargs)
        return save_accelerator_state(self, output_dir, **kwargs)

    @property
    def async_checkpointer(self) -> AsyncCheckpointer:
        if self._async_checkpointer is None:
            self._async_checkpointer = AsyncCheckpointer(self.strategy)
        return self._async_checkpointer

    def wait_for_checkpoint(self) -> None:
        """Block until the asynchronous save in flight is committed; raise CheckpointError if it failed."""
        if self._async_checkpointer is not None:
            self._async_checkpointer.wait()

    def load_state(self, input_dir: Optional[str] = None, **kwargs: Any) -> Any:
        """With no ``input_dir`` (automatic_checkpoint_naming): the newest project checkpoint."""
        from trainforge.trainer.checkpointing import load_accelerator_state, newest_project_checkpoint

        return load_accelerator_state(self, input_dir if input_dir is not None else newest_project_checkpoint(self),
                                      **kwargs)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """The loader whose next pass starts ``num_batches`` into the epoch, without loading them
        (Accelerate). A loader restored by ``load_state`` already continues where it was saved: asking
        to skip that same position again is a no-op (with a warning), anything else an error."""
        return dataloader.skip_first_batches(num_batches)

    def save_model(self, model: nn.Module, save_directory: str, max_shard_size: Optional[int] = None) -> Any:
        from trainforge.trainer.checkpointing import save_weights

        self.wait_for_checkpoint()  # one save at a time (an async one may be in flight)
        return save_weights(self.strategy, model, save_directory, max_shard_size=max_shard_size)

    # Big-model inference (trainer/inference): the same functions, reachable from the Accelerator.
    @staticmethod
    def init_empty_weights(include_buffers: bool = True) -> Any:
        """Context: modules built inside have their weights on meta (see trainer.inference)."""
        from trainforge.trainer.inference import init_empty_weights
        return init_empty_weights(include_buffers)

    @staticmethod
    def infer_auto_device_map(model: nn.Module, **kwargs: Any) -> Dict[str, Any]:
        from trainforge.trainer.inference import infer_auto_device_map
        return infer_auto_device_map(model, **kwargs)

    @staticmethod
    def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: Any, **kwargs: Any) -> nn.Module:
        from trainforge.trainer.inference import load_checkpoint_and_dispatch
        return load_checkpoint_and_dispatch(model, checkpoint, **kwargs)

    @staticmethod
    def dispatch_model(model: nn.Module, device_map: Dict[str, Any], **kwargs: Any) -> nn.Module:
        from trainforge.trainer.inference import dispatch_model
        return dispatch_model(model, device_map, **kwargs)

    @staticmethod
    def cpu_offload(model: nn.Module, execution_device: Any = None, **kwargs: Any) -> nn.Module:
        from trainforge.trainer.inference import cpu_offload
        return cpu_offload(model, execution_device, **kwargs)

    @staticmethod
    def disk_offload(model: nn.Module, offload_dir: Any, execution_device: Any = None, **kwargs: Any) -> nn.Module:
        from trainforge.trainer.inference import disk_offload
        return disk_offload(model, offload_dir, execution_device, **kwargs)

    def end_training(self) -> None:
        self.wait_for_checkpoint()
        self.strategy.teardown()

    def run_step(self, model: nn.Module, method: str, *args: Any) -> Any:
        """Call ``module.<method>(*args)`` through the prepared model's ``forward``, so wrappers that act
        in forward (DDP's reducer, FSDP's parameter gathering) see it."""
        return self.step_function(model, method)(*args)

    def step_function(self, model: nn.Module, method: str) -> Callable[..., Any]:
        """``run_step(model, method, ...)`` as one callable, built once (the Trainer calls it per batch)."""
        user = self.unwrap_model(model)
        step: Callable = getattr(user, method)
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
        self.strategy, self.models, self.skip_sync, self.contexts = strategy, models, skip_sync, []

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


def _rebuilt(loader: torch.utils.data.DataLoader, world: int, split: bool) -> torch.utils.data.DataLoader:
    """``split_batches``: the same loader with a per-process batch of batch_size // world."""
    if not split:
        return loader
    if loader.batch_size is None or loader.batch_size % world:
        raise ConfigurationError(f"split_batches=True needs a batch_size divisible by the {world} processes "
                                 f"(got batch_size={loader.batch_size}); use a multiple of {world} or "
                                 "split_batches=False")
    from trainforge.strategies.data.loader import loader_kwargs

    iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)  # takes no sampler
    return torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size // world,
                                       sampler=None if iterable else loader.sampler, drop_last=loader.drop_last,
                                       **loader_kwargs(loader))


def _data_options(even_batches: Any, split_batches: Any, dispatch_batches: Any, config: Any) -> "tuple[Any, ...]":
    """Accelerate's three data-loading options, from the arguments or a DataLoaderConfiguration-like
    ``config`` (its values win, as the arguments are deprecated in Accelerate), validated."""
    if config is not None:
        names = ("even_batches", "split_batches", "dispatch_batches")
        if not any(hasattr(config, name) for name in names):
            raise ConfigurationError(f"dataloader_config={config!r} has none of {', '.join(names)}: pass "
                                     "accelerate's DataLoaderConfiguration or an object with those attributes")
        even_batches = getattr(config, "even_batches", even_batches)
        split_batches = getattr(config, "split_batches", split_batches)
        dispatch_batches = getattr(config, "dispatch_batches", dispatch_batches)
    for name, value, allowed in (("even_batches", even_batches, "True or False"),
                                 ("split_batches", split_batches, "True or False"),
                                 ("dispatch_batches", dispatch_batches, "None (Accelerate's default: True for an "
                                  "IterableDataset), True or False")):
        if not (isinstance(value, bool) or (name == "dispatch_batches" and value is None)):
            raise ConfigurationError(f"{name}={value!r} must be {allowed}")
    return even_batches, split_batches, dispatch_batches


def _unpadded(sampler: Any) -> None:
    """``even_batches=False``: no duplicated samples; the last ranks may get one sample (batch) fewer."""
    from trainforge.strategies.data.sampler import epoch_length

    sampler.pad = False
    sampler.total_size = epoch_length(len(sampler.dataset), sampler.num_replicas, sampler.drop_last, False)
    sampler.num_samples = len(range(sampler.rank, sampler.total_size, sampler.num_replicas))


def _is_scheduler(obj: Any) -> bool:
    lr_scheduler = torch.optim.lr_scheduler
    base = getattr(lr_scheduler, "LRScheduler", None) or lr_scheduler._LRScheduler
    return isinstance(obj, (base, lr_scheduler.ReduceLROnPlateau))
