"""Two ranks (gloo): the frozen-base checksum of a sharded DTensor equals the plain tensor's, for
tests/strategies/test_frozen_base.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/frozen_dtensor.py

Small limits make every path run on a small tensor: gathered whole (at most CHECKSUM_MAX_NUMEL elements) and
sampled element by element (more), with SAMPLE below the size so that elements are strided. Prints
``same <placements>`` per layout on rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from trainforge.strategies.checkpoint import frozen


def frozen_linear(weight: torch.Tensor) -> nn.Module:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(41 * 7, dtype=torch.float32).reshape(41, 7) / 7
    frozen.SAMPLE = 50
    for limit in (10_000, 10):
        frozen.CHECKSUM_MAX_NUMEL = limit
        expected = frozen.base_record(frozen_linear(full.clone()))["checksums"]
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            sharded = frozen_linear(distribute_tensor(full.clone(), mesh, placements))
            got = frozen.base_record(sharded)["checksums"]
            assert got == expected, (limit, placements, got, expected)
            # 287 elements, SAMPLE 50: every 6th flat index is hashed (240 is, 241 is not)
            for index, differs in ((240, True), (241, False)):
                changed = full.clone()
                changed.view(-1)[index] += 1
                other = frozen.base_record(frozen_linear(distribute_tensor(changed, mesh, placements)))["checksums"]
                assert (other != expected) == differs, (limit, placements, index)
            if dist.get_rank() == 0:
                print("same", limit, placements, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
