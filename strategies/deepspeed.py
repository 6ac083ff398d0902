"""DeepSpeed ZeRO (stages 1-3, CPU/NVMe offload) behind the Strategy interface.

``deepspeed.initialize`` wraps the user's module and the user's torch optimizer; the engine is
the model the loop calls. The DeepSpeed config is generated from the Trainer's settings
(``trainforge.strategies.deepspeed_config``), so no JSON is needed; a user config overrides it.

Who does what on a training step (and why nothing runs twice):

- loss scaling for accumulation: ``engine.backward`` divides by ``gradient_accumulation_steps``,
  which the generated config sets to the Trainer's value (``handles_accumulation = True`` tells
  the Accelerator not to divide again); fp16 loss scaling is DeepSpeed's (the Precision's grad
  scaler is switched off in ``setup``).
- accumulation boundary: ``no_backward_sync`` (entered by ``Accelerator.accumulate`` on every
  micro-batch) calls ``engine.set_gradient_accumulation_boundary``, so the engine reduces
  gradients and steps exactly where the Trainer's window ends (also at a short last window).
- optimizer step, clipping and zeroing: ``engine.step()`` (clipping with the config's
  ``gradient_clipping``); the prepared optimizer's ``zero_grad`` afterwards is a harmless no-op.
- LR schedulers stay OUTSIDE DeepSpeed: the engine is given none, so ``engine.step()`` steps none,
  and the Trainer steps the user's scheduler by its own interval/frequency rules as with DDP.
  ZeRO keeps the user optimizer's ``param_groups`` dicts, so the scheduler's LR reaches DeepSpeed.

Checkpoints: ``engine.save_checkpoint`` writes its shards to ``<checkpoint>/deepspeed/state/``
inside the CheckpointWriter's tmp_dir. DeepSpeed 0.19.8 reads them with
``torch.load(weights_only=False)`` (its ``TorchCheckpointEngine.load``), which can execute code
from a crafted file; this strategy replaces that engine's ``load`` with a
``weights_only=True`` load that allows only the few DeepSpeed classes its checkpoints contain, and
checks the files against the manifest first. Consolidated weights (``module_state_dict``) are the
fp32 master weights gathered with DeepSpeed's public ``safe_get_full_fp32_param``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from datetime import timedelta
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple, Union, cast

import torch
from torch import nn

from trainforge.strategies.base import Optimizers, Strategy, build_optimizers
from trainforge.strategies.checkpoint.io import refused_load
from trainforge.strategies.ddp import ProcessGroupMixin, check_timeout
from trainforge.strategies.deepspeed_config import (
    OFFLOAD_DEVICES,
    TrainingSettings,
    ZeroSettings,
    explicit_settings,
    generate_config,
    load_user_config,
    merge_config,
)
from trainforge.strategies.deepspeed_state import (  # noqa: F401  (re-exported)
    CHECKPOINT_DIR,
    TAG,
    DeepSpeedState,
    local_state_bytes,
)
from trainforge.strategies.errors import ConfigurationError, invalid_choice
from trainforge.strategies.materialize import materialize_whole

log = logging.getLogger("trainforge")

STAGES = (0, 1, 2, 3, "auto")


def import_deepspeed(device: torch.device) -> Any:
    """Import deepspeed for training on ``device``.

    - CPU: ``DS_ACCELERATOR=cpu`` unless set (decided here, before the first import, because
      DeepSpeed picks its accelerator once per process and would otherwise probe for others),
      and DeepSpeed's shared-memory CPU collective op is marked unavailable: it serves only
      inference all-reduce, is compiled with g++ at first use (minutes), and a killed compile
      leaves a lock that hangs every later run. Training collectives go through torch (gloo).
    - ``mlflow`` is hidden during the import: DeepSpeed's autotuner imports it only to log
      autotuning runs (never used here), which costs ~7 s per process. A later ``import mlflow``
      works normally.
    """
    if device.type == "cpu" and "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigurationError(
            f"strategy='deepspeed' needs the deepspeed package ({e}); pip install 'trainforge[deepspeed]'"
        ) from e
    finally:
        if hide:
            sys.modules.pop("mlflow", None)
    from deepspeed.accelerator import get_accelerator

    kind = get_accelerator().device_name()
    if kind != device.type:
        raise ConfigurationError(
            f"DeepSpeed's accelerator is {kind!r} but this process trains on {device}; set "
            f"DS_ACCELERATOR={device.type} before deepspeed is first imported"
        )
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if device.type == "cpu" and isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    return deepspeed


def _safe_globals() -> List[Any]:
    """The DeepSpeed classes its ZeRO checkpoints pickle (found with
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on stage 1/2/3, fp32 and bf16)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def weights_only_load(path: str, map_location: Any = None) -> Any:
    """What DeepSpeed's checkpoint engine ``load`` does, with ``weights_only=True``."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise refused_load(
            path,
            e,
            "a DeepSpeed checkpoint written by trainforge holds only tensors, plain data and DeepSpeed's "
            "loss-scaler/enum classes",
        ) from None


def _check_activation_mode(spec: Any, stage: Any) -> None:
    """The "op" mode under ZeRO-3 would give wrong gradients: ZeRO-3 replaces ``F.linear`` by its own
    function, which adds the bias in place to the matmul output that "op" keeps for backward
    (``activation_memory`` refuses that at the first forward; this says it before training)."""
    if spec.mode == "op" and stage == 3:
        raise ConfigurationError(
            f"activation_checkpointing={spec.given!r} cannot be used with DeepSpeed ZeRO stage 3: its linear "
            "layers add the bias in place to the matmul outputs that op-level checkpointing keeps, which "
            "would make the gradients wrong. Use 'full' or 'selective:<n>' with stage 3, or 'op' with "
            "stage 1 or 2"
        )


@dataclasses.dataclass(frozen=True)
class ConfigOptimizer:
    """Given to ``DeepSpeedStrategy.setup`` in place of the optimizers: DeepSpeed builds the optimizer of the
    config's ``optimizer`` section (and the scheduler of its ``scheduler`` section, or ``lr_scheduler(optimizer)``)
    over ``params``, as Accelerate's ``DummyOptim``/``DummyScheduler`` ask. ``auto``: values for the sections'
    ``"auto"`` entries, by dotted path (``{"optimizer.params.lr": 1e-3}``); only those entries are filled."""

    params: Any
    auto: Dict[str, Any] = dataclasses.field(default_factory=dict)
    lr_scheduler: Optional[Any] = None


class DeepSpeedStrategy(DeepSpeedState, ProcessGroupMixin, Strategy):
    """ZeRO data parallelism through DeepSpeed: optimizer state (stage 1), gradients (2) and parameters (3)
    sharded over the ranks, optionally offloaded to host memory or NVMe. The first arguments are
    Lightning's, in its order.

    Args:
        stage: the ZeRO stage, 0-3, or ``"auto"`` (chosen at setup from the memory estimate of the model
            on these devices, see ``trainforge.strategies.memory_estimate``; the reasoning is logged).
            Default 2.
        offload_optimizer: keep the optimizer state in ``offload_device`` memory and step there (default
            False).
        offload_parameters: keep the parameters in ``offload_device`` memory; stage 3 only (default False).
        offload_device: where offloaded state goes: ``"cpu"`` (default) or ``"nvme"`` (under ``nvme_path``).
        nvme_path: the directory of NVMe offload (default ``"/local_nvme"``).
        activation_checkpointing: trade compute for activation memory, the same values for every strategy
            (``strategies/activation_memory.py``): None, False or ``"none"`` (default: off), ``"full"`` or True
            (every repeated block recomputed in backward), ``"selective:<n>"`` (every n-th block), ``"op"``
            (matmul and attention outputs kept, the rest recomputed), ``"offload"`` (saved activations moved to
            host memory), a dict ``{"mode": ..., "every": n, "blocks": ...}``, or a set of module classes /
            class names or a callable ``(module, name) -> bool`` ("full" on those modules). Applied with torch's checkpoint before ``deepspeed.initialize``. Default False: off.
        config: a DeepSpeed config, as a dict or the path of a JSON file, whose keys override the generated
            ones (default None: the generated config only). A bad path or bad JSON fails at construction.
        logging_level: the level of DeepSpeed's own logger (default ``logging.WARN``).
        zero_stage: ``trainforge config``'s spelling of ``stage`` (default None: ``stage`` applies).
        offload_optimizer_device: ``trainforge config``'s spelling of the optimizer offload: ``"none"``,
            ``"cpu"`` or ``"nvme"`` (default None: from ``offload_optimizer`` and ``offload_device``).
        offload_param_device: ``trainforge config``'s spelling of the parameter offload: ``"none"``,
            ``"cpu"`` or ``"nvme"`` (default None: from ``offload_parameters`` and ``offload_device``).
        device: this process's device (a ``torch.device`` or a string such as ``"cuda:1"``). Default None: the
            device of the process's local rank for the accelerator asked for (the CPU, or ``cuda:<local_rank>``).
        process_group_backend: the ``torch.distributed`` backend of the process group this strategy starts
            (default None: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU, else the backend registered for the device
            type). Not used when a process group already exists.
        timeout: how long a collective may wait for the other ranks before it fails, a ``datetime.timedelta``
            (default 30 minutes), passed to ``init_process_group``.
    """

    name = "deepspeed"
    redirect_forward = True  # the engine's forward runs ZeRO-3's parameter gathering hooks
    handles_accumulation = True  # engine.backward divides by gradient_accumulation_steps
    loss_scaling_in_backend = True  # the config's fp16 section scales the loss
    own_backward = True  # engine.backward: a module's backward hook cannot replace it

    def __init__(
        self,
        stage: Union[int, str] = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_device: str = "cpu",
        nvme_path: str = "/local_nvme",
        activation_checkpointing: Any = False,
        config: Union[None, str, os.PathLike, Dict[str, Any]] = None,
        logging_level: int = logging.WARN,
        *,
        zero_stage: Optional[int] = None,
        offload_optimizer_device: Optional[str] = None,
        offload_param_device: Optional[str] = None,
        device: Optional[Union[torch.device, str]] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        super().__init__(device, activation_checkpointing)
        stage = zero_stage if zero_stage is not None else stage
        if stage not in STAGES or isinstance(stage, bool):
            raise invalid_choice("stage", stage, STAGES)
        if offload_device not in OFFLOAD_DEVICES:
            raise invalid_choice("offload_device", offload_device, OFFLOAD_DEVICES)
        opt_dev = _offload_choice(
            "offload_optimizer_device", offload_optimizer_device, offload_device if offload_optimizer else None
        )
        param_dev = _offload_choice(
            "offload_param_device", offload_param_device, offload_device if offload_parameters else None
        )
        if param_dev is not None and stage not in (3, "auto"):
            raise ConfigurationError(
                f"offload_parameters needs stage=3 (only ZeRO-3 partitions parameters), got "
                f"stage={stage!r}; pass stage=3 or drop the parameter offload"
            )
        _check_activation_mode(self.activation_memory, stage)
        self.stage = stage
        self.zero = ZeroSettings(
            stage=int(stage) if stage != "auto" else 2,
            offload_optimizer_device=opt_dev,
            offload_param_device=param_dev,
            nvme_path=str(nvme_path),
        )
        given = [
            name
            for name, on in (
                ("stage", stage not in (2, "auto")),
                ("offload_optimizer_device", opt_dev),
                ("offload_param_device", param_dev),
            )
            if on
        ]
        self._zero_given = tuple(given)
        self.user_config = load_user_config(config)  # bad paths/JSON fail here, before any work
        self.logging_level = logging_level
        self.backend, self.timeout = process_group_backend, check_timeout(timeout, "DeepSpeedStrategy")
        self.config: Optional[Dict[str, Any]] = None  # the merged config handed to deepspeed.initialize
        self.auto_report: Optional[str] = None  # stage="auto": the reasoning table
        self._engines: List[Any] = []
        self._by_optimizer: Dict[int, Any] = {}
        self._ds: Any = None

    # ---- lifecycle ------------------------------------------------------------------------
    def setup_environment(self, accelerator: str = "auto") -> None:
        self.accelerator = accelerator
        self._device = self._start_process_group(self.backend, self.timeout)
        self._ds = import_deepspeed(self._device)
        self._ds.utils.logger.setLevel(self.logging_level)

    def setup(self, module: nn.Module, optimizers: Optimizers) -> Tuple[nn.Module, List[Any]]:
        if self._ds is None:
            self.setup_environment()
        materialize_whole(module, torch.device("cpu"), "deepspeed")  # zero.Init is not used (yet)
        if callable(optimizers):
            # deepspeed.initialize takes the optimizer with the module, so it is built here, on the
            # device DeepSpeed will train on (fused AdamW on CUDA). Not when parameters are offloaded
            # or the stage is chosen from memory: the module then stays where DeepSpeed expects it.
            if not self._params_may_stay_on_host():
                module = module.to(self.root_device)
            optimizers = build_optimizers(optimizers)
        if len(optimizers) > 1:
            raise ConfigurationError(
                f"DeepSpeed wraps one optimizer per model, got {len(optimizers)}; put the "
                "parameters in param groups of one optimizer"
            )
        from_config = optimizers[0] if optimizers and isinstance(optimizers[0], ConfigOptimizer) else None
        optimizer = optimizers[0] if optimizers and from_config is None else None
        if self.settings.gradient_clip_val is not None and self.settings.gradient_clip_algorithm != "norm":
            raise ConfigurationError(
                "gradient_clip_algorithm='value' is not available with strategy='deepspeed' "
                "(DeepSpeed clips by global norm inside engine.step()); use "
                "gradient_clip_algorithm='norm'"
            )
        self.config = self.build_config(module, optimizer, from_config)
        _check_activation_mode(self.activation_memory, self.config.get("zero_optimization", {}).get("stage"))
        # DeepSpeed keeps the parameters in half precision and its engine turns autocast off for the
        # accelerator inside forward, so floating inputs are cast as Lightning does (input_dtype, read
        # by the prepared loaders); its fp16 section does the (dynamic) loss scaling.
        self.input_dtype = (
            torch.bfloat16
            if self.config.get("bf16", {}).get("enabled")
            else torch.float16
            if self.config.get("fp16", {}).get("enabled")
            else None
        )
        self._check_nvme()
        self.wrap_activation_blocks(module)
        built = {} if from_config is None else {"model_parameters": from_config.params}
        if from_config is not None and from_config.lr_scheduler is not None:
            built["lr_scheduler"] = from_config.lr_scheduler
        engine, ds_optimizer, _, _ = self._ds.initialize(
            model=module, optimizer=optimizer, config=self.config, dist_init_required=False, **built
        )
        engine.checkpoint_engine.load = weights_only_load  # shadows DeepSpeed's weights_only=False load
        self._engines.append(engine)
        if optimizer is None and from_config is None:
            return engine, []
        self._by_optimizer[id(ds_optimizer)] = engine
        return engine, [ds_optimizer]

    def _params_may_stay_on_host(self) -> bool:
        """Parameter offload (ours or the user's config) or a stage still to be chosen from memory."""
        user_offload = (self.user_config or {}).get("zero_optimization", {}).get("offload_param", {}) or {}
        return (
            self.stage == "auto"
            or self.zero.offload_param_device is not None
            or user_offload.get("device", "none") not in (None, "none")
        )

    def build_config(
        self,
        module: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        from_config: Optional[ConfigOptimizer] = None,
    ) -> Dict[str, Any]:
        """The DeepSpeed config for this run: generated from the Trainer's settings (set on this
        strategy by the Accelerator/Trainer before ``setup``), merged with the user's config (whose
        ``optimizer``/``scheduler`` sections are taken only with a ``from_config`` optimizer)."""
        run = self.settings
        settings = TrainingSettings(
            micro_batch_size=run.micro_batch_size,
            accumulation_steps=run.accumulation_steps,
            world_size=self.world_size,
            gradient_clip_val=run.gradient_clip_val,
            precision=run.precision.name,
        )
        zero = self.zero
        user_stage = (self.user_config or {}).get("zero_optimization", {}).get("stage", "auto")
        if self.stage == "auto" and user_stage == "auto":
            zero = self._choose_auto(module, optimizer, settings.precision)
        hidden = getattr(getattr(module, "config", None), "hidden_size", None)
        from trainforge.strategies.memory_estimate import count_parameters

        return merge_config(
            generate_config(settings, zero, count_parameters(module)),
            self.user_config,
            explicit_settings(settings, zero, self._zero_given),
            hidden_size=hidden if isinstance(hidden, int) else None,
            optimizer_auto=None if from_config is None else from_config.auto,
        )

    def _choose_auto(self, module: nn.Module, optimizer: Any, precision: str) -> ZeroSettings:
        from trainforge.strategies.memory_estimate import (
            available_memory,
            choose_deepspeed,
            count_parameters,
            optimizer_kind,
        )

        ranks_per_node = self.cluster.local_world_size if self.cluster is not None else 1
        free = available_memory(self.root_device, ranks_per_node)
        # every rank must choose the same stage: decide on the smallest memory any rank sees
        device_mem, host_mem = (int(v) for v in self.all_reduce(torch.tensor(free, device=self.root_device), "min"))
        row, self.auto_report = choose_deepspeed(
            count_parameters(module),
            self.world_size,
            precision,
            optimizer_kind(optimizer),
            device_mem,
            host_mem if self.root_device.type != "cpu" else None,
            ranks_per_node,
        )
        if self.is_global_zero:
            log.info("trainforge: DeepSpeedStrategy(stage='auto') on %s\n%s", self.root_device.type, self.auto_report)
        opts = row.options
        return ZeroSettings(
            stage=opts["stage"],
            nvme_path=self.zero.nvme_path,
            offload_optimizer_device=self.zero.offload_optimizer_device
            or ("cpu" if opts.get("offload_optimizer") else None),
            offload_param_device=self.zero.offload_param_device or ("cpu" if opts.get("offload_parameters") else None),
        )

    def _check_nvme(self) -> None:
        zero = self.config.get("zero_optimization", {}) if self.config else {}
        if "nvme" in (zero.get("offload_optimizer", {}).get("device"), zero.get("offload_param", {}).get("device")):
            compatible = getattr(self._ds.ops, "__compatible_ops__", {})
            if not compatible.get("async_io", False):
                raise ConfigurationError(
                    "offload_device='nvme' needs DeepSpeed's async_io op, which this deepspeed "
                    "install cannot build (libaio missing); install libaio-dev and reinstall "
                    "deepspeed, or use offload_device='cpu'"
                )

    def unwrap(self, module: nn.Module) -> nn.Module:
        return cast(nn.Module, module.module) if self._is_engine(module) else module

    def teardown(self) -> None:
        for engine in self._engines:
            if hasattr(engine, "destroy"):
                engine.destroy()
        self._engines.clear()
        self._by_optimizer.clear()
        self._stop_process_group()

    # ---- the step -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: Optional[nn.Module]) -> None:
        self._engine_of(module).backward(loss)

    def optimizer_step(self, optimizer: Any) -> Any:
        engine = self._by_optimizer.get(id(optimizer))
        if engine is None:
            raise ConfigurationError(
                "optimizer_step got an optimizer that DeepSpeedStrategy.setup did not return; "
                "step the optimizer that prepare()/setup() gave back"
            )
        engine.step()  # clips, steps, zeroes gradients (and steps no scheduler: it owns none)
        return None

    @contextlib.contextmanager
    def _boundary(self, engine: Any, is_boundary: bool) -> Iterator[None]:
        engine.set_gradient_accumulation_boundary(is_boundary)
        yield  # left set: a user's optimizer.step() may come right after the block

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        if not self._is_engine(module):
            return contextlib.nullcontext()
        return self._boundary(module, not enabled)

    def clip_gradients(
        self,
        parameters: Any,
        *,
        max_norm: Optional[float] = None,
        clip_value: Optional[float] = None,
        norm_type: float = 2.0,
    ) -> Optional[torch.Tensor]:
        """DeepSpeed clips inside ``engine.step()`` with the config's ``gradient_clipping``; this only
        checks that the request matches it and returns None (the norm exists only after the step:
        ``engine.get_global_grad_norm()``)."""
        configured = float((self.config or {}).get("gradient_clipping", 0.0) or 0.0)
        if clip_value is not None:
            raise ConfigurationError(
                f"clip_value={clip_value!r}: DeepSpeed clips by global norm only; clip by norm "
                "(gradient_clip_algorithm='norm')"
            )
        if max_norm is not None and (float(norm_type) != 2.0 or float(max_norm) != configured):
            raise ConfigurationError(
                f"clip_gradients(max_norm={max_norm!r}, norm_type={norm_type!r}) but DeepSpeed clips the 2-norm at "
                f"gradient_clipping={configured!r} from its config; set the Trainer's gradient_clip_val={max_norm!r} "
                "(written into the generated config) or gradient_clipping in your DeepSpeed config"
            )
        return None

    # ---- helpers --------------------------------------------------------------------------
    def _is_engine(self, module: Any) -> bool:
        return any(module is engine for engine in self._engines)

    def _engine_of(self, module: Optional[nn.Module]) -> Any:
        if module is not None and self._is_engine(module):
            return module
        for engine in self._engines:
            if module is None or engine.module is module:
                return engine
        raise ConfigurationError(
            f"{type(module).__name__} was not set up by DeepSpeedStrategy; pass the model that "
            "prepare()/setup() returned"
        )

    def __repr__(self) -> str:
        return (
            f"DeepSpeedStrategy(stage={self.stage!r}, offload_optimizer={self.zero.offload_optimizer_device!r}, "
            f"offload_param={self.zero.offload_param_device!r}, world_size={self.world_size})"
        )


def _offload_choice(name: str, value: Optional[str], fallback: Optional[str]) -> Optional[str]:
    if value is None:
        return fallback
    if value not in ("none",) + OFFLOAD_DEVICES:
        raise invalid_choice(name, value, ("none",) + OFFLOAD_DEVICES)
    return None if value == "none" else value
