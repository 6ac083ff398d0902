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
have one code path. The Accelerator is built from parts it owns and calls with explicit inputs
(``ProcessControl``, ``Collectives``, ``DataPreparer``, ``ItemWindow``, ``Trackers``, ``Profiling``);
its methods are Accelerate's names for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Union

import torch
from torch import nn

from trainforge.strategies import Strategy, resolve_strategy
from trainforge.strategies.base import RunSettings
from trainforge.strategies.checkpoint.async_save import AsyncCheckpointer
from trainforge.strategies.devices import check_device_matches, normalize_accelerator
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.materialize import init_module_context
from trainforge.strategies.precision import Precision
from trainforge.trainer.accelerator.collectives import Collectives
from trainforge.trainer.accelerator.data import DataPreparer, LoaderOptions, check_sharding, data_options
from trainforge.trainer.accelerator.forwarding import autocast_forward, bound_step
from trainforge.trainer.accelerator.process_control import ProcessControl
from trainforge.trainer.accelerator.token_loss import ItemWindow
from trainforge.trainer.accelerator.wrappers import (
    GradientState,
    PreparedDataLoader,
    PreparedOptimizer,
    PreparedScheduler,
)
from trainforge.trainer.cluster.stop_signals import SignalsArg, StopSignals
from trainforge.trainer.compat.accelerate.accelerator_args import AccelerateOptions, release_memory
from trainforge.trainer.compat.accelerate.dataclasses import ProjectConfiguration
from trainforge.trainer.compat.accelerate.deepspeed import config_optimizer, prepared_stand_ins
from trainforge.trainer.compat.accelerate.state import (
    DistributedType,
    PartialState,
    distributed_type_of,
    mixed_precision_name,
)
from trainforge.trainer.compat.accelerate.trackers import Trackers
from trainforge.trainer.inference import api as inference
from trainforge.trainer.loop.profiling import ProfileKwargs, Profiling


class Accelerator:
    """Device placement, precision, gradient accumulation, collectives and checkpoints for a loop of
    your own, with HF Accelerate's names (the Trainer runs on one too).

    Args:
        strategy: How the run is placed and parallelised: ``"auto"`` (DDP when launched on several
            processes, else one device), ``"single"``, ``"ddp"``, ``"fsdp"``, ``"deepspeed"``,
            ``"megatron"``, ``"xla"``, or a ``Strategy`` object (``FSDPStrategy(...)``). Default None: what
            ``trainforge launch`` was told (its config file or flags), else ``"auto"``.
        precision: ``"32"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"fp8"`` (aliases
            ``"no"``/``"fp32"``, ``"fp16"``, ``"bf16"``). Default None: what ``trainforge launch`` was
            told, else ``"32"``. Give this or ``mixed_precision``, not both.
        gradient_accumulation_steps: Micro-batches per optimizer step inside ``accumulate()``; the
            gradients sync and prepared optimizers step on the last one (or on a loader's last batch).
            An int >= 1; default None: what ``trainforge launch`` was told, else 1 (no accumulation).
        seed: The seed prepared loaders' samplers are built with (their shuffle falls back to
            ``seed + epoch``; the Accelerator hands each epoch an order drawn from the user's generator or
            the global RNG instead, as torch's ``RandomSampler`` would). Default 0.
        accelerator: The device kind: ``"auto"`` (what torch reports: CUDA, MPS, XPU..., else the
            CPU), ``"cpu"``, ``"gpu"``/``"cuda"``, ``"mps"`` or a backend registered with torch.
            Default None: what ``trainforge launch`` was told, else ``"auto"``.
        even_batches: True (default): every process gets as many batches, the shortest padded with
            samples from the start of the epoch (``gather_for_metrics`` drops them). False: no
            duplicates; the last processes may get one batch fewer.
        split_batches: False (default): a loader's ``batch_size`` is each process's. True: it is the
            global batch, split between processes (it must divide by their number); schedulers then
            step once per optimizer step.
        dispatch_batches: True: rank 0 reads the loader and sends each process its slice of every
            step (``trainer/accelerator/batch_dispatch.py``); False: each process reads its own share
            (an IterableDataset's stream is split by ``strategies/data/iterable.py``). Default None:
            True for an IterableDataset on several processes, as Accelerate.
        data_sharding: How a prepared map-style loader is split between processes: ``"batches"`` (default,
            Accelerate's ``BatchSamplerShard``: each process takes whole batches in turn, the shuffle
            generator seeded at ``prepare`` and synchronised from rank 0) or ``"samples"`` (torch's
            ``DistributedSampler``, as Lightning: sample ``i`` to rank ``i % W``; what the Trainer uses).
        dataloader_config: A ``trainforge.utils.DataLoaderConfiguration`` (or Accelerate's) giving
            ``even_batches``, ``split_batches`` and ``dispatch_batches``; its values win over the three
            arguments. Default None.
        project_dir: Directory of the automatically named checkpoints and of the trackers' files
            (the logging directory, unless ``project_config`` names another). A local path. Default None.
        project_config: A ``trainforge.utils.ProjectConfiguration`` (or Accelerate's) giving
            ``project_dir``, ``logging_dir``, ``automatic_checkpoint_naming`` and ``total_limit``.
            Default None.
        automatic_checkpoint_naming: True: ``save_state()`` with no path writes
            ``<project_dir>/checkpoints/checkpoint_<i>`` and ``load_state()`` with no path loads the
            newest; needs ``project_dir``. Default False.
        total_limit: With automatic naming, how many of the newest checkpoints are kept (an int >= 1).
            Default None: all.
        mixed_precision: Accelerate's name of the precision: ``"no"``, ``"fp16"``, ``"bf16"`` or
            ``"fp8"`` (trainforge's ``"32"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"fp8"``). Default None.
        cpu: True: run on the CPU (``accelerator="cpu"``). Default False.
        log_with: Trackers for ``init_trackers``/``log``: ``"tensorboard"``, ``"mlflow"``, ``"comet_ml"``,
            ``"wandb"``, ``"csv"``, ``"all"`` (each installed one), a ``TrackerCallback`` instance, or a
            list of those (``trainer/compat/accelerate/trackers.py``). Default None: no trackers.
        kwargs_handlers: A list of ``trainforge.utils`` handlers: ``DistributedDataParallelKwargs`` (to
            the DDP strategy), ``InitProcessGroupKwargs`` (backend, timeout), ``GradScalerKwargs`` (the
            fp16 scaler), ``ProfileKwargs`` (``profile()``'s default). Default None.
        rng_types: Accelerate's RNG synchronisation; only ``["generator"]`` is accepted (the data order
            is rank 0's, always). Default None: ``["generator"]``.
        device_placement: True (default): prepared models and batches are moved to ``device``. False:
            nothing is moved (one process or DDP only).
        stop_signals: Signals that stop every process at the same optimizer step (``stop_requested``),
            e.g. ``("SIGTERM", "SIGUSR1")``, ``"SIGTERM,SIGUSR1"`` or a signal number. Default None: no
            handlers installed.
        **accelerate_only: Accelerate's other arguments: ``step_scheduler_with_optimizer=True`` (what a
            prepared scheduler does) is accepted; the others (plugins, dynamo) are refused with
            trainforge's way to do the same in the message.

    Raises:
        ConfigurationError: An argument outside its choices, or two that disagree; the message names
            the value and what is valid. Arguments that need no process group are checked before one starts.
    """

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
        data_sharding: str = "batches",
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
        loader_options = data_options(*compat.loader_arguments(even_batches, split_batches, dispatch_batches))
        self.data_sharding = check_sharding(data_sharding)
        # Accelerate's SeedableRandomSampler (DataLoaderConfiguration(use_seedable_sampler, data_seed))
        self.use_seedable_sampler, self.data_seed = compat.seedable_arguments()
        # and log_with, checked against the logging directory
        project_dir, automatic_checkpoint_naming, total_limit = compat.project_arguments(
            project_dir, automatic_checkpoint_naming, total_limit
        )
        # what `trainforge launch` was told; explicit arguments win
        defaults = launch_defaults()
        strategy = strategy if strategy is not None else defaults.get("strategy", "auto")
        precision = compat.precision if compat.precision is not None else defaults.get("precision", "32")
        accum = _accumulation_steps(gradient_accumulation_steps, defaults)
        kwargs = strategy_kwargs(strategy, defaults) if isinstance(strategy, str) else {}
        strategy, kwargs = compat.strategy_arguments(strategy, kwargs)
        self.strategy = resolve_strategy(strategy, **kwargs)
        accelerator = compat.accelerator if compat.accelerator is not None else defaults.get("accelerator", "auto")
        self._set_up_devices(accelerator)
        self.precision = Precision(precision, self.strategy.root_device)
        self.gradient_accumulation_steps = accum
        self.run_settings = RunSettings(
            precision=self.precision, accumulation_steps=accum, device_placement=compat.device_placement
        )
        self.strategy.configure(self.run_settings)
        self.gradient_state = GradientState()
        self._no_sync_is_noop = type(self.strategy).no_backward_sync is Strategy.no_backward_sync
        self.seed = seed
        # micro-batches into the current accumulation window
        self.step = 0
        self._models: List[nn.Module] = []
        self._optimizers: List[PreparedOptimizer] = []
        self._schedulers: List[PreparedScheduler] = []
        self._dataloaders: List[PreparedDataLoader] = []
        self._custom_objects: List[Any] = []
        self.even_batches, self.split_batches, self.dispatch_batches = loader_options
        _check_project(project_dir, automatic_checkpoint_naming, total_limit)
        self.project_dir, self.total_limit = project_dir, total_limit
        self.automatic_checkpoint_naming = automatic_checkpoint_naming
        # created by the first async save
        self._async_checkpointer: Optional[AsyncCheckpointer] = None
        self._set_up_accelerate(compat)
        self._build_parts(compat)
        # polled by stop_requested
        self.stop_signals = StopSignals(stop_signals, "Accelerator(stop_signals)", install=True)

    def _set_up_devices(self, accelerator: Any) -> None:
        """The strategy's processes and device, for ``accelerator``."""
        # a bad value fails here, before any process group starts
        normalize_accelerator(accelerator)
        check_device_matches(accelerator, self.strategy.requested_device)
        self.strategy.setup_environment(accelerator)

    def _set_up_accelerate(self, compat: AccelerateOptions) -> None:
        """Accelerate's attributes of the same names, from its arguments."""
        compat.apply_precision(self.precision)
        self.device_placement = compat.device_placement
        self.rng_types = compat.rng_types
        # profile()'s default handler (Accelerate's attribute)
        self.profile_handler: Optional[ProfileKwargs] = compat.profile_handler
        # set_trigger()/check_trigger()'s flag (Accelerate's attribute)
        self.flag_tensor: Optional[torch.Tensor] = None

    def _build_parts(self, compat: AccelerateOptions) -> None:
        """The parts the Accelerator's methods call, each given what it works on."""
        self._processes = ProcessControl(self.strategy)
        self._collectives = Collectives(self.strategy, self.gradient_state)
        self._data = DataPreparer(self.strategy, self.gradient_state, self.precision, self.data_sharding)
        self._item_window = ItemWindow(self.strategy)
        self._trackers = Trackers(compat.log_with, compat.logging_dir, self.strategy.is_global_zero)
        # The part's barrier is the process-control part's, not this object's bound method: a part holding the
        # Accelerator would make a reference cycle, so prepared loaders (and their DataLoader workers) would
        # wait for the garbage collector instead of ending when the Accelerator is dropped.
        self._profiling = Profiling(self.strategy.global_rank, self._processes.wait_for_everyone)

    # ---- topology --------------------------------------------------------------------------------
    device = property(lambda self: self.strategy.root_device)
    process_index = property(lambda self: self.strategy.global_rank)
    local_process_index = property(lambda self: self.strategy.local_rank)
    num_processes = property(lambda self: self.strategy.world_size)
    is_main_process = property(lambda self: self.strategy.is_global_zero)
    is_local_main_process = property(lambda self: self.strategy.local_rank == 0)
    is_last_process = property(lambda self: self.strategy.global_rank == self.strategy.world_size - 1)
    # Accelerate's: several processes (self.state.use_distributed)
    use_distributed = property(lambda self: self.strategy.world_size > 1)
    sync_gradients = property(lambda self: self.gradient_state.sync_gradients)

    @property
    def state(self) -> PartialState:
        """Accelerate's ``AcceleratorState``: the processes, the device and ``mixed_precision``."""
        return PartialState.of(self.strategy, self.precision)

    @property
    def distributed_type(self) -> DistributedType:
        return distributed_type_of(self.strategy)

    @property
    def mixed_precision(self) -> str:
        """Accelerate's name of the precision: "no", "fp16", "bf16" or "fp8"."""
        return mixed_precision_name(self.precision)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        self._processes.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call (a barrier)."""
        self._processes.wait_for_everyone()

    def main_process_first(self) -> ContextManager[None]:
        """Context: the main process runs the block first (e.g. to build a cache), then the others."""
        return self._processes.main_process_first()

    def local_main_process_first(self) -> ContextManager[None]:
        """Context: each node's main process runs the block first, then the node's others."""
        return self._processes.local_main_process_first()

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: ``function`` runs on the main process only (elsewhere it returns None)."""
        return self._processes.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: ``function`` runs on each node's main process only (elsewhere it returns None)."""
        return self._processes.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: ``function`` runs on the last process only (elsewhere it returns None)."""
        return self._processes.on_last_process(function)

    def on_process(self, function: Optional[Callable[..., Any]] = None, process_index: int = 0) -> Any:
        """Decorator: ``function`` runs on one process only (elsewhere it returns None).

        Args:
            function: The function; None gives the decorator (``@acc.on_process(process_index=1)``).
            process_index: The process that runs it. Default 0.
        """
        return self._processes.on_process(function, process_index)

    def update_run_settings(self, **changes: Any) -> None:
        """Hand the strategy new ``RunSettings`` with ``changes`` (the Trainer's clipping; the
        micro-batch size, known once the training loader is prepared)."""
        fields = [f.name for f in dataclasses.fields(RunSettings)]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise ConfigurationError(f"update_run_settings({unknown[0]}=...): not a run setting; choose from {fields}")
        self.run_settings = dataclasses.replace(self.run_settings, **changes)
        self.strategy.configure(self.run_settings)

    # ---- collectives -----------------------------------------------------------------------------
    def gather(self, data: Any) -> Any:
        """Tensors (nested in dicts/lists) from every process, concatenated along dim 0.

        Args:
            data: A tensor, or dicts/lists/tuples of tensors; every process passes the same structure.
        """
        return self._collectives.gather(data)

    def gather_for_metrics(self, data: Any) -> Any:
        """Like ``gather``, but on a prepared loader's last batch drops the duplicates even sharding
        added, so every sample of the dataset is counted exactly once (outside a prepared loader's loop
        a plain ``gather``, as in Accelerate).

        Args:
            data: A tensor, or dicts/lists/tuples of tensors, computed from the current batch.
        """
        return self._collectives.gather_for_metrics(data)

    def gather_object(self, obj: Any) -> List[Any]:
        """Picklable objects from every process: lists are concatenated in rank order, other objects
        become a list with one item per process (Accelerate's ``gather_object``).

        Args:
            obj: Any picklable object.
        """
        return self._processes.gather_object(obj)

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        """Tensors (nested in dicts/lists) reduced over every process; every process gets the result.

        Args:
            data: A tensor, or dicts/lists/tuples of tensors.
            reduction: ``"sum"`` (default), ``"mean"``, ``"max"`` or ``"min"``.
        """
        return self._collectives.reduce(data, reduction)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Process ``src``'s ``obj`` (a tensor or a picklable object), returned on every process.

        Args:
            obj: What to send (on ``src``; elsewhere a placeholder of the same kind).
            src: The sending process. Default 0.
        """
        return self._collectives.broadcast(obj, src)

    def pad_across_processes(self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size on any process (so they can be gathered).

        Args:
            data: A tensor, or dicts/lists/tuples of tensors.
            dim: The dimension padded. Default 0.
            pad_index: The value padded with. Default 0.
            pad_first: Pad before the data instead of after it. Default False.
        """
        return self._collectives.pad_across_processes(data, dim, pad_index, pad_first)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> ContextManager[Any]:
        """Context giving this process's share of ``inputs``, as Accelerate.

        Args:
            inputs: A list, tuple, dict of lists, or tensor, split in contiguous parts by process.
            apply_padding: Repeat the last item so every process gets as many. Default False.
        """
        return self._processes.split_between_processes(inputs, apply_padding)

    # ---- prepare ---------------------------------------------------------------------------------
    def init_module(self, empty_init: Optional[bool] = None) -> ContextManager[None]:
        """``Trainer.init_module``'s: build the model inside with ``empty_init=True`` and ``prepare``
        materialises it (FSDP: shard by shard); ``trainforge.load_pretrained`` gives it its weights.

        Args:
            empty_init: True: parameters are created on the meta device (no memory, no init). Default
                None: the strategy's choice.
        """
        return init_module_context(self.strategy, empty_init)

    def prepare(self, *objects: Any) -> Any:
        """Place, wrap and shard what the loop uses: models (placed and wrapped by the strategy, forward
        under the precision's autocast), optimizers (step only at a window's end), schedulers (step
        with their optimizer) and dataloaders (sharded, resumable, batches on ``device``).

        Args:
            *objects: Models, optimizers, schedulers and dataloaders, in any order; anything else is
                returned as it is. One trained model per call on several processes.

        Returns:
            The prepared objects in the order given (one object alone, not in a tuple).
        """
        loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader)]
        if loaders and self.run_settings.micro_batch_size is None:
            # before setup: DeepSpeed's config
            self.update_run_settings(micro_batch_size=loaders[0].batch_size)
        models = [o for o in objects if isinstance(o, nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        # Accelerate's DummyOptim/DummyScheduler: DeepSpeed builds them from its config (compat/accelerate/deepspeed.py)
        from_config = config_optimizer(self.strategy, objects, self.num_processes, self.split_batches)
        if models:
            # a layout chosen from the model ("auto" sizes) decides the loaders' shards
            self.strategy.plan_layout(models[0], loaders[0] if loaders else None)
        if len(models) > 1 and self.strategy.world_size > 1 and optimizers:
            raise ConfigurationError(
                "prepare() got several models with optimizers; prepare one trained model per "
                "call (frozen models can be prepared in a separate call)"
            )
        result: Dict[int, Any] = {}
        optimizers_out = optimizers
        for model in models:
            result[id(model)], optimizers_out = self._setup_model(model, [from_config] if from_config else optimizers)
            self._autocast_forward(result[id(model)])
        for original, opt in zip(optimizers, optimizers_out):
            result[id(original)] = self._prepared_optimizer(opt)
        if from_config is not None and models:
            result.update(prepared_stand_ins(objects, result[id(models[0])], optimizers_out, self._prepared_optimizer))
        out = [self._prepare_other(obj) if id(obj) not in result else result[id(obj)] for obj in objects]
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_other(self, obj: Any) -> Any:
        if _is_scheduler(obj):
            return self._prepare_scheduler(obj)
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj)
        return obj

    def prepare_data_loader(self, loader: torch.utils.data.DataLoader) -> PreparedDataLoader:
        """One dataloader, sharded between processes and resumable (``prepare`` calls this for each).

        Args:
            loader: A ``torch.utils.data.DataLoader`` (map-style or iterable dataset); the first one
                prepared sets the run's micro-batch size.
        """
        options = LoaderOptions(self.even_batches, self.split_batches, self.dispatch_batches)
        seedable = (self.use_seedable_sampler, self.data_seed)
        prepared, batch_size = self._data.prepare(
            loader, options, self.seed, self.run_settings.device_placement, seedable=seedable
        )
        if self.run_settings.micro_batch_size is None:
            # the first loader prepared is the training one
            self.update_run_settings(micro_batch_size=batch_size)
        self._dataloaders.append(prepared)
        return prepared

    def prepare_model(
        self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """``prepare(model)`` (Accelerate's single-object form).

        Args:
            model: The ``torch.nn.Module``.
            device_placement: Must be None or the Accelerator's own ``device_placement`` (placement is
                decided once, by the constructor). Default None.
            evaluation_mode: True: the same as ``prepare(model)`` on one process; refused on several.
                Default False.
        """
        if device_placement is not None and device_placement != self.device_placement:
            raise ConfigurationError(
                f"prepare_model(device_placement={device_placement!r}): placement is decided once, by "
                f"Accelerator(device_placement=...) (this one: {self.device_placement})"
            )
        if evaluation_mode and self.num_processes > 1:
            raise ConfigurationError(
                "prepare_model(evaluation_mode=True) on several processes is not supported: prepare the model "
                "with prepare(model) (evaluation needs no optimizer), or move it to accelerator.device yourself"
            )
        if not isinstance(model, nn.Module):
            raise ConfigurationError(f"prepare_model({type(model).__name__}): expected a torch.nn.Module")
        return self.prepare(model)

    def prepare_model_with_optimizers(
        self, model: nn.Module, build: Callable[[], Any]
    ) -> tuple[nn.Module, List[PreparedOptimizer]]:
        """The Trainer's order: place and wrap ``model``, then call ``build()`` for its optimizers,
        so they see the final device and parameters (fused AdamW on CUDA, FSDP's DTensors)."""
        wrapped, built = self._setup_model(model, build)
        return wrapped, [self._prepared_optimizer(opt) for opt in built]

    def _autocast_forward(self, model: nn.Module) -> None:
        """Accelerate's mixed precision: a model prepared under ``bf16``/``fp16``/``fp8`` computes its
        forward under autocast and returns float32 tensors. Not where the backend owns precision
        (DeepSpeed)."""
        if self.precision.autocast_dtype is None or self.strategy.loss_scaling_in_backend:
            return
        autocast_forward(self.unwrap_model(model), self.precision)

    def _setup_model(self, model: nn.Module, optimizers: Any) -> tuple[nn.Module, List[Any]]:
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
        # Accelerate: once per process per step
        steps = 1 if self.split_batches else self.num_processes
        prepared = PreparedScheduler(scheduler, self.gradient_state, steps_per_call=steps)
        self._schedulers.append(prepared)
        return prepared

    # ---- the step --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: Optional[nn.Module] = None, num_items: Any = None) -> None:
        """Back-propagate ``loss`` through the strategy (scaled for fp16, divided by the accumulation steps).

        Args:
            loss: The micro-batch's loss: a mean, or with ``num_items`` a sum over its items.
            model: The prepared model it comes from. Default None: the first model prepared.
            num_items: The items (tokens) ``loss`` sums, an int or an integer tensor: the optimizer step
                then gets the gradient of the mean over every item of the window on every process
                (``trainer/accelerator/token_loss.py``). Default None: ``loss`` is a mean.
        """
        model = model if model is not None else (self._models[0] if self._models else None)
        # a mean divided by the steps
        self.strategy.backward(self.loss_to_backward(loss, num_items), model)
        # a no-op unless num_items were given and this micro-batch syncs
        self.end_item_window(model)

    def forward_backward(
        self, model: nn.Module, batch: Any, loss_fn: Optional[Callable[[Any, Any], Any]] = None
    ) -> torch.Tensor:
        """Forward, loss and backward of one batch ``(inputs, target)``: ``loss_fn(model(*inputs),
        target)`` under autocast, then ``backward``. With pipeline parallelism the strategy's schedule
        runs it over micro-batches, stage by stage, and the loss returned is the batch mean, the same on
        every rank: one loop for both.

        Args:
            model: The prepared model.
            batch: ``(inputs, target)``; ``inputs`` a tensor or a tuple of the model's arguments.
            loss_fn: ``loss_fn(output, target)``. Default None: ``model.loss_fn``.

        Returns:
            The loss.
        """
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
        """Context for one micro-batch: gradients sync (and optimizers step) only on the window's last
        micro-batch or the dataloader's last batch.

        Args:
            *models: The prepared models whose gradient sync is skipped. Default: the first prepared.
        """
        self.step += 1
        sync = self.step % self.gradient_accumulation_steps == 0 or self.gradient_state.end_of_dataloader
        if sync:
            self.step = 0
        self.gradient_state.sync_gradients = sync
        if self._no_sync_is_noop:
            # one device: nothing to skip, no per-step context objects
            return _NO_SYNC
        return _Accumulate(self.strategy, models or self._models[:1], skip_sync=not sync)

    def no_sync(self, model: nn.Module) -> Any:
        """Context: skip the gradient all-reduce in the backward passes inside (accumulate by hand).

        Args:
            model: The prepared model.
        """
        return self.strategy.no_backward_sync(model, enabled=True)

    def trigger_sync_in_backward(self, model: nn.Module) -> Any:
        """Context: the forward and backward inside all-reduce gradients even within ``no_sync`` (the
        gradients accumulated locally so far are synced with them).

        Args:
            model: The prepared model.
        """
        return self.strategy.force_backward_sync(model)

    def autocast(self) -> Any:
        """Context: compute under the precision's autocast (a no-op in fp32)."""
        return self.precision.autocast()

    def unscale_gradients(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Divide fp16's scaled gradients by the scale (before reading or clipping them).

        Args:
            optimizer: Its gradients only. Default None: every prepared optimizer's.
        """
        for opt in [optimizer] if optimizer is not None else self._optimizers:
            self.precision.unscale_(opt.optimizer if isinstance(opt, PreparedOptimizer) else opt)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
        """Clip the gradients' total norm (over every process's shards), after unscaling them.

        Args:
            parameters: The parameters (``model.parameters()``).
            max_norm: The largest norm kept.
            norm_type: The norm's order. Default 2.0.

        Returns:
            The total norm before clipping (None where the strategy does not compute it).
        """
        self.unscale_gradients()
        return self.strategy.clip_gradients(list(parameters), max_norm=max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp each gradient to ``[-clip_value, clip_value]``, after unscaling them.

        Args:
            parameters: The parameters (``model.parameters()``).
            clip_value: The largest absolute value kept.
        """
        self.unscale_gradients()
        self.strategy.clip_gradients(list(parameters), clip_value=clip_value)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module inside a prepared model (without DDP/FSDP/DeepSpeed/torch.compile's wrappers).

        Args:
            model: The prepared model.
        """
        model = self.strategy.unwrap(model)
        # torch.compile's wrapper
        return getattr(model, "_orig_mod", model)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """The last optimizer step was skipped by the fp16 grad scaler (inf/nan gradients)."""
        return self.precision.step_was_skipped

    # ---- the item-weighted loss (trainer/accelerator/token_loss.py) ------------------------------
    @property
    def items_in_window(self) -> Any:
        """Items of the current accumulation window given with ``num_items`` (None: none given)."""
        return self._item_window.count

    def loss_to_backward(self, loss: torch.Tensor, num_items: Any) -> torch.Tensor:
        """A mean loss divided by the accumulation steps, or a summed one as it is (its count kept)."""
        return self._item_window.loss_to_backward(loss, num_items, self.gradient_accumulation_steps)

    def end_item_window(self, model: Optional[nn.Module]) -> None:
        """On a sync step, after its backward: gradients divided by the window's items on all ranks."""
        self._item_window.end(model, self.gradient_state.sync_gradients)

    def item_window_state_dict(self) -> Dict[str, Any]:
        """This rank's count of the current window, for a checkpoint written inside the window."""
        return self._item_window.state_dict()

    def load_item_window_state_dict(self, state: Dict[str, Any]) -> None:
        self._item_window.load_state_dict(state)

    # ---- stop signals ----------------------------------------------------------------------------
    @property
    def stop_requested(self) -> Optional[str]:
        """With ``Accelerator(stop_signals=("SIGTERM", "SIGUSR1"))``: the signal's name once every process
        is to stop here, else None. Read it once per optimizer step, on every process at the same point
        (after ``optimizer.step()``): each read exchanges this process's flag with the others, one read
        late, never waited for. Then save and exit with ``stop_exit_code``::

            if accelerator.stop_requested:
                accelerator.save_state(ckpt_dir)       # committed when it returns
                sys.exit(accelerator.stop_exit_code)   # 128 + the signal number (143 for SIGTERM)

        ``load_state(ckpt_dir)`` then continues the run exactly (``trainer/cluster/stop_signals.py``)."""
        return self.stop_signals.poll(self.strategy)

    @property
    def stop_exit_code(self) -> Optional[int]:
        """128 + the number of the signal ``stop_requested`` named; None before."""
        return self.stop_signals.exit_code

    def set_trigger(self) -> None:
        """Raise this process's flag; ``check_trigger()`` on every process then returns True once."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called ``set_trigger()`` since the last True (a collective: every process
        calls it at the same point). Resets the flag when True."""
        flag = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self.device)
        if int(self.reduce(flag).item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        self.flag_tensor = flag
        return False

    # ---- state -----------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` with ``save_state``/``load_state`` too.

        Args:
            *objects: Objects with ``state_dict()`` and ``load_state_dict()``.
        """
        bad = [o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ConfigurationError(
                f"register_for_checkpointing got {bad[0]!r}, which has no "
                "state_dict()/load_state_dict(); register objects that have both"
            )
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        """Everything to resume exactly: the model, optimizers, schedulers, loaders' positions, RNG of
        every process, registered objects (``trainer/checkpoint/contents.py``).

        Args:
            output_dir: The checkpoint's directory (a local path or an fsspec URL). Default None:
                ``<project_dir>/checkpoints/checkpoint_<i>`` (``automatic_checkpoint_naming``), the newest
                ``total_limit`` kept.
            safe_serialization: Accepted for Accelerate; weights are always safetensors (False warns).
            **kwargs: ``async_save=True``: return once the state is in host memory, written in the
                background (``wait_for_checkpoint``; ``end_training`` and exit wait).
                ``trainable_only``: leave frozen parameters out.
        """
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
        """Restore what ``save_state`` (or a Trainer) saved; a part this run has that the checkpoint
        lacks is a CheckpointError naming it, before anything is restored.

        Args:
            input_dir: The checkpoint's directory. Default None: the newest project checkpoint
                (``automatic_checkpoint_naming``).
            **kwargs: Passed to ``trainer/checkpoint/contents.py``'s ``load_accelerator_state``.
        """
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

    @property
    def project_configuration(self) -> ProjectConfiguration:
        """Accelerate's attribute: the project settings in effect, as a ``ProjectConfiguration`` (a copy:
        change them through the Accelerator's arguments)."""
        return ProjectConfiguration(
            project_dir=self.project_dir,
            logging_dir=self.logging_dir,
            automatic_checkpoint_naming=self.automatic_checkpoint_naming,
            total_limit=self.total_limit,
        )

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """The loader whose next pass starts ``num_batches`` into the epoch, without loading them
        (Accelerate). A loader restored by ``load_state`` already continues where it was saved: asking
        to skip that same position again (or 0 after a checkpoint saved on an epoch's last batch, as
        run_clm_no_trainer.py computes it) is a no-op, logged. So is a skip to the first batch of the
        accumulation window a checkpoint was written in (``save_state`` after a micro-batch that did not step,
        as scripts that test only ``completed_steps % checkpointing_steps`` do; the script's count,
        ``step * gradient_accumulation_steps``, is the window's start): the checkpoint holds that window's
        gradients, so the run continues exactly as the uninterrupted one. Anything else is an error.

        Args:
            dataloader: A prepared loader.
            num_batches: Batches of the epoch to skip. Default 0.
        """
        return dataloader.skip_first_batches(num_batches, open_window=self.step)

    def save_model(
        self, model: nn.Module, save_directory: str, max_shard_size: Any = None, adapter_only: Optional[bool] = None
    ) -> Any:
        """The whole model as safetensors (gathered from the shards), or a PEFT model's adapter in PEFT's
        format (``trainer/checkpoint/adapters.py``); every process calls it.

        Args:
            model: The prepared model.
            save_directory: Where the files go.
            max_shard_size: The largest file, e.g. ``"5GB"`` or a number of bytes. Default None: one file.
            adapter_only: True: only a PEFT model's adapter. Default None: the adapter for a PEFT model,
                else the whole model.
        """
        from trainforge.trainer.checkpoint.contents import save_weights

        # one save at a time (an async one may be in flight)
        self.wait_for_checkpoint()
        return save_weights(self.strategy, model, save_directory, max_shard_size, adapter_only)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """``torch.save(obj, f)`` on the main process only, as Accelerate; usable as
        ``save_pretrained(..., save_function=accelerator.save)``.

        Args:
            obj: What to save.
            f: A path or a file object.
            safe_serialization: True: ``obj`` is a dict of tensors, written as safetensors. Default False.
        """
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in obj.items()}, f, metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> Dict[str, torch.Tensor]:
        """The full state dict of a prepared model (gathered from the shards under FSDP/DeepSpeed/Megatron);
        every process must call it.

        Args:
            model: The prepared model.
            unwrap: False: the wrapper's own state dict (DDP's ``module.`` names). Default True.
        """
        if not unwrap:
            return model.state_dict()
        return self.strategy.module_state_dict(model)

    def free_memory(self, *objects: Any) -> List[Any]:
        """Forget everything prepared (Accelerate's): ``None`` for each of ``objects`` (``model, opt =
        acc.free_memory(model, opt)``), garbage collected, device caches emptied."""
        self.wait_for_checkpoint()
        for held in (self._models, self._optimizers, self._schedulers, self._dataloaders, self._custom_objects):
            held.clear()
        self.step = 0
        return release_memory(*objects)

    def clear(self, *objects: Any) -> List[Any]:
        """Accelerate's alias of ``free_memory``."""
        return self.free_memory(*objects)

    # ---- trackers (trainer/compat/accelerate/trackers.py) and profiling --------------------------
    log_with = property(lambda self: self._trackers.log_with, doc="The trackers ``log_with`` named, checked.")
    logging_dir = property(lambda self: self._trackers.logging_dir, doc="Where the trackers write their files.")
    trackers = property(lambda self: self._trackers.trackers, doc="The trackers started by ``init_trackers``.")

    def init_trackers(
        self,
        project_name: str,
        config: Optional[Mapping[str, Any]] = None,
        init_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
    ) -> None:
        """Start a run of every tracker of ``log_with`` on the main process (other processes have none).

        Args:
            project_name: The run's project (experiment) name, also the folder of file-writing trackers.
            config: The run's hyperparameters (a dict; ``vars(args)`` for an argparse.Namespace).
                Default None.
            init_kwargs: ``{"<tracker>": {...}}``, arguments of that tracker's constructor. Default None.
        """
        self._trackers.init(project_name, config, init_kwargs)

    def log(
        self, values: Mapping[str, Any], step: Optional[int] = None, log_kwargs: Optional[Dict[str, Any]] = None
    ) -> None:
        """Log metrics to every tracker, on the main process. Values that are not numbers are counted
        and reported as dropped at the end of the run.

        Args:
            values: Metric name to value (numbers, or 0-d tensors).
            step: The step (an int >= 0). Default None: the number of earlier ``log`` calls.
            log_kwargs: Refused (trainforge's trackers take their settings when built). Default None.
        """
        self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker ``name`` on the main process; elsewhere, as Accelerate, a stand-in whose every
        method does nothing (so ``accelerator.get_tracker("wandb").log_hyperparams(...)`` runs on every rank).

        Args:
            name: ``"tensorboard"``, ``"mlflow"``, ``"comet_ml"``, ``"wandb"``, ``"csv"``, or a tracker's ``name``.
            unwrap: Refused: the backend object belongs to the tracker's writer thread. Default False.
        """
        return self._trackers.get(name, unwrap)

    def end_training(self) -> None:
        """Finish the trackers' runs (pending writes get their flush timeout), wait for an asynchronous
        checkpoint save, and release the processes (the process group trainforge started)."""
        from trainforge.trainer.checkpoint.contents import release_project_lock

        self._trackers.end()
        self.wait_for_checkpoint()
        release_project_lock(self)
        self.strategy.teardown()

    def profile(self, profile_handler: Optional[ProfileKwargs] = None) -> ContextManager[torch.profiler.profile]:
        """Context: profile the block; yields the ``torch.profiler.profile``.

        Args:
            profile_handler: A ``trainforge.utils.ProfileKwargs``. Default None: the one in
                ``kwargs_handlers``, else the defaults (CPU, and CUDA when present).
        """
        return self._profiling.profile(profile_handler, self.profile_handler)

    # ---- big-model inference (trainer/inference), reachable from the Accelerator as in Accelerate ---
    init_empty_weights = staticmethod(inference.init_empty_weights)
    infer_auto_device_map = staticmethod(inference.infer_auto_device_map)
    load_checkpoint_and_dispatch = staticmethod(inference.load_checkpoint_and_dispatch)
    dispatch_model = staticmethod(inference.dispatch_model)
    cpu_offload = staticmethod(inference.cpu_offload)
    disk_offload = staticmethod(inference.disk_offload)

    # ---- the Trainer's steps ---------------------------------------------------------------------
    def run_step(self, model: nn.Module, method: str, *args: Any) -> Any:
        """Call ``module.<method>(*args)`` through the prepared model's ``forward``, so wrappers that act
        in forward (DDP's reducer, FSDP's parameter gathering) see it."""
        return self.step_function(model, method)(*args)

    def step_function(self, model: nn.Module, method: str) -> Callable[..., Any]:
        """``run_step(model, method, ...)`` as one callable, built once (the Trainer calls it per batch)."""
        return bound_step(model, self.unwrap_model(model), method, self.strategy.redirect_forward)


def _accumulation_steps(given: Optional[int], defaults: Dict[str, Any]) -> int:
    """``gradient_accumulation_steps``, else what ``trainforge launch`` was told, else 1; checked."""
    accum = given if given is not None else defaults.get("gradient_accumulation_steps", 1)
    if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
        raise ConfigurationError(f"gradient_accumulation_steps={accum!r} must be an int >= 1 (1 means no accumulation)")
    return accum


def _check_project(project_dir: Optional[str], automatic_checkpoint_naming: bool, total_limit: Any) -> None:
    if automatic_checkpoint_naming and project_dir is None:
        raise ConfigurationError(
            "automatic_checkpoint_naming=True needs project_dir=<directory> (checkpoints "
            "go to <project_dir>/checkpoints/checkpoint_<i>)"
        )
    if total_limit is not None and (not isinstance(total_limit, int) or total_limit < 1):
        raise ConfigurationError(f"total_limit={total_limit!r} must be an int >= 1 or None (keep all)")


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


def _is_scheduler(obj: Any) -> bool:
    lr_scheduler = torch.optim.lr_scheduler
    base = getattr(lr_scheduler, "LRScheduler", None) or lr_scheduler._LRScheduler
    return isinstance(obj, (base, lr_scheduler.ReduceLROnPlateau))
