"""Two-rank checkpoint save over gloo (for tests/strategies/test_checkpoint_crash.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/ckpt_two_ranks.py ROOT

Each rank writes its own files into the same checkpoint (per-rank RNG objects, a backend-style
shard written without the writer, one of them tracked), rank 0 the model; rank 0 commits.
Then both ranks overwrite ``last`` twice, and finally both try to write the same file name,
which rank 0 refuses and rank 1 learns about. Prints ``rank R ok`` at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainforge.strategies.checkpoint.io import CheckpointWriter, load_object, load_tensors, read_latest_pointer
from trainforge.strategies.errors import CheckpointError


def save(root: Path, name: str, step: int, rank: int, world_size: int) -> Path:
    w = CheckpointWriter(root / name, rank=rank, world_size=world_size, barrier=dist.barrier)
    if rank == 0:
        w.save_tensors("model", {"w": torch.full((1000,), float(step))})
    w.save_object(f"rng/rank-{rank:05d}", {"rank": rank, "step": step, "torch": torch.get_rng_state()})
    shard = w.tmp_dir / "shards" / f"__{rank}_0.distcp"  # as a sharded backend would write it
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.write_bytes(bytes([rank, step]) * 4096)
    if rank == 1:
        w.track(f"shards/__{rank}_0.distcp")  # rank 0's shard stays untracked: hashed at commit
    return w.finalize({"step": step, "strategy": "ddp", "precision": "32"})


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    root = Path(sys.argv[1])
    torch.manual_seed(rank)
    for step in (1, 2):
        final = save(root, f"step-{step}", step, rank, world_size)
        assert final == (root / f"step-{step}").absolute(), final
        mine = load_object(final, f"rng/rank-{rank:05d}")
        assert mine["rank"] == rank and mine["step"] == step, mine
        assert float(load_tensors(final)["w"][0]) == step
    for step in (3, 4):
        save(root, "last", step, rank, world_size)
    assert read_latest_pointer(root) == "last"
    w = CheckpointWriter(root / "clash", rank=rank, world_size=world_size, barrier=dist.barrier)
    for writer in (1, 0):  # one after the other, so each rank records its own content
        if rank == writer:
            w.save_object("same-name", {"rank": rank})
        dist.barrier()
    try:
        w.finalize({"step": 5})
        raise AssertionError("two ranks writing one file name must fail")
    except CheckpointError as e:
        expected = "written by rank" if rank == 0 else "rank 0 did not commit"
        # a rank script run by torchrun, outside pytest
        assert expected in str(e), str(e)  # noqa: PT017
    dist.barrier()
    print(f"rank {rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
