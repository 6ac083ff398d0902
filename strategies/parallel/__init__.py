"""Model-parallel building blocks for ``MegatronStrategy`` (DESIGN.md "Strategy interface").

Applied in this fixed order, each step in its own file::

    dims = ParallelDims(pp, dp, tp, world_size)   # dims.py: sizes checked once, one named mesh
    apply_tp(model, dims.mesh["tp"], plan)         # tp.py: Megatron column/row sharding from a plan
    activation checkpointing                       # strategies/fsdp_wrap.py
    fully_shard(block, mesh=dims.mesh["dp"]) ...   # FSDP2 over the dp dimension, blocks then root

Pipeline stages (the first step of the order) are not built yet: ``pipeline_parallel_size`` must be 1.
"""
from strategies.parallel.dims import ParallelDims
from strategies.parallel.tp import apply_tp, resolve_plan

__all__ = ["ParallelDims", "apply_tp", "resolve_plan"]
