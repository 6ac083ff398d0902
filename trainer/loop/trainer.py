"""``Trainer``: owns the loop and sends lifecycle events (see ``callbacks/events.py``) to the module
and the callbacks. It runs on an ``Accelerator``, so it shares every code path for placement,
precision, accumulation and checkpointing with users of the thin API."""

from __future__ import annotations

import inspect
import logging
import signal
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Union

import torch

from trainforge.callbacks.base import Callback
from trainforge.callbacks.events import Event
from trainforge.strategies import Strategy
from trainforge.strategies.checkpoint.async_save import resolve_async_save
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.materialize import init_module_context
from trainforge.trainer.accelerator.accelerator import Accelerator
from trainforge.trainer.accelerator.seed import seed_everything
from trainforge.trainer.accelerator.wrappers import PreparedDataLoader
from trainforge.trainer.cluster.slurm_requeue import SlurmRequeue
from trainforge.trainer.cluster.stop_signals import DEFAULT_STOP_SIGNALS, SignalsArg, StopSignals, stopped
from trainforge.trainer.compat.lightning.trainer_args import (
    LightningAttributes,
    apply_deterministic,
    callback_list,
    check_summary_setting,
    refuse_unknown_arguments,
    setup_processes,
    tracker_callbacks,
)
from trainforge.trainer.loop.defaults import default_callbacks, setting_callbacks
from trainforge.trainer.loop.eval_results import fit_datamodule
from trainforge.trainer.loop.evaluation import Evaluation
from trainforge.trainer.loop.fit_checkpoints import FitCheckpoints
from trainforge.trainer.loop.fit_loop import FitLoop
from trainforge.trainer.loop.manual import ManualOptimization
from trainforge.trainer.loop.metric_logging import MetricLogging
from trainforge.trainer.loop.metrics import MetricStore
from trainforge.trainer.loop.module_hooks import (
    bind_module_hook,
    validation_loaders,
    warn_unknown_callback_hooks,
    warn_unknown_hooks,
)
from trainforge.trainer.loop.profiling import instrument, reset_profilers
from trainforge.trainer.loop.settings import (
    LoopConfig,
    Progress,
    check_callbacks,
    limited,
    loader_length,
    parse_optimizers,
    resolve_root_dirs,
)
from trainforge.trainer.loop.stage_loaders import StageLoaders, as_list
from trainforge.trainer.module.hparams import logged_hparams
from trainforge.trainer.module.training_module import TrainingModule

log = logging.getLogger("trainforge")


class Trainer(
    FitLoop, MetricLogging, Evaluation, ManualOptimization, FitCheckpoints, StageLoaders, LightningAttributes
):
    def __init__(
        self,
        *,
        accelerator: Optional[str] = None,
        strategy: Union[str, Strategy, None] = None,
        devices: Union[int, str, Sequence[int]] = "auto",
        num_nodes: int = 1,
        precision: Optional[str] = None,
        logger: Any = None,
        max_epochs: Optional[int] = None,
        min_epochs: Optional[int] = None,
        max_steps: int = -1,
        min_steps: Optional[int] = None,
        accumulate_grad_batches: Optional[int] = None,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: Union[int, float] = 1.0,
        check_val_every_n_epoch: Optional[int] = 1,
        limit_train_batches: Union[int, float] = 1.0,
        limit_val_batches: Union[int, float] = 1.0,
        limit_test_batches: Union[int, float] = 1.0,
        limit_predict_batches: Union[int, float] = 1.0,
        log_every_n_steps: int = 50,
        callbacks: Union[Callback, Sequence[Callback], None] = None,
        default_root_dir: Optional[str] = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        enable_model_summary: bool = True,
        deterministic: Union[bool, str, None] = None,
        compile: bool = False,
        seed: Optional[int] = None,
        nonfinite_loss: str = "raise",
        resume: Optional[str] = None,
        num_sanity_val_steps: int = 2,
        stop_signals: SignalsArg = DEFAULT_STOP_SIGNALS,
        auto_requeue: bool = True,
        requeue_signal: Union[str, int, signal.Signals] = "SIGUSR1",
        hang_timeout: Optional[float] = None,
        profiler: Any = None,
        **unknown: Any,
    ) -> None:
        if unknown:  # Lightning 1.x's removed arguments (gpus=, plugins=) get the 2.x way, not a TypeError
            refuse_unknown_arguments(unknown, [p for p in inspect.signature(Trainer).parameters if p != "unknown"])
        callbacks = check_callbacks(callback_list(callbacks, Callback), Callback)  # before anything is built
        callbacks, default_tracker = tracker_callbacks(logger, callbacks)
        callbacks = setting_callbacks(callbacks, profiler, hang_timeout)  # profiler=, hang_timeout= (defaults.py)
        self.config = LoopConfig(
            max_epochs=max_epochs,
            min_epochs=min_epochs,
            max_steps=max_steps,
            min_steps=min_steps,
            accumulate_grad_batches=1 if accumulate_grad_batches is None else accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches,
            limit_test_batches=limit_test_batches,
            limit_predict_batches=limit_predict_batches,
            log_every_n_steps=log_every_n_steps,
            nonfinite_loss=nonfinite_loss,
        )
        self.config.validate()
        self.stop_signals = StopSignals(stop_signals, "Trainer(stop_signals)")  # trainer/cluster/stop_signals.py
        if resume not in (None, "auto"):
            raise ConfigurationError(
                f"resume={resume!r} is not one of: None, 'auto' (to resume from a given "
                "checkpoint, pass fit(..., ckpt_path=PATH))"
            )
        apply_deterministic(deterministic)
        check_summary_setting(enable_model_summary, callbacks)
        if seed is not None:
            seed_everything(seed)
        # devices/num_nodes: checked against the launcher's processes, or (a plain `python script.py`
        # with devices=N) this process becomes rank 0 of N (trainer/compat/lightning/trainer_args.py)
        strategy = setup_processes(devices, num_nodes, accelerator, strategy)
        # An IterableDataset is split between ranks (not dispatched from rank 0, Accelerate's default):
        # then a dataset that already shards itself by rank is caught (its streams differ), never
        # trained on rank 0's shard alone. ``trainer.accelerator.dispatch_batches = True`` to dispatch.
        self.accelerator = Accelerator(
            strategy,
            precision,
            accumulate_grad_batches,
            seed=seed or 0,
            accelerator=accelerator,
            dispatch_batches=False,
        )
        self.strategy = self.accelerator.strategy
        self.default_root_dir, self._remote_root = resolve_root_dirs(default_root_dir)  # a URL: checkpoints only
        self.requeue = SlurmRequeue(
            auto_requeue, requeue_signal, self.stop_signals.signals
        )  # trainer/cluster/slurm_requeue.py
        self.compile, self.resume, self.seed = compile, self.requeue.resume(resume, self.is_global_zero), seed
        if (
            not isinstance(num_sanity_val_steps, int)
            or isinstance(num_sanity_val_steps, bool)
            or num_sanity_val_steps < -1
        ):
            raise ConfigurationError(
                f"num_sanity_val_steps={num_sanity_val_steps!r} must be an int: 0 (off), "
                "N batches (default 2) or -1 (the whole validation set)"
            )
        self.num_sanity_val_steps = num_sanity_val_steps
        self.datamodule: Any = None
        self.callbacks: List[Callback] = default_callbacks(
            callbacks, enable_progress_bar, enable_checkpointing, default_tracker, enable_model_summary
        )
        self.progress = Progress()
        self.stage = "fit"
        self.should_stop = False
        self._init_logging()  # callback_metrics, logged_metrics (trainer/loop/metric_logging.py)
        self.module: Optional[TrainingModule] = None
        self.model: Any = None
        self.optimizer: Any = None
        self._prepared_optimizers: List[Any] = []
        self.lr_scheduler_configs: List[Dict[str, Any]] = []
        self.train_dataloader: Any = None
        self.val_dataloaders: List[Any] = []
        self.num_training_batches = 0
        self._metrics = {"train": MetricStore(), "val": MetricStore()}
        self._running = "train"
        self._batch: Any = None
        self._listeners: Dict[Event, List[Any]] = {event: [] for event in Event}
        self._training_step: Any = None
        self._pipelined = False  # the strategy runs a pipeline schedule (see _pipeline_batch)
        self._pending_rng: Optional[Dict[str, Any]] = None
        self.run_id: Optional[str] = None  # given by each fit (kept from the checkpoint it resumes)
        self._nonfinite_flag: Optional[torch.Tensor] = None  # see _check_loss_async
        self._last_flag_check = 0
        self._last_output: Any = None
        self._none_steps, self._warned_none = 0, False  # training_step returning None (see _warn_none_epoch)
        self._manual_stepped: Optional[set] = None  # manual optimization: see trainer/loop/manual.py
        self._warned_double_step = False
        self._data_ended = False  # this batch was the last of a loader without length

    # ---- read-only views callbacks rely on -------------------------------------------------------
    global_step = property(lambda self: self.progress.global_step)
    current_epoch = property(lambda self: self.progress.epoch)
    batch_idx = property(lambda self: self.progress.batch_idx)
    is_global_zero = property(lambda self: self.strategy.is_global_zero)
    global_rank = property(lambda self: self.strategy.global_rank)
    world_size = property(lambda self: self.strategy.world_size)
    device = property(lambda self: self.strategy.root_device)
    precision = property(lambda self: self.accelerator.precision.name)
    max_steps = property(lambda self: self.config.max_steps)
    max_epochs = property(lambda self: self.config.max_epochs)
    log_every_n_steps = property(lambda self: self.config.log_every_n_steps)
    optimizers = property(lambda self: [o.optimizer for o in self._prepared_optimizers])
    progress_bar_metrics = property(lambda self: dict(self._metrics["train"].prog_bar))  # prog_bar=True values
    stop_requested = property(lambda self: self.stop_signals.stop_requested)  # "SIGTERM": every rank stops now

    @property
    def hparams(self) -> Dict[str, Any]:
        module_hparams = logged_hparams(self.module, self.datamodule)  # save_hyperparameters(logger=True)
        return {
            "trainer": {
                **self.config.as_dict(),
                "strategy": self.strategy.name,
                "precision": self.precision,
                "world_size": self.world_size,
                "seed": self.seed,
            },
            **module_hparams,
        }

    # ---- events ----------------------------------------------------------------------------------
    def _fire(self, event: Event, *args: Any) -> None:
        """The one dispatch point: the module first, then the callbacks in order."""
        for hook in self._listeners[event]:
            hook(self, self.module, *args)

    def _build_listeners(self) -> None:
        """Per event, the bound hooks of the targets that override it (no-op hooks are skipped): the
        module's with Lightning's signatures (``trainer/loop/module_hooks.py``), bound once here."""
        listeners, module_name = {}, type(self.module).__name__
        reset_profilers(self.callbacks)
        for event in Event:
            module_hook = bind_module_hook(self.module, event)
            targets = ([(f"{module_name}.{event.value}", module_hook)] if module_hook is not None else []) + [
                (f"{type(cb).__name__}.{event.value}", getattr(cb, event.value))
                for cb in self.callbacks
                if _overrides(cb, event.value)
            ]
            listeners[event] = instrument(targets, self.callbacks)  # wrapped only when a profiler is installed
        self._listeners = listeners

    # ---- fit -------------------------------------------------------------------------------------
    def fit(
        self,
        model: TrainingModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: Optional[str] = None,
    ) -> None:
        """Loaders come from the arguments, else from ``datamodule`` (also accepted in place of
        ``train_dataloaders``), else from the module's ``train_dataloader()``/``val_dataloader()`` (Lightning)."""
        module = model
        train_dataloaders, datamodule = fit_datamodule(train_dataloaders, val_dataloaders, datamodule)
        self._attach(module, "fit")
        self._setup_hooks("fit", datamodule)  # before loaders and optimizers, in Lightning's order
        if train_dataloaders is None:
            loaders = self._loaders_for("fit", None, datamodule)
            if len(loaders) > 1:  # audit N-DM3: the second one was dropped without a word
                owner = type(datamodule if datamodule is not None else module).__name__
                raise ConfigurationError(
                    f"{owner}.train_dataloader() returned {len(loaders)} loaders; the Trainer "
                    "trains on one: return a single DataLoader (e.g. over a "
                    "torch.utils.data.ConcatDataset of the datasets)"
                )
            train_dataloaders = loaders[0]
            if val_dataloaders is None:
                val_dataloaders = self._loaders_for("validate", None, datamodule, required=False) or None
        self._check_loader(train_dataloaders, "train_dataloaders")
        for i, dl in enumerate(as_list(val_dataloaders)):  # an empty one would validate on nothing, silently
            self._check_loader(
                dl, "val_dataloaders" if not isinstance(val_dataloaders, (list, tuple)) else f"val_dataloaders[{i}]"
            )
        try:
            self._setup_fit(module, train_dataloaders, val_dataloaders)
            path = ckpt_path if ckpt_path is not None else ("last" if self.resume == "auto" else None)
            self._start_run(path, required=ckpt_path is not None)  # run id; resume; warns of an earlier run
            self._fire(Event.FIT_START)
            self._sanity_check()
            self._fire(Event.TRAIN_START)
            self._warn_if_nothing_to_train()
            self._restore_pending_rng()  # last thing before the loop: keeps resumed random streams exact
            with self.stop_signals.catching(self.global_step):  # a stop signal: all ranks save one step and exit
                self._fit_loop()
                self._fire(Event.TRAIN_END)
                self._fire(Event.FIT_END)
                self.accelerator.wait_for_checkpoint()  # fit returns once the last async save is committed
            self._fire(Event.TEARDOWN, "fit")
        except BaseException as exc:
            self._wait_for_checkpoint_quietly()
            self._fire(Event.EXCEPTION, exc)
            self._fire(Event.TEARDOWN, "fit")
            raise
        finally:  # workers of a pass fit left mid-epoch stop now, not at garbage collection (5 s each there)
            for loader in [self.train_dataloader, *self.val_dataloaders]:
                if isinstance(loader, PreparedDataLoader):
                    loader.release_workers()
        if self.stop_requested is not None:  # TrainingStopped: exit code 128 + the signal number
            raise stopped(self.stop_signals, self.global_step, self.callbacks, self.is_global_zero, self.requeue)

    def _setup_fit(self, module: TrainingModule, train_loader: Any, val_loaders: Any) -> None:
        self._none_steps, self._warned_none = 0, False
        acc = self.accelerator
        # Settings a backend may need at setup (DeepSpeed writes them into its generated config).
        acc.update_run_settings(
            gradient_clip_val=self.config.gradient_clip_val, gradient_clip_algorithm=self.config.gradient_clip_algorithm
        )
        self.strategy.plan_layout(module, train_loader)  # a layout chosen from the model decides the shards
        self.train_dataloader = acc.prepare_data_loader(train_loader)
        if self.compile:
            for child in module.children():
                child.compile()
        manual = not module.automatic_optimization
        if manual:
            self._check_manual_config()
        self._pipelined = self.strategy.pipelined
        if self._pipelined:
            _check_pipelined(self, manual)
        # Lightning's order, for every strategy: place and wrap first, then build the optimizers, so
        # configure_optimizers sees the final device and parameters (fused AdamW on CUDA, FSDP's
        # DTensors, bf16-true weights) and nothing has to be remapped.
        configured = []

        def build_optimizers() -> list:
            self.model = module  # placed and sharded: Lightning's guides build optimizers from trainer.model
            configured.append(parse_optimizers(module.configure_optimizers(), type(module).__name__, manual))
            return list(configured[0].optimizers)

        self.model, prepared = acc.prepare_model_with_optimizers(module, build_optimizers)
        self.optimizer, self._prepared_optimizers = prepared[0], prepared
        self.lr_scheduler_configs = configured[0].schedulers
        self._training_step = acc.step_function(self.model, "training_step")
        val_loaders = validation_loaders(module, val_loaders, self._pipelined)  # none without validation_step
        self.val_dataloaders = [acc.prepare_data_loader(dl) for dl in as_list(val_loaders)]
        self.num_training_batches = limited(loader_length(self.train_dataloader), self.config.limit_train_batches)
        if (
            self.num_training_batches == float("inf")
            and isinstance(self.config.val_check_interval, float)
            and self.config.val_check_interval != 1.0
        ):
            raise ConfigurationError(
                f"val_check_interval={self.config.val_check_interval!r} is a fraction of the "
                "epoch, but train_dataloaders has no length (an IterableDataset without "
                "__len__): give a number of batches (int) or define __len__"
            )
        if self.num_training_batches == 0:
            raise ConfigurationError(
                "train_dataloaders yields no batch on this process (limit_train_batches="
                f"{self.config.limit_train_batches!r}); give it data or raise the limit"
            )

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, path: str, async_save: bool = False, trainable_only: Optional[bool] = None) -> Any:
        """Everything needed to resume exactly, as one checkpoint directory (every rank calls it).
        ``async_save=True``: returns once the state is staged; the write and commit run in the
        background (``fit`` waits for it before returning; see strategies/checkpoint/async_save.py).
        ``trainable_only``: leave the frozen parameters out (None: for PEFT models; trainer/checkpoint/adapters.py)."""
        return self._save_checkpoint(path, resolve_async_save(async_save, self.device), trainable_only)

    def _wait_for_checkpoint_quietly(self) -> None:
        """On an error in fit: let the save in flight commit, without hiding the original error."""
        try:
            self.accelerator.wait_for_checkpoint()
        except Exception as e:
            log.error("trainforge: %s", e)

    def save_weights(self, path: str, max_shard_size: Optional[int] = None, adapter_only: Optional[bool] = None) -> Any:
        """Consolidated safetensors weights of the module (loadable by safetensors and transformers); a
        PEFT model's adapter in PEFT's format (``adapter_only``: None by the model; trainer/checkpoint/adapters.py)."""
        from trainforge.trainer.checkpoint.contents import save_weights

        self.accelerator.wait_for_checkpoint()  # one save at a time (an async one may be in flight)
        return save_weights(self.strategy, self.model, path, max_shard_size, adapter_only)

    def init_module(self, empty_init: Optional[bool] = None) -> ContextManager[None]:
        """Lightning's: modules built inside take no memory when ``empty_init`` (None: when the strategy
        shards them, FSDP): their parameters wait on the meta device until setup materialises them, each
        rank only its shards, filled by ``trainforge.load_pretrained(model, path)`` (read slice by slice)
        or by each layer's ``reset_parameters()`` (strategies/materialize.py)."""
        return init_module_context(self.strategy, empty_init)

    # ---- helpers ---------------------------------------------------------------------------------
    def _attach(self, module: TrainingModule, stage: str) -> None:
        if not isinstance(module, TrainingModule):
            raise ConfigurationError(
                f"expected a TrainingModule, got {type(module).__name__}; subclass "
                "trainforge.TrainingModule and implement training_step and configure_optimizers"
            )
        if "hparams" not in vars(module):  # audit M18: nn.Module.__init__ instead of super().__init__()
            raise ConfigurationError(
                f"{type(module).__name__}.__init__ did not run TrainingModule.__init__ (it calls "
                "nn.Module.__init__(self) or another base directly): call super().__init__() "
                "first, or its hyperparameters and hooks are lost"
            )
        required = {"fit": "training_step", "validate": "validation_step", "test": "test_step"}.get(stage)
        if required and getattr(type(module), required) is getattr(TrainingModule, required):
            raise ConfigurationError(
                f"{type(module).__name__} does not implement {required}(self, batch, batch_idx),"
                f" which Trainer.{stage if stage != 'validate' else 'validate'}() needs"
            )
        if stage == "fit" and type(module).configure_optimizers is TrainingModule.configure_optimizers:
            raise ConfigurationError(
                f"{type(module).__name__} does not implement configure_optimizers(self); "
                "return an optimizer such as torch.optim.AdamW(self.parameters(), lr=3e-4)"
            )
        object.__setattr__(module, "_trainer", self)
        self.module, self.stage, self.should_stop = module, stage, False
        if stage == "fit":
            warn_unknown_hooks(module)
            for cb in self.callbacks:
                warn_unknown_callback_hooks(cb, Callback)
        self._build_listeners()

    def _setup_hooks(self, stage: str, datamodule: Any) -> None:
        """Lightning's order: the datamodule's ``prepare_data``/``setup(stage)``, then SETUP (the
        module's ``setup(stage)``, the callbacks' ``on_setup``), then the module's
        ``configure_model()``; only then are its loaders asked for, the model placed and its
        optimizers built, so layers created in ``setup`` or ``configure_model`` are trained."""
        try:
            if datamodule is not None:
                self._setup_datamodule(datamodule, stage)
            self._fire(Event.SETUP, stage)
            module = self.module
            if module is not None and type(module).configure_model is not TrainingModule.configure_model:
                module.configure_model()
        except BaseException as exc:
            self._fire(Event.EXCEPTION, exc)
            self._fire(Event.TEARDOWN, stage)
            raise


def _check_pipelined(trainer: Trainer, manual: bool) -> None:
    """What pipeline parallelism does not run (yet), refused before any work."""
    if trainer.compile:
        raise ConfigurationError(
            "compile=True with pipeline parallelism is not built yet (each stage would need "
            "its own compiled forward); train with compile=False"
        )
    if manual:
        raise ConfigurationError(
            "automatic_optimization=False with pipeline parallelism: the schedule runs forward "
            "and backward itself; use automatic optimization (and define loss_fn)"
        )


def _overrides(target: Any, hook: str) -> bool:
    method = getattr(type(target), hook, None)
    return method is not None and method is not getattr(Callback, hook)
