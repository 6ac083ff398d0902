"""Running the pipeline: ``PipelineStage`` per local stage, one schedule, the batch loss and tied gradients.

Gradients are those of the whole batch's mean loss, as without pipelining: the schedule computes
the module's loss per micro-batch (a mean over the micro-batch) and ``scale_grads`` divides the
summed gradients by the number of micro-batches (equal micro-batches: the loader's batch must
divide by ``num_microbatches``). FSDP2 on the dp dimension then averages over dp ranks.
The batch loss (mean over micro-batches) lives on the last stage and is broadcast to the other
ranks of the pipeline, so every rank returns (and logs) the same value.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.parallel.pp import SINGLE, PipelineSplit, schedule_class, stage_rank


class PipelineRunner:
    def __init__(
        self,
        stages: Dict[int, nn.Module],
        split: PipelineSplit,
        schedule: str,
        num_microbatches: int,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]],
        mesh: Any,
        device: torch.device,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.mesh, self.group = mesh, mesh["pp"].get_group()
        self.pp, self.pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
        self.num_stages, self.num_microbatches = len(split.stages), num_microbatches
        self.has_first, self.has_last = 0 in stages, self.num_stages - 1 in stages
        self.rank_of = lambda s: stage_rank(s, self.pp, self.num_stages, schedule)
        self.last_rank = self.rank_of(self.num_stages - 1)  # pipeline rank of the last stage
        self.stages = [
            PipelineStage(m, i, self.num_stages, device, group=self.group) for i, m in sorted(stages.items())
        ]
        cls = schedule_class(schedule)
        try:
            target = self.stages[0] if schedule in SINGLE else self.stages
            self.schedule = cls(target, n_microbatches=num_microbatches, loss_fn=self._loss, scale_grads=True)
        except (ValueError, RuntimeError, AssertionError) as e:
            reason = str(e).rstrip(".")
            raise ConfigurationError(
                f"schedule={schedule!r} with num_microbatches={num_microbatches} on "
                f"pipeline_parallel_size={self.pp} ({self.num_stages} stages): {reason}; choose "
                f"num_microbatches as a multiple of {self.pp}, at least {self.num_stages}"
            ) from None
        self.loss_fn = loss_fn  # the module's; the Accelerator may pass another per batch
        self.tied: List[Tuple[List[str], Any, bool]] = []  # (local names, group, counted in the norm here)
        self.rows: Optional[int] = None  # samples per batch, fixed by the first one (the stages' shapes)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss_fn = self.loss_fn
        if loss_fn is None:  # step() checks it before the schedule runs
            raise TypeError("'NoneType' object is not callable: PipelineRunner.loss_fn is None")
        return loss_fn(output, target)

    # ---- tied parameters (Megatron's embedding group) -------------------------------------------
    def setup_tied(self, split: PipelineSplit, local: Sequence[int]) -> None:
        """One process group per tied parameter and (dp, tp) coordinate: the pipeline ranks holding
        a copy. Every rank creates every group, in the same order (``new_group`` is collective)."""
        ranks = self.mesh.mesh  # (pp, dp, tp) tensor of global ranks
        for placed in split.tied:
            holders = sorted({self.rank_of(s) for s, _ in placed})  # one stage per rank: check_tied_placement
            mine = None
            for d in range(ranks.shape[1]):
                for t in range(ranks.shape[2]):
                    group_ranks = [int(ranks[h, d, t]) for h in holders]
                    group = dist.new_group(group_ranks)
                    if dist.get_rank() in group_ranks:
                        mine = group
            if self.pp_rank in holders:
                local_names = [n for s, n in placed if s in local]
                self.tied.append((local_names, mine, self.pp_rank == holders[0]))

    def check_tied_shapes(self, params: Dict[str, nn.Parameter]) -> None:
        for names, group, _ in self.tied:
            p = params[names[0]]
            shape = (tuple(_local(p).shape), str(getattr(p, "placements", "not sharded")))
            everyone: List[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, shape, group=group)
            if len(set(everyone)) > 1:
                raise ConfigurationError(
                    f"tied parameter {names[0]!r} is sharded differently on the stages sharing it "
                    f"(local shapes/placements {everyone}); give both uses the same tp_plan style "
                    "(e.g. embedding 'embedding_rowwise' with head 'colwise') or untie them"
                )

    def reduce_tied_grads(self, params: Dict[str, nn.Parameter]) -> None:
        for names, group, _ in self.tied:
            param = params[names[0]]
            grad = param.grad
            if grad is None:
                continue
            dparam = cast(DTensor, param)  # read only when the gradient is a DTensor: then the parameter is one
            if isinstance(grad, DTensor) and grad.placements != dparam.placements:
                # e.g. an embedding_rowwise weight's gradient comes back Replicate: give it the
                # parameter's sharding, so both copies' local shards line up
                grad = param.grad = grad.redistribute(dparam.device_mesh, dparam.placements)
            dist.all_reduce(_local(grad), group=group)

    def norm_excluded(self, params: Dict[str, nn.Parameter]) -> Set[int]:
        """Copies of tied parameters counted in the gradient norm on another rank."""
        return {id(params[names[0]]) for names, _, counted in self.tied if not counted}

    # ---- one batch ------------------------------------------------------------------------------
    def step(self, inputs: Tuple[Any, ...], target: Any, train: bool = True) -> torch.Tensor:
        """One batch: forward, loss and backward of every micro-batch (``train=False``: forward and
        loss only, ``schedule.eval``); returns the batch's mean loss on every pipeline rank."""
        if self.loss_fn is None:
            raise ConfigurationError(
                "pipeline parallelism needs a loss function over (output, target): define "
                "loss_fn(output, target) on the module, or pass loss_fn= to "
                "accelerator.forward_backward"
            )
        n = self.num_microbatches
        rows = _rows(inputs[0] if inputs else target)
        if self.rows is None:
            self.rows = rows
        if rows is not None and (rows % n or rows != self.rows):
            raise ConfigurationError(
                f"a batch of {rows} samples: the pipeline stages were built for batches of "
                f"{self.rows} samples in num_microbatches={n} equal micro-batches, and keep that "
                "shape; give every batch that size (DataLoader(drop_last=True) drops a smaller "
                "last batch)"
            )
        losses: List[torch.Tensor] = []
        kwargs: Dict[str, Any] = {"return_outputs": False}
        if self.has_last:
            kwargs.update(target=target, losses=losses)
        args = inputs if self.has_first else ()
        if train:
            self.schedule.step(*args, **kwargs)
        else:
            with torch.no_grad():
                self.schedule.eval(*args, **kwargs)
        if self.has_last:
            loss = torch.stack([part.detach().float() for part in losses]).mean()
        else:
            loss = torch.zeros((), device=self.stages[0].device)
        if self.pp > 1:
            dist.broadcast(loss, group_src=self.last_rank, group=self.group)
        return loss

    def total_norm(self, local_norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The norm over every stage from each pipeline rank's own norm."""
        if norm_type == float("inf"):
            dist.all_reduce(local_norm, op=dist.ReduceOp.MAX, group=self.group)
            return local_norm
        powered = local_norm.double() ** norm_type
        dist.all_reduce(powered, group=self.group)
        return (powered ** (1.0 / norm_type)).to(local_norm.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _rows(x: Any) -> Optional[int]:
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else None
