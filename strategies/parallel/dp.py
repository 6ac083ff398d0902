"""Data parallelism on the ``dp`` mesh dimension: FSDP2 (``fully_shard``, ZeRO-3: parameters,
gradients and optimizer state sharded over dp) or DDP-style replication (``data_parallel="ddp"``:
``torch.distributed._composable.replicate_with_fsdp.replicate``, FSDP2's machinery with every
parameter replicated on dp and gradients all-reduced per unit, which composes with TP's DTensors).

Both are applied the same way: each repeated block (a unit of communication that overlaps the
backward), then the root (or each pipeline stage) for the rest.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch import nn

DATA_PARALLEL = ("fsdp", "ddp")


def apply_data_parallel(
    kind: str,
    units: Iterable[nn.Module],
    root: nn.Module,
    mesh: Any,
    mp_policy: Any,
    reshard_after_forward: Optional[bool] = None,
) -> None:
    if kind == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for unit in units:
            replicate(unit, mesh=mesh, mp_policy=mp_policy)
        replicate(root, mesh=mesh, mp_policy=mp_policy)
        return
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh, "mp_policy": mp_policy}
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(root, **kwargs)
