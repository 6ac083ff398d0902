"""Megatron-style tensor and pipeline parallelism composed with FSDP2 on one ``DeviceMesh`` over
(pp, dp, tp) (``strategy="megatron"``).

``setup`` applies the steps of ``strategies/parallel`` in their fixed order: precision conversion
-> pipeline split (``pipeline_parallel_size > 1``, ``parallel/pp.py``) -> ``apply_tp`` on the ``tp``
mesh dimension -> activation checkpointing -> ``fully_shard`` (or ``replicate``, ddp) of each
repeated block, then the root (under pipelining: each stage), on the ``dp`` dimension (skipped when
dp=1). Parameters end up as
``DTensor``s: ``Shard`` on tp for the planned layers, ``Shard(0)`` on dp for all (FSDP2 x TP).

Pipeline parallelism (``pipeline_parallel_size=2, schedule="1f1b", num_microbatches=4``): the
model's block list is cut into stages (balanced by parameter count, or at ``pp_split``), each rank
keeps only its stages' modules under their original names, and ``forward_backward`` runs the
``torch.distributed.pipelining`` schedule on each training batch (``gpipe``, ``1f1b``; the looped
``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zb`` run two stages per rank unless ``pp_split``
says otherwise; the V-shaped ``zbv``, ``dualpipev`` run stages r and 2 pp - 1 - r on rank r).
Contract for the TrainingModule: it holds the model in an attribute whose forward is a chain of
its children (embedding, blocks, norm, head), defines ``loss_fn(output, target)`` (the
loss of one micro-batch, a mean; a transformers ``*ForCausalLM`` in the attribute works too, its
head on the last stage: ``parallel/pp.py``), and its batches are ``(inputs, target)`` (or it defines
``pipeline_batch(batch) -> (inputs, target)``). Under the Trainer, ``training_step`` is not called:
the schedule computes ``loss_fn`` on the last stage; the batch loss (mean over micro-batches),
broadcast from the last stage, is returned and logged as ``train/loss``. Gradients equal the
unpipelined ones (``scale_grads`` over micro-batches, FSDP's mean over dp); tied parameters
(input/output embeddings) live on the first and last stage with their gradients summed over those
ranks (refused for V-shaped schedules, which put both on rank 0); gradient-norm clipping combines
the stages' norms (tied copies counted once). The loader's
batch is split into ``num_microbatches`` (default: the number of stages) equal micro-batches, which
are the gradient accumulation: ``accumulate_grad_batches`` must be 1; every batch must have the
first one's size (the stages keep its shapes: ``drop_last=True``). Validation and test run
``loss_fn`` through the stages forward only (``evaluate_batch``, ``schedule.eval``), logged as
``val/loss``/``test/loss``. With the Accelerator, ``accelerator.forward_backward(model, batch,
loss_fn)`` runs the schedule; the prepared model may itself own the block list, and optimizers built
before ``prepare`` keep this rank's parameters. Refused with a clear error under pipelining: predict,
manual optimization, ``backward(loss)``, ``compile=True`` and fp16 (``16-mixed``).

Data: each dp rank reads its shard of the loader; the tp and pp ranks of one dp group read the same batch.
Checkpoints: ``dcp/`` (torch.distributed.checkpoint) in trainforge's checkpoint directory, the same
layout as ``FSDPStrategy``'s sharded one, keyed by the original model's names, so it loads on
another (tp, dp, pp) layout, under FSDP, and through ``trainforge merge-weights`` on one process
(the optimizer state is saved flat, keyed per parameter name, so it resumes on any (pp, dp, tp)
layout; FSDPStrategy's nested checkpoints load without pipelining, and ours load under FSDPStrategy).

Layout chosen for the user (``tensor_parallel_size="auto"`` and/or ``pipeline_parallel_size="auto"``,
``parallel/auto.py``): the process group starts in ``setup_environment``, the mesh is built once the
model is known (``plan_layout(module, train_loader)``, called by the Trainer before it shards the
loader and by ``Accelerator.prepare`` before its loaders; else by ``setup``): the fastest layout of
``layout.estimate_layouts`` that fits ``device_memory`` (default: the CUDA device's, or host RAM per
local process), sizes given as ints kept. Sequence length and batch size come from the training
loader (``seq_len=`` otherwise); the table it chose from is logged on rank 0. A loader prepared
alone before the model is refused (its dp shard depends on the layout).

``sequence_parallel=True`` / ``loss_parallel=True`` (tp > 1, pp = 1; ``parallel/sp.py``) rewrite the
plan: the residual stream between TP regions is sharded on the sequence dimension (norms run as
``SequenceParallel``), and the head's logits stay sharded on the vocabulary, the cross-entropy
computed under torch's ``loss_parallel()`` (entered around the root module's forward and in
``backward``; the module's loss must be ``F.cross_entropy`` on the reshaped logits: see sp.py).

``data_parallel="ddp"`` replicates instead of sharding on dp (``parallel/dp.py``: FSDP2's
``replicate``, per block then root/stage; gradients all-reduced, checkpoints the same ``dcp/``).

Not built yet (clear errors): sequence/loss parallel with pipeline parallelism.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from trainforge.strategies.activation_memory import check_offload_layout
from trainforge.strategies.base import Optimizers, Strategy, build_optimizers
from trainforge.strategies.checkpoint.dcp import DCP_DIR, has_sharded, load_sharded, save_sharded
from trainforge.strategies.ddp import ProcessGroupMixin
from trainforge.strategies.errors import CheckpointError, ConfigurationError, invalid_choice
from trainforge.strategies.fsdp_wrap import no_gradient_sync, remap_optimizers, select_modules
from trainforge.strategies.materialize import has_meta, materialize, materialize_whole
from trainforge.strategies.megatron_pipeline import PARALLELIZED, PipelineSetup
from trainforge.strategies.parallel import ParallelDims, apply_tp
from trainforge.strategies.parallel.auto import check_auto_options, choose_auto_layout, loader_shape
from trainforge.strategies.parallel.dims import check_positive
from trainforge.strategies.parallel.dp import DATA_PARALLEL, apply_data_parallel
from trainforge.strategies.parallel.pp import (
    SCHEDULES,
    num_stages_for,
    schedule_class,
)
from trainforge.strategies.parallel.pp_schedule import PipelineRunner
from trainforge.strategies.parallel.sp import install_loss_parallel, loss_parallel_context

log = logging.getLogger("trainforge")


class MegatronStrategy(PipelineSetup, ProcessGroupMixin, Strategy):
    """Megatron-style tensor and pipeline parallelism composed with FSDP2 (or replication) on one
    ``DeviceMesh`` over (pp, dp, tp), e.g. ``MegatronStrategy(tensor_parallel_size=2, pipeline_parallel_size=2)``.
    The module's docstring (``strategies/megatron.py``) gives the pipeline contract for the TrainingModule.

    Args:
        device: this process's device (a ``torch.device`` or a string such as ``"cuda:1"``). Default None: the
            device of the process's local rank for the accelerator asked for (the CPU, or ``cuda:<local_rank>``).
        tensor_parallel_size: processes one layer's weights are split over (Megatron's column/row scheme),
            or ``"auto"`` (chosen with the layout, see below). Default 1: no tensor parallelism.
        pipeline_parallel_size: pipeline stages the model's blocks are cut into, or ``"auto"``. Default 1: no
            pipeline.
        data_parallel_size: data-parallel replicas; default ``"auto"``: the processes tp x pp leave.
        data_parallel: how the dp dimension holds the model: ``"fsdp"`` (default: FSDP2, sharded) or
            ``"ddp"`` (replicated, gradients all-reduced).
        num_microbatches: micro-batches each loader batch is split into under pipelining (they are the
            gradient accumulation); default None: the number of stages. Needs pipeline_parallel_size > 1.
        schedule: the pipeline schedule (pp > 1): ``"1f1b"`` (default), ``"gpipe"``, the looped
            ``"interleaved_1f1b"``, ``"looped_bfs"``, ``"interleaved_zb"``, or the V-shaped ``"zbv"``,
            ``"dualpipev"``.
        sequence_parallel: shard the residual stream between tensor-parallel regions on the sequence
            dimension (default False; needs tp > 1 and pp = 1).
        loss_parallel: keep the head's logits sharded on the vocabulary and compute the cross-entropy
            under torch's ``loss_parallel()`` (default False; needs tp > 1 and pp = 1).
        tp_plan: which layers tensor parallelism splits, and how. Default ``"auto"`` (or None): the plan a
            transformers model ships; or ``{module glob: style}``, e.g. ``{"blocks.*.mlp.0": "colwise"}``
            (``strategies/parallel/tp.py`` lists the styles).
        pp_split: the first block of each stage after the first, e.g. ``["net.blocks.4"]``. Default None:
            stages balanced by parameter count. Needs an int pipeline_parallel_size > 1.
        activation_checkpointing: trade compute for activation memory, the same values for every strategy
            (``strategies/activation_memory.py``): None, False or ``"none"`` (default: off), ``"full"`` or True
            (every repeated block recomputed in backward), ``"selective:<n>"`` (every n-th block), ``"op"``
            (matmul and attention outputs kept, the rest recomputed), ``"offload"`` (saved activations moved to
            host memory), a dict ``{"mode": ..., "every": n, "blocks": ...}``, or a set of module classes /
            class names or a callable ``(module, name) -> bool`` ("full" on those modules). On the repeated blocks by default. Default False: off.
        seq_len: the sequence length the "auto" layout plans for (default None: read from the training
            loader's batches).
        device_memory: the bytes per device the "auto" layout must fit in (default None: the CUDA
            device's memory, or host memory per local process).
        model_shape: ``{"layers": ..., "hidden": ..., "heads": ...}`` for the "auto" layout of a model
            without a transformers config (default None: read from the model's config).
        process_group_backend: the ``torch.distributed`` backend of the process group this strategy starts
            (default None: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU, else the backend registered for the device
            type). Not used when a process group already exists.
        timeout: how long a collective may wait for the other ranks before it fails, a ``datetime.timedelta``
            (default 30 minutes), passed to ``init_process_group``.
    """

    name = "megatron"
    redirect_forward = True  # training_step through the root's forward, so FSDP's root hooks run

    def __init__(  # noqa: C901 - one validation branch per constructor argument
        self,
        device: Optional[Union[torch.device, str]] = None,
        *,
        tensor_parallel_size: Any = 1,
        pipeline_parallel_size: Any = 1,
        data_parallel_size: Any = "auto",
        data_parallel: str = "fsdp",
        num_microbatches: Optional[int] = None,
        schedule: str = "1f1b",
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        tp_plan: Any = "auto",
        pp_split: Optional[List[str]] = None,
        activation_checkpointing: Any = False,
        seq_len: Optional[int] = None,
        device_memory: Optional[int] = None,
        model_shape: Optional[Dict[str, int]] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        super().__init__(device, activation_checkpointing)
        if tensor_parallel_size != "auto":  # else checked once the layout is chosen (_build)
            check_offload_layout(self.activation_memory, tensor_parallel_size)
        if data_parallel not in DATA_PARALLEL:
            raise invalid_choice(
                "data_parallel",
                data_parallel,
                DATA_PARALLEL,
                "over the dp mesh dimension: FSDP2 (sharded) or DDP-style replication",
            )
        self.data_parallel = data_parallel
        if schedule not in SCHEDULES:
            raise invalid_choice("schedule", schedule, SCHEDULES)
        check_positive("pipeline_parallel_size", pipeline_parallel_size, True)
        if num_microbatches is not None:
            check_positive("num_microbatches", num_microbatches, False)
        if pp_split is not None and (
            isinstance(pp_split, str)
            or not isinstance(pp_split, (list, tuple))
            or not all(isinstance(n, str) for n in pp_split)
        ):
            raise ConfigurationError(
                f"pp_split={pp_split!r} must be None (balanced by parameter count) or a list of "
                "block names, each the first block of a new stage, e.g. ['net.blocks.4']"
            )
        if pipeline_parallel_size == "auto" and pp_split is not None:
            raise ConfigurationError(
                f"pp_split={pp_split!r} with pipeline_parallel_size='auto': cut points fix the "
                "number of stages; give pipeline_parallel_size as an int, or leave pp_split unset"
            )
        if pipeline_parallel_size == 1 and (pp_split or num_microbatches is not None):
            raise ConfigurationError(
                f"pp_split={pp_split!r} / num_microbatches={num_microbatches!r} need "
                "pipeline_parallel_size > 1; set it, or leave them unset"
            )
        if pipeline_parallel_size != 1:
            schedule_class(schedule)
        if isinstance(pipeline_parallel_size, int) and pipeline_parallel_size > 1:
            num_stages_for(schedule, pipeline_parallel_size, pp_split)
        for flag, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
            if not isinstance(value, bool):
                raise ConfigurationError(f"{flag}={value!r} must be True or False")
            if value and tensor_parallel_size == 1:
                raise ConfigurationError(
                    f"{flag}=True shards activations over the tensor-parallel ranks, but "
                    "tensor_parallel_size=1; set tensor_parallel_size > 1 (or 'auto') or "
                    f"{flag}=False"
                )
            if value and pipeline_parallel_size != 1:
                raise ConfigurationError(
                    f"{flag}=True with pipeline_parallel_size={pipeline_parallel_size!r} is not "
                    "built yet (stages would pass DTensors); use pipeline_parallel_size=1 or "
                    f"{flag}=False"
                )
        self.sequence_parallel, self.loss_parallel = sequence_parallel, loss_parallel
        # types checked now, before any process starts; against the world size in setup_environment
        check_positive("tensor_parallel_size", tensor_parallel_size, True)
        check_positive("data_parallel_size", data_parallel_size, True)
        check_auto_options(seq_len, device_memory, model_shape)
        self.seq_len, self.device_memory, self.model_shape = seq_len, device_memory, model_shape
        self.sizes = {"tp": tensor_parallel_size, "pp": pipeline_parallel_size, "dp": data_parallel_size}
        self.pp_split, self.num_microbatches = list(pp_split) if pp_split is not None else None, num_microbatches
        self.pipeline: Optional[PipelineRunner] = None
        self.tp_plan, self.schedule = tp_plan, schedule
        self.backend, self.timeout = process_group_backend, timeout
        self.dims: Optional[ParallelDims] = None
        self.mesh: Any = None
        self.tp_coverage: Dict[str, Any] = {}
        self._params: Dict[str, nn.Parameter] = {}  # this rank's parameters by name (pipeline)
        self._norm_excluded: set = set()  # tied copies counted in the grad norm on another rank

    # ---- lifecycle ----------------------------------------------------------------------------
    def setup_environment(self, accelerator: str = "auto") -> None:
        self.accelerator = accelerator
        self._device = self._start_process_group(self.backend, self.timeout)
        if "auto" in (self.sizes["tp"], self.sizes["pp"]):
            return  # chosen from the model in plan_layout / setup (the sizes given are checked against it)
        self._build(ParallelDims.resolve(world_size=self.world_size, **self.sizes))

    def _build(self, dims: ParallelDims) -> None:
        check_offload_layout(self.activation_memory, dims.tp)
        self.dims, self.mesh = dims, dims.build_mesh(self.root_device.type)
        if self.is_global_zero:
            log.info("trainforge: megatron layout %s over %d processes", self.dims, self.world_size)

    def plan_layout(self, module: nn.Module, loader: Any = None) -> None:
        """``tensor/pipeline_parallel_size="auto"``: choose the layout from ``module`` (and the training
        loader's batch shape) and build the mesh; the Trainer and ``Accelerator.prepare`` call it before
        sharding the loaders. Nothing to do once the layout is known."""
        if self.dims is not None or "auto" not in (self.sizes["tp"], self.sizes["pp"]):
            return
        if not torch.distributed.is_initialized():
            raise ConfigurationError(
                "MegatronStrategy.setup called before setup_environment(); use it through the "
                "Trainer or Accelerator, or call strategy.setup_environment() first"
            )
        batch, seq = loader_shape(loader) if loader is not None else (self.settings.micro_batch_size, None)
        ac = self.activation_memory.recomputes_every_block
        self._build(
            choose_auto_layout(
                module,
                self.sizes,
                world_size=self.world_size,
                device=self.root_device,
                precision=self.precision.name,
                seq_len=self.seq_len or seq,
                micro_batch_size=batch or self.settings.micro_batch_size,
                device_memory=self.device_memory,
                model_shape=self.model_shape,
                schedule=self.schedule,
                num_microbatches=self.num_microbatches,
                activation_checkpointing=ac,
                sequence_parallel=self.sequence_parallel,
                log_table=self.is_global_zero,
            )
        )

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def data_parallel_size(self) -> int:
        return self.dims.dp if self.dims is not None else 1

    def setup_dataloader(self, dataloader: Any, *, seed: int = 0) -> Any:
        from trainforge.strategies.data.loader import prepare_dataloader

        if self.dims is None and "auto" in (self.sizes["tp"], self.sizes["pp"]):
            raise ConfigurationError(
                f"tensor_parallel_size={self.sizes['tp']!r}, pipeline_parallel_size={self.sizes['pp']!r}: each data-"
                "parallel rank's shard depends on the layout, chosen from the model; prepare the model before (or "
                "together with) its loaders: accelerator.prepare(model, optimizer, loader)"
            )
        n = self.num_microbatches or (
            num_stages_for(self.schedule, self.layout.pp, self.pp_split) if self.pipelined else 1
        )
        size = getattr(dataloader, "batch_size", None)
        if self.pipelined and size is not None and size % n:
            raise ConfigurationError(
                f"the loader's batch_size={size} does not split into num_microbatches={n} equal "
                f"micro-batches; use a batch_size that is a multiple of {n} (or set "
                "num_microbatches to a divisor of it)"
            )
        loader = prepare_dataloader(
            dataloader, rank=self.data_parallel_rank, world_size=self.data_parallel_size, seed=seed
        )
        if self.pipelined and size and not loader.drop_last:
            try:
                samples = len(loader.sampler)
            except TypeError:  # an iterable dataset: PipelineRunner.step checks each batch
                samples = 0
            if samples % size:
                raise ConfigurationError(
                    f"each dp rank reads {samples} samples an epoch, so its last batch holds {samples % size} instead "
                    f"of batch_size={size}; pipeline stages keep the micro-batch shape of the first batch: pass "
                    "drop_last=True to the DataLoader (or use a dataset that divides into whole batches)"
                )
        return loader

    @property
    def layout(self) -> ParallelDims:
        """The (pp, dp, tp) sizes: chosen by ``setup_environment``, or from the model (``"auto"`` sizes)."""
        if self.dims is None:
            raise ConfigurationError(
                "MegatronStrategy has no layout yet: it is chosen by setup_environment() (with "
                "'auto' sizes, from the model when it is prepared); use the strategy through "
                "the Trainer or Accelerator"
            )
        return self.dims

    @property
    def pipelined(self) -> bool:
        """The Trainer sends training batches through ``forward_backward`` (the schedule)."""
        return self.dims is not None and self.dims.pp > 1

    def setup(self, module: nn.Module, optimizers: Optimizers) -> Tuple[nn.Module, List[torch.optim.Optimizer]]:
        if getattr(module, PARALLELIZED, False):  # parallelized before
            return module, build_optimizers(optimizers)
        self.plan_layout(module)  # 'auto' sizes, when neither the Trainer nor prepare() chose them before
        if self.pipelined:
            materialize_whole(module, self.root_device, "megatron with pipeline parallelism")
            return self._setup_pipeline(module, optimizers)
        before = list(module.named_parameters())
        module = self.setup_module(module)
        if callable(optimizers):  # built now, on the DTensor parameters (the Trainer's order)
            return module, build_optimizers(optimizers)
        if optimizers:  # built by the user on the plain parameters (Accelerate's order)
            remap_optimizers(before, module, optimizers)
        return module, list(optimizers)

    def setup_module(self, module: nn.Module) -> nn.Module:
        if getattr(module, PARALLELIZED, False):
            return module
        self.plan_layout(module)
        if self.mesh is None:
            raise ConfigurationError(
                "MegatronStrategy.setup called before setup_environment(); use it through the "
                "Trainer or Accelerator, or call strategy.setup_environment() first"
            )
        if self.pipelined:
            raise ConfigurationError(
                f"setup_module with pipeline_parallel_size={self.layout.pp}: the pipeline needs "
                "setup(module, optimizer builder) (the Trainer's path), which builds the stages"
            )
        meta = has_meta(module)  # built with empty_init: materialised once sharded (strategies/materialize.py)
        module = self.precision.convert_module(module if meta else module.to(self.root_device))
        if self.layout.tp > 1:  # 1. (pp split: _setup_pipeline) 2. tensor parallelism
            self.tp_coverage = apply_tp(
                module,
                self.mesh["tp"],
                self.tp_plan,
                sequence_parallel=self.sequence_parallel,
                loss_parallel=self.loss_parallel,
            )
            self._log_coverage()
            if self.loss_parallel:
                install_loss_parallel(module)
        units = select_modules(module, None)  # 3. activation checkpointing
        wrappers = self.wrap_activation_blocks(module, {type(m) for _, m in units} or None)
        if meta and self.layout.dp > 1 and self.data_parallel != "fsdp":  # DDP broadcasts real values
            materialize(module, self.root_device)
            meta = False
        if self.layout.dp > 1:  # 4. (compile: the Trainer's compile=True) 5. FSDP2 / DDP on the dp dimension
            apply_data_parallel(
                self.data_parallel,
                [wrappers.get(id(unit), unit) for _, unit in units],
                module,
                self.mesh["dp"],
                self._mp_policy(),
            )
        if meta:  # each rank allocates and fills only its TP/FSDP shards
            materialize(module, self.root_device)
        setattr(module, PARALLELIZED, True)
        return module

    def _log_coverage(self) -> None:
        if self.is_global_zero:  # under pipelining: the first stage's share
            c = self.tp_coverage
            log.info(
                "trainforge: tensor parallel plan shards %d module(s), %d of %d parameters (%.0f%%): %s",
                c["modules"],
                c["sharded_numel"],
                c["total_numel"],
                100 * c["fraction"],
                ", ".join(c["sharded_params"][:8]) + (" ..." if len(c["sharded_params"]) > 8 else ""),
            )

    def forward_backward(
        self, module: nn.Module, step_fn: Any, batch: Any, batch_idx: int, backward: Any = None, loss_fn: Any = None
    ) -> Any:
        """Pipeline parallelism: the schedule runs forward, ``loss_fn(output, target)`` (default
        ``module.loss_fn``) and backward of every micro-batch; returns the batch's mean loss (the same
        on every rank). ``batch`` is ``(inputs, target)`` or what ``module.pipeline_batch(batch)`` makes of it."""
        if self.pipeline is None:
            return super().forward_backward(module, step_fn, batch, batch_idx, backward)
        if loss_fn is not None:
            self.pipeline.loss_fn = loss_fn
        loss = self._run_pipeline(module, batch, train=True)
        self.pipeline.reduce_tied_grads(self._params)
        return loss

    def evaluate_batch(self, module: nn.Module, step_fn: Any, batch: Any, batch_idx: int) -> Any:
        """Pipeline parallelism: the batch's mean ``loss_fn`` through the stages, forward only (the
        Trainer's validation/test step under pipelining); otherwise ``step_fn`` as everywhere."""
        if not self.pipelined:
            return super().evaluate_batch(module, step_fn, batch, batch_idx)
        return self._run_pipeline(module, batch, train=False)

    def backward(self, loss: torch.Tensor, module: Optional[nn.Module]) -> None:
        if self.pipeline is not None:
            raise ConfigurationError(
                "backward(loss) with pipeline parallelism: the loss exists on the last stage only "
                "and the schedule runs the backward itself; call accelerator.forward_backward("
                "model, batch, loss_fn) instead of computing the loss and calling backward"
            )
        with loss_parallel_context() if self.loss_parallel and self.layout.tp > 1 else contextlib.nullcontext():
            super().backward(loss, module)

    def _mp_policy(self) -> MixedPrecisionPolicy:
        dtype = self.precision.autocast_dtype
        return (
            MixedPrecisionPolicy()
            if dtype is None
            else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        )

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # everything is applied in place

    def teardown(self) -> None:
        self.mesh, self.pipeline, self._params = None, None, {}
        self._stop_process_group()

    # ---- the step -----------------------------------------------------------------------------
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        if not (enabled and isinstance(module, FSDPModule)):
            return contextlib.nullcontext()
        return no_gradient_sync(module)

    def clip_gradients(
        self,
        parameters: Any,
        *,
        max_norm: Optional[float] = None,
        clip_value: Optional[float] = None,
        norm_type: float = 2.0,
    ) -> Optional[torch.Tensor]:
        """Gradients live on different meshes (tp+dp, dp only, none): the norm of each mesh's group is
        reduced over that mesh, then the groups combine into the norm of the unsharded model; under
        pipeline parallelism the stages' norms combine over the pipeline (tied copies counted once)."""
        params = [p for p in parameters if p.grad is not None]
        if clip_value is not None or max_norm is None:
            return super().clip_gradients(params, max_norm=max_norm, clip_value=clip_value, norm_type=norm_type)
        groups: Dict[Any, List[torch.Tensor]] = {}
        for p in params:
            if id(p) in self._norm_excluded:
                continue
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
        norms = []
        for group in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], norm_type)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.nn.utils.get_total_norm(norms, norm_type)
        if self.pipeline is not None:
            total = self.pipeline.total_norm(total, norm_type)
            excluded = [p for p in params if id(p) in self._norm_excluded]
            if excluded:
                groups.setdefault("tied", []).extend(excluded)
        for group in groups.values():  # one call per kind: foreach kernels do not mix DTensor and Tensor
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    # ---- checkpoints --------------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """The full state dict on CPU on every rank, gathered one tensor at a time in the same
        order everywhere (torch's ``full_state_dict`` option hung here on a tp x dp mesh under gloo)."""
        out = {}
        for name, value in get_model_state_dict(module).items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            assert isinstance(full, torch.Tensor), name  # a module's state dict holds tensors only
            out[name] = full.detach().cpu()
        if self.pipeline is not None:  # each pipeline rank holds its stages: gather them (original names)
            parts: List[Any] = [None] * self.layout.pp
            torch.distributed.all_gather_object(parts, out, group=self.pipeline.group)
            out = {k: v for part in parts for k, v in part.items()}
        return out

    def save_checkpoint(self, writer: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """``dcp/`` (strategies/checkpoint/dcp.py) with the optimizer state flat: each pipeline rank's
        parameter groups hold other parameters, and the flat form loads on any (pp, dp, tp) layout."""
        save_sharded(writer, module, optimizers, flat=True)

    def load_checkpoint(self, path: Any, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """A ``dcp/`` checkpoint from any (tp, dp) layout or from FSDPStrategy; DCP reshards on read."""
        if not has_sharded(path):
            raise CheckpointError(
                f"{path}: no {DCP_DIR}/ folder; MegatronStrategy loads sharded checkpoints "
                "(written by MegatronStrategy or FSDPStrategy(state_dict_type='sharded'))"
            )
        load_sharded(path, module, optimizers, nested_ok=not self.pipelined)

    def __repr__(self) -> str:
        return f"MegatronStrategy({self.dims or self.sizes}, device={self.root_device})"
