"""Model-parallel building blocks for ``MegatronStrategy`` (docs/ARCHITECTURE.md "The strategy interface").

Applied in this fixed order, each step in its own file::

    choose_auto_layout(model, sizes, ...)          # auto.py: "auto" sizes from layout.py's memory estimate
    dims = ParallelDims(pp, dp, tp, world_size)   # dims.py: sizes checked once, one named mesh
    plan_split / prune / stage_module              # pp.py: blocks cut into stages, each rank keeps its own
    apply_tp(model, dims.mesh["tp"], plan)         # tp.py: Megatron column/row sharding from a plan
                                                   #   (sp.py: sequence/loss parallel rewrite of the plan)
    activation checkpointing                       # strategies/fsdp_wrap.py
    apply_data_parallel("fsdp"|"ddp", blocks, ...) # dp.py: FSDP2 or replicate on dp, blocks then root (each stage)
    PipelineRunner(stages, ...)                    # pp_schedule.py: PipelineStage + the named schedule
"""

from trainforge.strategies.parallel.dims import ParallelDims
from trainforge.strategies.parallel.tp import apply_tp, resolve_plan

__all__ = ["ParallelDims", "apply_tp", "resolve_plan"]
