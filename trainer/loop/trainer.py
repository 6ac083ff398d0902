"""``Trainer``: owns the loop and sends lifecycle events (see ``callbacks/events.py``) to the module
and the callbacks. It runs on an ``Accelerator``, so it shares every code path for placement,
precision, accumulation and checkpointing with users of the thin API.

The training loop is the Trainer's own code, here, read top to bottom as torchtitan's ``train()``:
``fit`` -> ``_train`` (the epochs) -> ``_train_epoch`` (the batches) -> ``_train_batch`` (the one step path
through ``Strategy.forward_backward``) -> ``_optimizer_step``. The loop is where the Trainer's state changes
(progress, the model, the optimizers), so it stays on the object that owns that state; what it asks along
the way are parts and functions that take explicit inputs: ``LossChecks``, ``StopRules``, ``validation_due``
and ``step_schedulers`` (``fit_loop.py``), ``Evaluation`` and ``EvaluationInputs`` (``evaluation.py``,
``eval_results.py``), ``MetricLogging``, ``ManualOptimization`` (``manual.py``), ``FitCheckpoints`` and
``StageLoaders``. The Trainer builds each once in ``__init__`` and hands it what it needs (the accelerator, the
progress, the metric stores, its ``_fire`` dispatch point); none of them reads the Trainer's ``_`` names."""

from __future__ import annotations

import inspect
import logging
import signal
import warnings
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import torch

from trainforge.callbacks.base import Callback
from trainforge.callbacks.events import Event
from trainforge.strategies import Strategy
from trainforge.strategies.checkpoint.async_save import resolve_async_save
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.materialize import init_module_context
from trainforge.trainer.accelerator.accelerator import Accelerator
from trainforge.trainer.accelerator.seed import rng_state, seed_everything, set_rng_state
from trainforge.trainer.accelerator.token_loss import ITEMS_KEY
from trainforge.trainer.accelerator.wrappers import PreparedDataLoader
from trainforge.trainer.checkpoint.contents import CheckpointParts
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
from trainforge.trainer.loop.eval_results import EvaluationInputs, fit_datamodule, print_results
from trainforge.trainer.loop.evaluation import Evaluation, module_modes, restore_modes
from trainforge.trainer.loop.fit_checkpoints import FitCheckpoints, saved_run_id
from trainforge.trainer.loop.fit_loop import (
    LossChecks,
    StopRules,
    check_same_batch_count,
    find_step_guard,
    step_schedulers,
    validation_due,
    validation_epoch,
    warn_skips,
)
from trainforge.trainer.loop.manual import ManualOptimization
from trainforge.trainer.loop.metric_logging import MetricLogging
from trainforge.trainer.loop.module_hooks import (
    bind_module_hook,
    callback_hook_names,
    lightning_order,
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
from trainforge.trainer.loop.stage_loaders import StageLoaders, as_list, check_loader
from trainforge.trainer.loop.step_hooks import (
    ClosureOptimizer,
    StepClosure,
    StepOverrides,
    add_module_callbacks,
    batch_transfer,
    configure_model,
    keep_on_host,
    step_overrides,
)
from trainforge.trainer.module.hparams import logged_hparams
from trainforge.trainer.module.training_module import TrainingModule

log = logging.getLogger("trainforge")

_REQUIRED_STEP = {"fit": "training_step", "validate": "validation_step", "test": "test_step"}


class Trainer(LightningAttributes):
    """Trains a ``TrainingModule``: the loop, its events to the module and the callbacks, checkpoints, stop
    signals and resuming, on an ``Accelerator`` it owns (Lightning's ``Trainer`` arguments and names).

    Args:
        accelerator: The device type: "auto" (None: the accelerator torch finds, else the CPU), "cpu",
            "cuda"/"gpu", "mps", "xla".
        strategy: How the model is placed and parallelised: "auto" (one process on one device, DDP when
            launched as several), "single", "ddp", "fsdp", "deepspeed", "megatron", "xla", or a ``Strategy``
            object; None (the default): what ``trainforge launch`` was told, else "auto".
        devices: Processes per node: "auto" (the processes the launcher started; one from a plain
            ``python script.py``), N (from a plain script, this process becomes rank 0 of N), -1 (one per
            visible accelerator device) or a list of device indices. Default "auto".
        num_nodes: Machines the run spans; must agree with the launcher. Default 1.
        precision: "32", "16-mixed", "bf16-mixed", "bf16-true" or "fp8" (aliases "fp32"/"no", "fp16",
            "bf16"); None (the default): what ``trainforge launch`` was told, else "32".
        logger: The trackers: None or True installs Lightning's default logger unless ``callbacks`` holds a
            tracker (``TensorBoardLogger`` when tensorboard is installed, else ``CSVLogger``, under
            ``<default_root_dir>/lightning_logs/version_<N>``), False installs none, a tracker (``CSVLogger``,
            ``TensorBoardLogger``, ``MLflowLogger``, ``CometLogger``) or a list of them is added to the callbacks.
        max_epochs: Epochs to train; None: only ``max_steps`` ends the run (one of the two is required).
        min_epochs: ``trainer.should_stop`` (EarlyStopping, Timer) ends fit only after this many epochs;
            None: no minimum.
        max_steps: Optimizer steps to train; -1 (the default): no limit, ``max_epochs`` ends the run.
        min_steps: ``trainer.should_stop`` ends fit only after this many optimizer steps; None: no minimum.
        accumulate_grad_batches: Batches whose gradients add up to one optimizer step; None: 1.
        gradient_clip_val: Clip the gradients at each optimizer step to this norm (or value); None: no clipping.
        gradient_clip_algorithm: "norm" (the total norm, the default) or "value" (each element).
        val_check_interval: When to validate within an epoch: a fraction of the epoch (1.0, the default: at its
            end) or a number of training batches.
        check_val_every_n_epoch: Validate in every N-th epoch (default 1); None: only by ``val_check_interval``
            counted over the run.
        limit_train_batches: Training batches per epoch: a fraction of the loader (1.0, the default: all) or
            a count.
        limit_val_batches: Validation batches per run, as ``limit_train_batches``; 0 turns validation off.
        limit_test_batches: Test batches, as ``limit_train_batches``.
        limit_predict_batches: Prediction batches, as ``limit_train_batches``.
        log_every_n_steps: Send the step metrics to the trackers every N optimizer steps (default 50);
            ``trainer.callback_metrics`` is current after every step whatever N is.
        callbacks: A ``Callback`` or a list of them; the defaults the other settings ask for are added
            (progress bar, model summary, the default logger, ``ModelCheckpoint``) unless one of the same kind is
            given.
        default_root_dir: Where logs, trackers and checkpoints go (``<dir>/lightning_logs/version_<N>`` with the
            default logger, its checkpoints in ``checkpoints/`` there; ``<dir>/checkpoints`` without a file
            logger); None: ``./runs``.
            A URL (``s3://bucket/run``) holds the checkpoints, and logs stay on local disk.
        enable_progress_bar: Install a ``ProgressBar`` (default True).
        enable_checkpointing: Install a ``ModelCheckpoint`` when none is given (default True): a checkpoint at
            every epoch's end and at the end of fit, the newest kept.
        enable_model_summary: Install a ``ModelSummary``, the layer table at fit start (default True).
        deterministic: True: ``torch.use_deterministic_algorithms`` (cuDNN benchmark off), "warn": only warn
            where an operation has no deterministic version, False: off; None (the default): torch's setting.
        compile: ``torch.compile`` each child module of the model before fit (default False).
        seed: ``seed_everything(seed)`` at construction, and the seed each rank's data order derives from;
            None (the default): no seeding here (the data order from seed 0).
        nonfinite_loss: A NaN or infinite loss: "raise" (the default; on an accelerator, checked at log points
            without stalling the device), "skip" (the batch trains nothing and is counted) or "off".
        resume: "auto": each fit resumes from the newest checkpoint under the checkpoint directory when one
            exists, and starts fresh otherwise; None (the default): fit resumes only from ``ckpt_path``.
        num_sanity_val_steps: Validation batches run before training so a broken ``validation_step`` fails in
            seconds (default 2); 0: none, -1: the whole validation set.
        stop_signals: Signals that make every rank stop at the same step, save a checkpoint and exit with
            128 + the signal number: a name, a number or a list (default SIGTERM, SIGINT, SIGUSR1); None:
            none caught.
        auto_requeue: In a SLURM batch job, ``requeue_signal`` saves, requeues the job and the next one
            resumes (default True); False: it saves and exits.
        requeue_signal: The signal SLURM sends before the time limit (``#SBATCH --signal=USR1@90``); default
            "SIGUSR1".
        hang_timeout: Seconds without progress (a training or validation batch starting or ending) after which
            every rank's stacks are dumped and the process ends with exit code 124 (``HangWatchdog``), so a hung
            collective does not hold the job until its time limit; None (the default): off.
        profiler: Time each hook: "simple" (``SimpleProfiler``: each hook's time per step), "pytorch"
            (``PyTorchProfiler``: ``record_function`` ranges in a torch profiler trace) or an instance of either;
            None (the default): off.
        **unknown: Not taken: a Lightning 1.x argument (``gpus``, ``plugins``, ...) is a ``ConfigurationError``
            naming its 2.x form, any other one a ``ConfigurationError`` listing the arguments above.
    """

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
        # checked before anything is built
        callbacks = check_callbacks(callback_list(callbacks, Callback), Callback)
        callbacks, default_tracker = tracker_callbacks(logger, callbacks)
        # profiler=, hang_timeout= (defaults.py)
        callbacks = setting_callbacks(callbacks, profiler, hang_timeout)
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
        # trainer/cluster/stop_signals.py
        self.stop_signals = StopSignals(stop_signals, "Trainer(stop_signals)")
        _check_resume_and_sanity(resume, num_sanity_val_steps)
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
            data_sharding="samples",  # Lightning's DistributedSampler: sample i to rank i % W
        )
        self.strategy = self.accelerator.strategy
        # a URL: checkpoints only
        self.default_root_dir, self._remote_root = resolve_root_dirs(default_root_dir)
        # trainer/cluster/slurm_requeue.py
        self.requeue = SlurmRequeue(auto_requeue, requeue_signal, self.stop_signals.signals)
        self.compile, self.resume, self.seed = compile, self.requeue.resume(resume, self.is_global_zero), seed
        self.num_sanity_val_steps = num_sanity_val_steps
        self.callbacks: List[Callback] = default_callbacks(
            callbacks, enable_progress_bar, enable_checkpointing, default_tracker, enable_model_summary
        )
        for logger in self.loggers:  # a file logger without save_dir writes under default_root_dir (Lightning's)
            logger.place(str(self.default_root_dir))
        self.progress = Progress()
        self.stage = "fit"
        self.should_stop = False
        self._init_fit_state()
        self._build_parts()

    def _init_fit_state(self) -> None:
        """What each fit sets: the module, its prepared model, optimizers and loaders, the run id."""
        self.module: Optional[TrainingModule] = None
        self.model: Any = None
        self.optimizer: Any = None
        self._prepared_optimizers: List[Any] = []
        self.lr_scheduler_configs: List[Dict[str, Any]] = []
        self.train_dataloader: Any = None
        self.val_dataloaders: List[Any] = []
        self.num_training_batches: Any = 0
        # given by each fit (kept from the checkpoint it resumes)
        self.run_id: Optional[str] = None
        self._listeners: Dict[Event, List[Any]] = {event: [] for event in Event}
        self._training_step: Any = None
        # the strategy runs a pipeline schedule (see _after_pipeline_step)
        self._pipelined = False
        self._last_output: Any = None
        # this batch was the last of a loader without length
        self._data_ended = False
        # callbacks/base.py's StepGuard among the callbacks, and whether the module clips itself: set per fit
        self._step_guard: Any = None
        self._custom_clipping = False
        # the module's step hooks (trainer/loop/step_hooks.py), its batch-transfer hooks, and the loss of the
        # last forward_backward (what an optimizer_closure returns): set per stage
        self._hooks = StepOverrides(optimizer_step=False, backward=False)
        self._transfer: Any = None
        self._closure_loss: Any = None
        # the module's on_train_batch_start returned -1: the rest of the epoch is skipped (Lightning)
        self._skip_epoch = False

    def _build_parts(self) -> None:
        """The parts the Trainer is built from, each given what it uses (none reads the Trainer's ``_`` names)."""
        self._logging = MetricLogging(self.strategy, self.progress, self._fire)
        self._loaders = StageLoaders(self.strategy, self)
        self._checkpoints = FitCheckpoints(self.accelerator, self.progress, self.callbacks, self._fire, self)
        self._eval_inputs = EvaluationInputs(self.strategy, self._checkpoints.root)
        self._evaluation = Evaluation(self.accelerator, self.config, self._fire, self._logging, self.callbacks)
        self._manual = ManualOptimization(self.accelerator, self.config, self.progress, self._fire, self._logging)
        self._loss = LossChecks(self.config, self.progress, self.strategy)
        self._stops = StopRules(self.config, self.progress, self.stop_signals, self.strategy)

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
    # "SIGTERM": every rank stops now
    stop_requested = property(lambda self: self.stop_signals.stop_requested)
    # Lightning's trainer.datamodule: the one the last stage set up
    datamodule = property(lambda self: self._loaders.datamodule)
    sanity_checking = property(lambda self: self.stage == "sanity_check")
    # every logged metric's latest value (trainer/loop/metric_logging.py says when each changes)
    callback_metrics = property(lambda self: self._logging.callback_metrics)
    # what was last sent to the trackers
    logged_metrics = property(lambda self: self._logging.logged_metrics)
    # the values logged with prog_bar=True, training's and evaluation's (Lightning's)
    progress_bar_metrics = property(
        lambda self: {**self._logging.stores["train"].prog_bar, **self._logging.stores["val"].prog_bar}
    )

    @property
    def hparams(self) -> Dict[str, Any]:
        # save_hyperparameters(logger=True)
        module_hparams = logged_hparams(self.module, self.datamodule)
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

    @property
    def default_checkpoint_dir(self) -> str:
        """Where a ModelCheckpoint without ``dirpath`` writes, as Lightning: ``<logger's version folder>/checkpoints``
        when the first logger has one (CSVLogger, TensorBoardLogger: ``<save_dir>/lightning_logs/version_<N>``),
        else ``<default_root_dir>/checkpoints``; a URL when ``default_root_dir`` was one (``default_root_dir`` is
        then the local folder of logs and trackers: trainer/loop/settings.py ``resolve_root_dirs``)."""
        if self._remote_root:
            return f"{self._remote_root}/checkpoints"
        logger = self.logger
        version_dir = logger.version_dir(str(self.default_root_dir)) if logger is not None else None
        return str(Path(version_dir or self.default_root_dir) / "checkpoints")

    # ---- events ----------------------------------------------------------------------------------
    def _fire(self, event: Event, *args: Any) -> None:
        """The one dispatch point: the callbacks and the module, in Lightning's order at each event."""
        for hook in self._listeners[event]:
            hook(self, self.module, *args)

    def _build_listeners(self) -> None:
        """Per event, the bound hooks of the targets that override it (no-op hooks are skipped), in
        Lightning's order (``lightning_order``): the module's with Lightning's signatures
        (``trainer/loop/module_hooks.py``), bound once here; a callback's ``setup``/``teardown``
        (Lightning's names) with its ``on_setup``/``on_teardown``."""
        listeners, module_name = {}, type(self.module).__name__
        reset_profilers(self.callbacks)
        for event in Event:
            module_hook = bind_module_hook(self.module, event)
            if event is Event.BATCH_START and module_hook is not None:
                # Lightning: the module's on_train_batch_start returning -1 ends the epoch there
                module_hook = self._reads_skip(module_hook)
            module_targets = [(f"{module_name}.{event.value}", module_hook)] if module_hook is not None else []
            callback_targets = [
                ((f"{type(cb).__name__}.{name}", getattr(cb, name)), cb.monitors_metrics)
                for cb in self.callbacks
                for name in callback_hook_names(event)
                if _overrides(cb, name)
            ]
            # wrapped only when a profiler is installed
            listeners[event] = instrument(lightning_order(event, module_targets, callback_targets), self.callbacks)
        self._listeners = listeners

    def _reads_skip(self, hook: Any) -> Any:
        def read(trainer: Any, module: Any, *args: Any) -> None:
            result = hook(trainer, module, *args)
            self._skip_epoch = isinstance(result, int) and result == -1

        return read

    # ---- fit -------------------------------------------------------------------------------------
    def fit(
        self,
        model: TrainingModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: Optional[str] = None,
    ) -> None:
        """Train ``model``: setup, resume, the sanity check, then the epochs until ``max_epochs``,
        ``max_steps``, ``trainer.should_stop`` or a stop signal (then every rank saves the same step and
        ``TrainingStopped`` is raised, exit code 128 + the signal number).

        Loaders come from the arguments, else from ``datamodule``, else from the module's
        ``train_dataloader()``/``val_dataloader()`` (Lightning).

        Args:
            model: The ``TrainingModule`` to train (``training_step`` and ``configure_optimizers`` defined).
            train_dataloaders: The training ``DataLoader``, or a ``DataModule`` (taken as ``datamodule``);
                None: the datamodule's or the module's ``train_dataloader()``.
            val_dataloaders: A validation ``DataLoader`` or a list of them; None: the datamodule's or the
                module's ``val_dataloader()`` if it has one, else no validation.
            datamodule: A ``DataModule`` whose ``prepare_data``/``setup`` run first and whose loaders are used;
                give it or loaders, not both.
            ckpt_path: Resume from this checkpoint: "last" (the newest under the checkpoint directory; an
                error when there is none) or a checkpoint directory; None: ``Trainer(resume=...)`` decides.
        """
        module = model
        train_dataloaders, datamodule = fit_datamodule(train_dataloaders, val_dataloaders, datamodule)
        self._attach(module, "fit")
        # before loaders and optimizers, in Lightning's order
        self._setup_hooks("fit", datamodule)
        train_loader, val_loaders = self._fit_loaders(module, train_dataloaders, val_dataloaders, datamodule)
        try:
            self._setup_fit(module, train_loader, val_loaders)
            self._start_run(ckpt_path)
            self._fire(Event.FIT_START)
            self._sanity_check()
            self._fire(Event.TRAIN_START)
            self._stops.warn_if_nothing_to_train(self.num_training_batches, self.should_stop)
            # last thing before the loop: keeps resumed random streams exact
            self._checkpoints.restore_pending_rng()
            # a stop signal: all ranks save one step and exit
            with self.stop_signals.catching(self.global_step):
                self._train()
                self._fire(Event.TRAIN_END)
                self._fire(Event.FIT_END)
                # fit returns once the last async save is committed
                self.accelerator.wait_for_checkpoint()
            self._fire(Event.TEARDOWN, "fit")
        except BaseException as exc:
            self._wait_for_checkpoint_quietly()
            self._fire(Event.EXCEPTION, exc)
            self._fire(Event.TEARDOWN, "fit")
            raise
        finally:
            self._end_fit()
        if self.stop_requested is not None:
            # TrainingStopped: exit code 128 + the signal number
            raise stopped(self.stop_signals, self.global_step, self.callbacks, self.is_global_zero, self.requeue)

    def _fit_loaders(self, module: TrainingModule, train: Any, val: Any, datamodule: Any) -> Tuple[Any, Any]:
        """The training loader and the validation loaders of a fit, checked."""
        if train is None:
            loaders = self._stage_loaders("fit", None, datamodule)
            if len(loaders) > 1:
                # refused rather than training on the first: the others would be dropped without a word
                owner = type(datamodule if datamodule is not None else module).__name__
                raise ConfigurationError(
                    f"{owner}.train_dataloader() returned {len(loaders)} loaders; the Trainer "
                    "trains on one: return a single DataLoader (e.g. over a "
                    "torch.utils.data.ConcatDataset of the datasets)"
                )
            train = loaders[0]
            if val is None:
                val = self._stage_loaders("validate", None, datamodule, required=False) or None
        check_loader(train, "train_dataloaders")
        # an empty one would validate on nothing, silently
        several = isinstance(val, (list, tuple))
        for i, dl in enumerate(as_list(val)):
            check_loader(dl, f"val_dataloaders[{i}]" if several else "val_dataloaders")
        return train, val

    def _setup_fit(self, module: TrainingModule, train_loader: Any, val_loaders: Any) -> None:
        acc = self.accelerator
        # Settings a backend may need at setup (DeepSpeed writes them into its generated config).
        acc.update_run_settings(
            gradient_clip_val=self.config.gradient_clip_val, gradient_clip_algorithm=self.config.gradient_clip_algorithm
        )
        # a layout chosen from the model decides the shards
        self.strategy.plan_layout(module, train_loader)
        self.train_dataloader = keep_on_host(acc.prepare_data_loader(train_loader), self._transfer)
        if self.compile:
            for child in module.children():
                child.compile()
        manual = not module.automatic_optimization
        if manual:
            self._manual.check_config()
        self._pipelined = self.strategy.pipelined
        if self._pipelined:
            _check_pipelined(self.compile, manual)
        self._prepare_model_and_optimizers(module, manual)
        self._hooks = step_overrides(module, self.strategy)
        if self._hooks.backward:
            # Lightning's backward hook replaces loss.backward() (reset at the end of fit)
            self.strategy.precision.module_backward = module.backward
        self._manual.bind(module, self.model, self._prepared_optimizers, self._training_step)
        self._loss.start(module)
        # none without validation_step
        val_loaders = validation_loaders(module, val_loaders, self._pipelined)
        self.val_dataloaders = [
            keep_on_host(acc.prepare_data_loader(dl), self._transfer) for dl in as_list(val_loaders)
        ]
        self.num_training_batches = _count_training_batches(self.train_dataloader, self.config)
        check_same_batch_count(self.strategy, self.num_training_batches)

    def _prepare_model_and_optimizers(self, module: TrainingModule, manual: bool) -> None:
        """Lightning's order, for every strategy: place and wrap first, then build the optimizers, so
        configure_optimizers sees the final device and parameters (fused AdamW on CUDA, FSDP's
        DTensors, bf16-true weights) and nothing has to be remapped."""
        configured = []

        def build_optimizers() -> list:
            # placed and sharded: Lightning's guides build optimizers from trainer.model
            self.model = module
            configured.append(parse_optimizers(module.configure_optimizers(), type(module).__name__, manual))
            return list(configured[0].optimizers)

        self.model, prepared = self.accelerator.prepare_model_with_optimizers(module, build_optimizers)
        self.optimizer, self._prepared_optimizers = prepared[0], prepared
        self.lr_scheduler_configs = configured[0].schedulers
        self._training_step = self.accelerator.step_function(self.model, "training_step")

    def _start_run(self, ckpt_path: Optional[str]) -> None:
        """This fit's run id (every rank the same), then resume from ``ckpt_path`` (or, with
        ``resume="auto"``, from the newest checkpoint if there is one): a resumed run keeps its run id."""
        path = ckpt_path if ckpt_path is not None else ("last" if self.resume == "auto" else None)
        for logger in self.loggers:  # each file logger's version_<N>: resuming "last", the newest (its checkpoints)
            logger.settle(str(self.default_root_dir), self.strategy.broadcast, continuing=path == "last")
        self.run_id = self._checkpoints.begin_run()
        if ckpt_path is None and self.resume == "auto" and self.requeue.restarted:
            # a job SLURM started again resumes its own run (trainer/cluster/slurm_requeue.py)
            path = self.requeue.own_checkpoint(
                self._checkpoints.root(), self.strategy.global_rank, self.strategy.broadcast
            )
        resumed = self._checkpoints.resume(path, ckpt_path is not None, self._checkpoint_parts())
        if resumed is not None:
            self.run_id = saved_run_id(resumed) or self.run_id

    def _end_fit(self) -> None:
        """Workers of a pass fit left mid-epoch stop now, not at garbage collection (5 s each there);
        the run directory is unlocked."""
        for loader in [self.train_dataloader, *self.val_dataloaders]:
            if isinstance(loader, PreparedDataLoader):
                loader.release_workers()
        self.strategy.precision.module_backward = None
        self._checkpoints.end_run()

    # ---- the training loop -----------------------------------------------------------------------
    @property
    def _fit_module(self) -> TrainingModule:
        """The module being fitted (attached by ``fit`` before the loop runs)."""
        module = self.module
        if module is None:
            raise ConfigurationError("no module is attached: the loop runs inside fit(module, ...)")
        return module

    def _train(self) -> None:
        """The epochs, until max_epochs, max_steps, trainer.should_stop or a stop signal."""
        cfg, p, module = self.config, self.progress, self._fit_module
        self._step_guard = find_step_guard(self, module.automatic_optimization, cfg.nonfinite_loss)
        # the module's own configure_gradient_clipping (the default only applies the Trainer's settings)
        self._custom_clipping = (
            type(module).configure_gradient_clipping is not TrainingModule.configure_gradient_clipping
        )
        # the user's per-submodule modes (a frozen part stays in eval)
        train_modes = module_modes(module)
        self._finish_resumed_epoch()
        while not self._stops.finished(self.should_stop) and (cfg.max_epochs is None or p.epoch < cfg.max_epochs):
            restore_modes(train_modes)
            first_batch, first_step = p.batch_idx, p.global_step
            self._train_epoch()
            self._check_epoch_trained(first_batch)
            # a complete epoch, or one that trainer.should_stop ends (Lightning ends it: epoch-end hooks, epoch
            # metrics and schedulers, current_epoch + 1); a max_steps or stop-signal cut ends fit at that batch
            if not (p.epoch_end_pending or self._stops.stopping_early(self.should_stop)):
                break
            self._end_epoch()
            self._stops.refuse_endless(first_step, module.automatic_optimization)
        # a non-finite loss after the last log point (accelerators)
        self._loss.raise_if_flagged()
        warn_skips(self.accelerator.precision.skipped_steps, p.skipped_nonfinite, self.is_global_zero)

    def _finish_resumed_epoch(self) -> None:
        """Resumed at an epoch's last batch: its end, if still to come, before the next epoch."""
        p = self.progress
        if p.batch_idx < self.num_training_batches and not p.epoch_end_pending:
            return
        if p.epoch_end_pending:
            # written at BATCH_END: the epoch's end is still to come; the optimizer stepped before the
            # save, not in this process
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                self._end_epoch()
        else:
            # written at EPOCH_END (or by an older version)
            p.epoch, p.batch_idx = p.epoch + 1, 0

    def _train_epoch(self) -> None:
        """One epoch's batches: each trained, validation when due, BATCH_END, and the stop checks."""
        p, loader = self.progress, self.train_dataloader
        loader.set_epoch(p.epoch)
        self._fire(Event.EPOCH_START)
        transfer = self._transfer
        for batch in loader:
            if transfer is not None:
                # the module's on_before_batch_transfer/transfer_batch_to_device/on_after_batch_transfer
                batch = transfer(batch, 0)
            self._train_batch(batch, p.batch_idx)
            if self._skip_epoch:
                # on_train_batch_start returned -1: this batch is not trained, the epoch ends (Lightning)
                self._skip_epoch, p.epoch_end_pending = False, 1
                # counted as fetched; a partial window's gradients are zeroed by the next window
                p.batch_idx += 1
                self.accelerator.step = 0
                break
            p.batch_idx += 1
            # the epoch's last batch: by count, or (a loader without length) when the data ended
            p.epoch_end_pending = int(p.batch_idx >= self.num_training_batches or self._data_ended)
            validated = validation_due(self.config, p, self.val_dataloaders, self.num_training_batches)
            if validated:
                self._validate()
            # all ranks stop at one step on a signal
            self.stop_signals.poll(self.strategy, p.global_step)
            self._fire(Event.BATCH_END, self._last_output, batch, p.batch_idx - 1)
            # free them before the next batch arrives
            self._logging.batch = self._last_output = batch = None
            if not validated and self._stopping_and_validates():
                # Lightning validates, then stops
                self._validate()
            if self._stops.finished(self.should_stop) or p.epoch_end_pending:
                break

    def _stopping_and_validates(self) -> bool:
        """``trainer.should_stop`` ends fit after this batch, in an epoch that validates."""
        return self._stops.stopping_early(self.should_stop) and validation_epoch(
            self.config, self.progress, self.val_dataloaders
        )

    def _check_epoch_trained(self, first_batch: int) -> None:
        """A stream that yields nothing is said (nothing saved); a whole epoch of None losses is warned of."""
        p = self.progress
        if p.batch_idx == first_batch == 0:
            raise ConfigurationError(
                f"train_dataloaders yielded no batch in epoch {p.epoch} on this process: "
                "nothing can be trained; give it data (an IterableDataset whose stream is "
                "empty, or a filter that drops everything?)"
            )
        self._loss.warn_none_epoch(p.batch_idx - first_batch)

    def _train_batch(self, batch: Any, batch_idx: int) -> None:
        acc, p = self.accelerator, self.progress
        # a failed asynchronous save is raised at the next step
        acc.check_checkpoint()
        self._logging.batch, self._logging.running = batch, "train"
        self._fire(Event.BATCH_START, batch, batch_idx)
        if self._skip_epoch:
            return
        # A loader without length flagged its last batch itself (it reads one ahead)
        self._data_ended = self.num_training_batches == float("inf") and acc.gradient_state.end_of_dataloader
        acc.gradient_state.end_of_dataloader = batch_idx + 1 >= self.num_training_batches or self._data_ended
        if not self._fit_module.automatic_optimization:
            self._last_output = self._manual.run_step(batch, batch_idx)
            return
        # Lightning zeroes the gradients before the backward of a window's first batch
        first = acc.step == 0
        with acc.accumulate(self.model):
            if acc.sync_gradients and self._hooks.optimizer_step:
                self._module_optimizer_step(batch, batch_idx, first)
            else:
                self._forward_backward(batch, batch_idx, first)
                if acc.sync_gradients:
                    self._optimizer_step()
        p.accumulation_step = acc.step

    def _forward_backward(self, batch: Any, batch_idx: int, first: bool) -> Any:
        """training_step and backward through the strategy (the one step path); the loss, detached."""
        if self._pipelined and first:
            # the schedule runs the backward inside
            self._zero_grad(batch_idx)
        self._closure_loss = None
        output = self.strategy.forward_backward(
            self.model,
            self._training_step,
            batch,
            batch_idx,
            backward=lambda out: self._backward(out, batch_idx, first),
        )
        if self._pipelined:
            self._after_pipeline_step(output, batch_idx)
            return output.detach()
        return self._closure_loss

    def _backward(self, output: Any, batch_idx: int, first: bool) -> None:
        """After the forward of an ordinary strategy: the loss in ``output``, zero_grad on a window's first
        batch, BEFORE_BACKWARD, backward (Lightning's order)."""
        loss = self._loss.loss_of(output, batch_idx)
        self._last_output = output
        if first:
            self._zero_grad(batch_idx)
        if loss is None:
            return
        self._closure_loss = loss.detach()
        guard = self._step_guard
        if guard is not None:
            # decided for every rank at the optimizer step
            guard.record(loss)
        if guard is not None or self._loss.check(loss, batch_idx):
            self._fire(Event.BEFORE_BACKWARD, loss)
            # a summed loss's count
            items = output.get(ITEMS_KEY) if isinstance(output, dict) else None
            self.accelerator.backward(loss, self.model, num_items=items)
            self._fire(Event.AFTER_BACKWARD)

    def _zero_grad(self, batch_idx: int) -> None:
        """BEFORE_ZERO_GRAD, then the module's ``optimizer_zero_grad`` (``optimizer.zero_grad()``)."""
        # the user's optimizer: the prepared one zeroes only on a sync step (Accelerate's rule)
        optimizer = self.optimizer.optimizer
        self._fire(Event.BEFORE_ZERO_GRAD, optimizer)
        self._fit_module.optimizer_zero_grad(self.current_epoch, batch_idx, optimizer)

    def _after_pipeline_step(self, loss: torch.Tensor, batch_idx: int) -> None:
        """Pipeline parallelism: the strategy's schedule ran forward, ``module.loss_fn`` and backward
        of every micro-batch (training_step is not called); the batch loss, the same on every rank,
        is logged as ``train/loss``. BEFORE_BACKWARD does not fire (the backward is inside the schedule)."""
        self._last_output = loss
        self._fit_module.log("train/loss", loss)
        if self._step_guard is not None:
            self._step_guard.record(loss)
        if self._step_guard is not None or self._loss.check(loss, batch_idx):
            self._fire(Event.AFTER_BACKWARD)
        else:
            for opt in self.optimizers:
                opt.zero_grad()

    def _module_optimizer_step(self, batch: Any, batch_idx: int, first: bool) -> None:
        """The module's own ``optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)`` (Lightning's):
        the closure runs the batch; ``optimizer.step`` the loop's step. A step counts when the hook returns."""
        closure = StepClosure(lambda: self._forward_backward(batch, batch_idx, first))
        stepped: List[bool] = []
        optimizer = ClosureOptimizer(self.optimizer, lambda: stepped.append(self._guarded_step()))
        self._fit_module.optimizer_step(self.current_epoch, batch_idx, optimizer, closure)
        if not closure.calls:
            raise ConfigurationError(
                f"{type(self._fit_module).__name__}.optimizer_step did not run optimizer_closure (batch {batch_idx}): "
                "training_step and backward run inside it; call optimizer.step(closure=optimizer_closure), or "
                "optimizer_closure() when you skip the step"
            )
        if stepped and not stepped[-1]:
            # the step guard skipped or rolled back: no step counts, as on the default path
            return
        self._count_step()

    def _optimizer_step(self) -> None:
        if self._guarded_step():
            self._count_step()

    def _guarded_step(self) -> bool:
        """The window's optimizer step, unless the step guard skips it or rolls back (then False)."""
        acc, optimizer = self.accelerator, self.optimizer.optimizer
        # summed losses: the window's count (if its last backward was skipped)
        acc.end_item_window(self.model)
        guard = self._step_guard
        decision = "step" if guard is None else guard.decide(self.strategy, self.global_step, self.is_global_zero)
        if guard is not None and decision != "step":
            # every rank together: no optimizer or scheduler step, the batches count
            optimizer.zero_grad()
            if decision == "rollback":
                # the newest checkpoint's weights; the data goes on
                self._checkpoints.roll_back(guard, self._checkpoint_parts())
            self._logging.emit(guard.metrics())
            return False
        if acc.precision.scaler is not None:
            acc.precision.unscale_(optimizer)
        self._fire(Event.BEFORE_OPTIMIZER_STEP, optimizer)
        self._clip_gradients(optimizer)
        # what the prepared optimizer does on a sync step
        self.strategy.optimizer_step(optimizer)
        return True

    def _count_step(self) -> None:
        """After an optimizer step: global_step + 1, the "step" schedulers, the step's metrics."""
        self.progress.global_step += 1
        step_schedulers(
            self.lr_scheduler_configs,
            "step",
            self.global_step,
            self.callback_metrics,
            self._fit_module.lr_scheduler_step,
        )
        if self.progress.global_step % self.config.log_every_n_steps == 0:
            self._loss.raise_if_flagged()
            self._logging.emit_step_metrics()

    def _clip_gradients(self, optimizer: Any) -> None:
        cfg = self.config
        if self._custom_clipping:
            # the module's configure_gradient_clipping decides (Lightning's hook)
            self._fit_module.configure_gradient_clipping(optimizer, cfg.gradient_clip_val, cfg.gradient_clip_algorithm)
            return
        if cfg.gradient_clip_val is None:
            return
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if cfg.gradient_clip_algorithm == "norm":
            self.strategy.clip_gradients(params, max_norm=cfg.gradient_clip_val)
        else:
            self.strategy.clip_gradients(params, clip_value=cfg.gradient_clip_val)

    def _end_epoch(self) -> None:
        p = self.progress
        if p.batch_idx < self.num_training_batches != float("inf"):
            # ended by should_stop: a checkpoint written at EPOCH_END resumes at the next epoch (Lightning)
            p.batch_idx = int(self.num_training_batches)
        # one LOG event with what on_train_epoch_end logs (Lightning's row)
        self._logging.emit(self._logging.stores["train"].pop_epoch_metrics(self.strategy), hold=True)
        step_schedulers(
            self.lr_scheduler_configs,
            "epoch",
            self.current_epoch + 1,
            self.callback_metrics,
            self._fit_module.lr_scheduler_step,
        )
        # a checkpoint written from here on already includes the epoch's end
        p.epoch_end_pending = 0
        self._logging.fire_epoch_end(Event.EPOCH_END)
        p.epoch, p.batch_idx = p.epoch + 1, 0

    def _validate(self) -> None:
        if self.accelerator.step == 0:
            # at a window boundary: Lightning's hook frees the gradients before validation
            self._fit_module.on_validation_model_zero_grad()
        self._evaluation.run(self._fit_module, self.model, self.val_dataloaders, "validation_step")

    def _sanity_check(self) -> None:
        """``num_sanity_val_steps`` validation batches before training, so a broken validation_step
        fails in seconds. Callbacks see ``trainer.stage == "sanity_check"`` (and ``sanity_checking``)."""
        n = self.num_sanity_val_steps
        if n == 0 or not self.val_dataloaders or self.config.limit_val_batches == 0:
            return
        self.stage = "sanity_check"
        # isolated, as Lightning does: the same seed trains the same with or without it
        state = rng_state()
        try:
            self._fire(Event.SANITY_CHECK_START)
            self._evaluation.run(
                self._fit_module, self.model, self.val_dataloaders, "validation_step", max_batches=n, sanity=True
            )
            self._fire(Event.SANITY_CHECK_END)
        finally:
            self.stage = "fit"
            set_rng_state(state)

    # ---- validate, test, predict -----------------------------------------------------------------
    def validate(
        self,
        model: Optional[TrainingModule] = None,
        dataloaders: Any = None,
        ckpt_path: Optional[str] = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> List[Dict[str, float]]:
        """Run ``validation_step`` over the loaders (Lightning's ``validate``).

        Args:
            model: The module to validate; None: the module of this Trainer's previous run, with the
                checkpoint ``ckpt_path`` names (None there: "best").
            dataloaders: A ``DataLoader``, a list of them, or a ``DataModule``; None: the datamodule's or the
                module's ``val_dataloader()``.
            ckpt_path: Load these weights first: "best" (the best ``ModelCheckpoint`` save), "last" or a
                checkpoint directory; None: the model's current weights.
            verbose: Print the table of metrics on rank 0 (default True).
            datamodule: A ``DataModule`` whose ``val_dataloader()`` is used; give it or ``dataloaders``.

        Returns:
            One dict of the metrics logged per loader.
        """
        return self._evaluate(model, dataloaders, "validate", "validation_step", datamodule, ckpt_path, verbose)

    def test(
        self,
        model: Optional[TrainingModule] = None,
        dataloaders: Any = None,
        ckpt_path: Optional[str] = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> List[Dict[str, float]]:
        """Run ``test_step`` over the loaders (Lightning's ``test``).

        Args:
            model: The module to test; None: the module of this Trainer's previous run, with the checkpoint
                ``ckpt_path`` names (None there: "best").
            dataloaders: A ``DataLoader``, a list of them, or a ``DataModule``; None: the datamodule's or the
                module's ``test_dataloader()``.
            ckpt_path: Load these weights first: "best", "last" or a checkpoint directory; None: the model's
                current weights.
            verbose: Print the table of metrics on rank 0 (default True).
            datamodule: A ``DataModule`` whose ``test_dataloader()`` is used; give it or ``dataloaders``.

        Returns:
            One dict of the metrics logged per loader.
        """
        return self._evaluate(model, dataloaders, "test", "test_step", datamodule, ckpt_path, verbose)

    def _evaluate(
        self, model: Any, dataloaders: Any, stage: str, step_name: str, datamodule: Any, ckpt_path: Any, verbose: bool
    ) -> List[Dict[str, float]]:
        module, dataloaders, datamodule, path = self._eval_inputs.resolve(
            stage, model, dataloaders, datamodule, ckpt_path, self.module, self.checkpoint_callback
        )
        self._attach(module, stage)
        self._setup_hooks(stage, datamodule)
        loaders = self._stage_loaders(stage, dataloaders, datamodule)
        for i, dl in enumerate(loaders):
            check_loader(dl, f"dataloaders[{i}]")
        try:
            self.model = self._evaluation.prepare_model(module, self.model, loaders)
            self._eval_inputs.load_weights(path, self.model)
            before = dict(self.callback_metrics)
            prepared = [keep_on_host(self.accelerator.prepare_data_loader(dl), self._transfer) for dl in loaders]
            self._evaluation.run(module, self.model, prepared, step_name)
            self._fire(Event.TEARDOWN, stage)
        except BaseException as exc:
            self._fire(Event.EXCEPTION, exc)
            self._fire(Event.TEARDOWN, stage)
            raise
        return self._results(before, len(loaders), stage, verbose)

    def _results(self, before: Dict[str, Any], loaders: int, stage: str, verbose: bool) -> List[Dict[str, float]]:
        """One dict per loader: what it logged (with several, names end in /dataloader_idx_N), and what the
        epoch-end hooks logged in each (Lightning)."""
        logged = {k: float(v) for k, v in self.callback_metrics.items() if before.get(k) is not v}
        loader_of = self._logging.loader_of
        results = [{k: v for k, v in logged.items() if loader_of.get(k, i) == i} for i in range(loaders)]
        if verbose and self.strategy.is_global_zero:
            print_results(results, stage)
        return results

    def predict(
        self,
        model: Optional[TrainingModule] = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        return_predictions: Optional[bool] = None,
        ckpt_path: Optional[str] = None,
    ) -> Optional[List[Any]]:
        """Run ``predict_step`` over the loaders (Lightning's ``predict``).

        Args:
            model: The module to predict with; None: the module of this Trainer's previous run, with the
                checkpoint ``ckpt_path`` names (None there: "best").
            dataloaders: A ``DataLoader``, a list of them, or a ``DataModule``; None: the datamodule's or the
                module's ``predict_dataloader()``.
            datamodule: A ``DataModule`` whose ``predict_dataloader()`` is used; give it or ``dataloaders``.
            return_predictions: False: keep no outputs and return None; True or None (the default): return them.
            ckpt_path: Load these weights first: "best", "last" or a checkpoint directory; None: the model's
                current weights.

        Returns:
            The ``predict_step`` outputs of every batch (one list per loader when there are several), or None.
        """
        if return_predictions not in (None, True, False):
            raise ConfigurationError(f"return_predictions={return_predictions!r} must be True, False or None")
        module, dataloaders, datamodule, path = self._eval_inputs.resolve(
            "predict", model, dataloaders, datamodule, ckpt_path, self.module, self.checkpoint_callback
        )
        self._attach(module, "predict")
        self._setup_hooks("predict", datamodule)
        loaders = self._stage_loaders("predict", dataloaders, datamodule)
        self.model = self._evaluation.prepare_model(module, self.model, loaders)
        self._eval_inputs.load_weights(path, self.model)
        outputs = self._evaluation.predict(module, self.model, loaders, return_predictions)
        self._fire(Event.TEARDOWN, "predict")
        if return_predictions is False:
            return None
        return outputs if len(loaders) > 1 else outputs[0]

    # ---- logging and manual optimization: what the TrainingModule calls --------------------------
    def log_value(self, name: str, value: Any, **options: Any) -> None:
        """What ``TrainingModule.log`` calls: record one value under the loop's logging rules (``options``:
        ``TrainingModule.log``'s on_step, on_epoch, prog_bar, sync_dist, batch_size, reduce_fx, ...)."""
        self._logging.log_value(name, value, **options)

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        """Send metrics to every tracker (the LOG event); call it on every rank."""
        self._logging.log_metrics(metrics, step)

    def manual_optimizers(self) -> list:
        """What ``TrainingModule.optimizers()`` hands out: each optimizer, stepping through the Trainer."""
        return self._manual.manual_optimizers()

    def manual_backward(self, loss: Any) -> None:
        """``TrainingModule.manual_backward``: backward through the strategy, with the backward events."""
        self._manual.manual_backward(loss)

    def clip_optimizer_gradients(self, optimizer: Any, clip_val: Any, algorithm: Any) -> None:
        """``TrainingModule.clip_gradients``: clipped with the strategy, as the automatic loop clips."""
        self._manual.clip_gradients(optimizer, clip_val, algorithm)

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, path: str, async_save: bool = False, trainable_only: Optional[bool] = None) -> Any:
        """Save everything needed to resume exactly, as one checkpoint directory (every rank calls it).

        Args:
            path: The checkpoint directory to write (a local path or an fsspec URL); written under a temporary
                name and renamed into place.
            async_save: True: return once the state is staged; the write and commit run in the background
                (``fit`` waits for it before returning; strategies/checkpoint/async_save.py). Default False.
            trainable_only: Leave the frozen parameters out; None (the default): for PEFT models
                (trainer/checkpoint/adapters.py).

        Returns:
            The checkpoint's path.
        """
        async_save = resolve_async_save(async_save, self.device)
        return self._checkpoints.save(path, self._checkpoint_parts(), self.module, async_save, trainable_only)

    def _checkpoint_parts(self) -> CheckpointParts:
        return CheckpointParts(
            "trainer",
            self.model,
            list(self._prepared_optimizers),
            [cfg["scheduler"] for cfg in self.lr_scheduler_configs],
            [self.train_dataloader],
            callbacks=list(self.callbacks),
            progress=self.progress,
            datamodule=self.datamodule,
            run_id=self.run_id,
        )

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

        # one save at a time (an async one may be in flight)
        self.accelerator.wait_for_checkpoint()
        return save_weights(self.strategy, self.model, path, max_shard_size, adapter_only)

    def init_module(self, empty_init: Optional[bool] = None) -> ContextManager[None]:
        """Lightning's: modules built inside take no memory when ``empty_init`` (None: when the strategy
        shards them, FSDP): their parameters wait on the meta device until setup materialises them, each
        rank only its shards, filled by ``trainforge.load_pretrained(model, path)`` (read slice by slice)
        or by each layer's ``reset_parameters()`` (strategies/materialize.py)."""
        return init_module_context(self.strategy, empty_init)

    # ---- helpers ---------------------------------------------------------------------------------
    def _attach(self, module: TrainingModule, stage: str) -> None:
        _check_module(module, stage)
        object.__setattr__(module, "_trainer", self)
        self.module, self.stage, self.should_stop = module, stage, False
        add_module_callbacks(self.callbacks, module)
        self._logging.module, self._logging.fitting = module, stage == "fit"
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
        module = self.module
        try:
            self._loaders.prepare_data(datamodule, module)
            if datamodule is not None:
                self._loaders.setup_datamodule(datamodule, stage)
            self._fire(Event.SETUP, stage)
            if module is not None:
                configure_model(module)
                self._transfer = batch_transfer(module, datamodule, self.strategy.root_device, self.strategy)
                self._evaluation.transfer = self._transfer
        except BaseException as exc:
            self._fire(Event.EXCEPTION, exc)
            self._fire(Event.TEARDOWN, stage)
            raise

    def _stage_loaders(self, stage: str, given: Any, datamodule: Any, required: bool = True) -> List[Any]:
        return self._loaders.loaders_for(stage, given, datamodule, self.module, self.stage == "fit", required)


def _check_resume_and_sanity(resume: Any, num_sanity_val_steps: Any) -> None:
    if resume not in (None, "auto"):
        raise ConfigurationError(
            f"resume={resume!r} is not one of: None, 'auto' (to resume from a given "
            "checkpoint, pass fit(..., ckpt_path=PATH))"
        )
    if not isinstance(num_sanity_val_steps, int) or isinstance(num_sanity_val_steps, bool) or num_sanity_val_steps < -1:
        raise ConfigurationError(
            f"num_sanity_val_steps={num_sanity_val_steps!r} must be an int: 0 (off), "
            "N batches (default 2) or -1 (the whole validation set)"
        )


def _check_module(module: Any, stage: str) -> None:
    """A ``TrainingModule`` whose ``__init__`` ran, with the step (and, to fit, the optimizers) the stage needs."""
    if not isinstance(module, TrainingModule):
        raise ConfigurationError(
            f"expected a TrainingModule, got {type(module).__name__}; subclass "
            "trainforge.TrainingModule and implement training_step and configure_optimizers"
        )
    if "hparams" not in vars(module):
        # nn.Module.__init__ instead of super().__init__()
        raise ConfigurationError(
            f"{type(module).__name__}.__init__ did not run TrainingModule.__init__ (it calls "
            "nn.Module.__init__(self) or another base directly): call super().__init__() "
            "first, or its hyperparameters and hooks are lost"
        )
    required = _REQUIRED_STEP.get(stage)
    if required and getattr(type(module), required) is getattr(TrainingModule, required):
        raise ConfigurationError(
            f"{type(module).__name__} does not implement {required}(self, batch, batch_idx),"
            f" which Trainer.{stage}() needs"
        )
    if stage == "fit" and type(module).configure_optimizers is TrainingModule.configure_optimizers:
        raise ConfigurationError(
            f"{type(module).__name__} does not implement configure_optimizers(self); "
            "return an optimizer such as torch.optim.AdamW(self.parameters(), lr=3e-4)"
        )


def _count_training_batches(loader: Any, config: LoopConfig) -> Any:
    """Training batches per epoch (``float("inf")`` for a loader without length), checked."""
    count = limited(loader_length(loader), config.limit_train_batches)
    if count == float("inf") and isinstance(config.val_check_interval, float) and config.val_check_interval != 1.0:
        raise ConfigurationError(
            f"val_check_interval={config.val_check_interval!r} is a fraction of the "
            "epoch, but train_dataloaders has no length (an IterableDataset without "
            "__len__): give a number of batches (int) or define __len__"
        )
    if count == 0:
        raise ConfigurationError(
            "train_dataloaders yields no batch on this process (limit_train_batches="
            f"{config.limit_train_batches!r}); give it data or raise the limit"
        )
    return count


def _check_pipelined(compile: bool, manual: bool) -> None:
    """What pipeline parallelism does not run (yet), refused before any work."""
    if compile:
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
