"""MegatronStrategy's pipeline parallelism (``pipeline_parallel_size > 1``), a mixin of
``MegatronStrategy``: the checks made before anything moves, the setup in its fixed order on this
rank's stages, and one batch through the schedule (``parallel/pp.py``, ``parallel/pp_schedule.py``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from trainforge.strategies.activation_memory import ActivationMemory, select_blocks
from trainforge.strategies.base import Optimizers, build_optimizers
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.fsdp_wrap import clean_name, select_modules
from trainforge.strategies.parallel import apply_tp
from trainforge.strategies.parallel.dp import apply_data_parallel
from trainforge.strategies.parallel.pp import (
    PassThrough,
    check_tied_placement,
    guard_forward,
    num_stages_for,
    plan_split,
    prune,
    stage_blocks,
    stage_ids,
    stage_module,
)
from trainforge.strategies.parallel.pp_schedule import PipelineRunner

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from trainforge.strategies.base import RunSettings
    from trainforge.strategies.parallel import ParallelDims
    from trainforge.strategies.precision import Precision

log = logging.getLogger("trainforge")
PARALLELIZED = "_trainforge_megatron"  # set on a module once parallelized: a second setup leaves it as it is


class PipelineSetup:
    """Mixed into ``MegatronStrategy``; reads its layout (``dims``, ``mesh``, ``schedule``, ...)."""

    pipeline: Optional[PipelineRunner] = None  # set up here when pipeline_parallel_size > 1

    if TYPE_CHECKING:  # MegatronStrategy's, for the type checker
        dims: Optional[ParallelDims]
        mesh: DeviceMesh
        settings: RunSettings
        schedule: str
        num_microbatches: Optional[int]
        pp_split: Any
        tp_plan: Any
        activation_memory: ActivationMemory
        data_parallel: str
        tp_coverage: Dict[str, Any]
        _params: Dict[str, nn.Parameter]
        _norm_excluded: Any

        @property
        def layout(self) -> ParallelDims: ...
        @property
        def precision(self) -> Precision: ...
        @property
        def root_device(self) -> torch.device: ...
        @property
        def is_global_zero(self) -> bool: ...
        def _log_coverage(self) -> None: ...
        def wrap_activation_blocks(
            self, module: nn.Module, default_blocks: Any = None, names: Optional[Sequence[str]] = None
        ) -> Dict[int, nn.Module]: ...
        def _mp_policy(self) -> MixedPrecisionPolicy: ...

    def _setup_pipeline(self, module: nn.Module, optimizers: Optimizers) -> Tuple[nn.Module, List[Any]]:
        """Checks first (nothing moved yet), then the fixed order on this rank's stages: split (prune
        the module to its stages) -> TP -> activation checkpointing -> FSDP2 per stage -> schedule."""
        self._check_pipeline_inputs(module, optimizers)
        dims, mesh, trainer = self.layout, self.mesh, callable(optimizers)
        num_stages = num_stages_for(self.schedule, dims.pp, self.pp_split)
        # the Trainer's module holds the model in an attribute; a plain model (Accelerator) may be it
        split = plan_split(module, num_stages, self.pp_split, allow_root=not trainer)
        before = [(clean_name(n), p) for n, p in module.named_parameters()]
        check_tied_placement(split, dims.pp, self.schedule)
        local = stage_ids(mesh["pp"].get_local_rank(), dims.pp, num_stages, self.schedule)
        plan = None
        if dims.tp > 1:  # resolved on the whole model, so a glob is checked against every stage
            from trainforge.strategies.parallel.tp import resolve_plan

            plan = resolve_plan(module, self.tp_plan, dims.tp)
        # blocks chosen on the whole model (a pruned block list mixes in identities): "every n-th" counts
        # the model's blocks, whatever the split
        ac_blocks = select_blocks(
            module, self.activation_memory, {type(m) for _, m in select_modules(module, None)} or None
        )
        if self.is_global_zero:
            log.info(
                "trainforge: pipeline %s, %d stage(s) on %d rank(s), %s micro-batches: %s",
                self.schedule,
                num_stages,
                dims.pp,
                self.num_microbatches or num_stages,
                split.describe(),
            )
        prune(module, split, local)  # 1. pipeline split, before the move: only this rank's stages reach the device
        module = module.to(self.root_device)
        # this rank's stages only: one of them may hold no layer fp8 converts
        module = self.precision.convert_module(module, whole_model=False)
        if plan is not None:  # 2. tensor parallelism on the modules this rank kept
            mine = {n for s in local for n in split.stages[s]}
            self.tp_coverage = apply_tp(module, mesh["tp"], plan, only=lambda n: split.child(n) in mine)
            self._log_coverage()
        local_blocks = [n for n in ac_blocks if not isinstance(module.get_submodule(n), PassThrough)]
        self.wrap_activation_blocks(module, names=local_blocks)  # 3. activation checkpointing (this rank's blocks)
        stages = {s: stage_module(module, split, s) for s in local}
        if dims.dp > 1:  # 4. (compile: the Trainer's) 5. FSDP2 / DDP per stage, its blocks then the stage
            for stage in stages.values():
                blocks = stage_blocks(stage, split)
                apply_data_parallel(
                    self.data_parallel, blocks, stage, mesh["dp"], self._mp_policy(), reshard_after_forward=False
                )
        guard_forward(module, split)
        runner = PipelineRunner(
            stages,
            split,
            self.schedule,
            self.num_microbatches or num_stages,
            getattr(module, "loss_fn", None),
            mesh,
            self.root_device,
        )
        runner.setup_tied(split, local)
        self._params = {clean_name(n): p for n, p in module.named_parameters()}
        runner.check_tied_shapes(self._params)
        self.pipeline, self._norm_excluded = runner, runner.norm_excluded(self._params)
        setattr(module, PARALLELIZED, True)
        if callable(optimizers):  # the Trainer's builder
            return module, build_optimizers(optimizers)  # on this rank's own (sharded) parameters
        _keep_local_parameters(before, self._params, optimizers)  # built before on the whole model (Accelerate)
        return module, list(optimizers)

    def _check_pipeline_inputs(self, module: nn.Module, optimizers: Optimizers) -> None:
        where = f"pipeline_parallel_size={self.layout.pp}"
        # the Trainer's module must define loss_fn; the Accelerator may pass it with each batch
        if callable(optimizers) and not callable(getattr(module, "loss_fn", None)):
            raise ConfigurationError(
                f"{where}: {type(module).__name__} must define loss_fn(self, output, target) -> "
                "loss: the pipeline computes the loss on its last stage from the model's output "
                "and the batch's target (training_step is not called)"
            )
        if self.settings.accumulation_steps > 1:
            raise ConfigurationError(
                f"{where} with accumulate_grad_batches={self.settings.accumulation_steps}: with pipeline "
                "parallelism the micro-batches are the accumulation; use num_microbatches (and a "
                "loader batch of num_microbatches x micro-batch size) and "
                "accumulate_grad_batches=1"
            )
        if self.precision.scaler is not None:
            raise ConfigurationError(
                f"{where} with precision={self.precision.name!r}: the fp16 grad scaler is not "
                "built into the pipeline schedule yet; use 'bf16-mixed' or '32'"
            )

    def _run_pipeline(self, module: nn.Module, batch: Any, train: bool) -> torch.Tensor:
        split_batch = getattr(module, "pipeline_batch", None)
        parts = split_batch(batch) if callable(split_batch) else batch
        if not isinstance(parts, (tuple, list)) or len(parts) != 2:
            raise ConfigurationError(
                f"pipeline parallelism needs each batch as (inputs, target), got "
                f"{type(parts).__name__}; define {type(module).__name__}.pipeline_batch(batch) "
                "-> (inputs, target)"
            )
        inputs, target = parts
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        pipeline = self.pipeline
        if pipeline is None:
            raise ConfigurationError("the pipeline runs after setup(); prepare the model first")
        with self.precision.autocast():
            return pipeline.step(inputs, target, train=train)


def _keep_local_parameters(
    before: List[Tuple[str, nn.Parameter]], after: Dict[str, nn.Parameter], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Optimizers built on the whole model (Accelerate's order) keep this rank's parameters, now
    sharded (matched by name), and drop the other stages' (their state, if any, is discarded)."""
    names = {id(p): n for n, p in before}
    for opt in optimizers:
        for group in opt.param_groups:
            unknown = [tuple(p.shape) for p in group["params"] if id(p) not in names]
            if unknown:
                raise ConfigurationError(
                    f"{type(opt).__name__} holds parameters of shapes {unknown[:3]} that are not "
                    "in the prepared model; prepare the model together with its own optimizer"
                )
            group["params"] = [after[names[id(p)]] for p in group["params"] if names[id(p)] in after]
        opt.state.clear()
