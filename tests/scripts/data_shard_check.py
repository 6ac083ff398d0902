"""Run under torchrun (gloo, 2 ranks) by tests/strategies/test_data_distributed.py.

Each rank prepares the same DataLoader, iterates epoch 0 and 1 (set_epoch between), then takes
STEPS batches of epoch 2 and saves its data position; rank 0 writes what every rank saw.
"""

import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from trainforge.strategies.data.loader import loader_state_dict, prepare_dataloader, set_loader_epoch

N, BATCH, STEPS = 44, 4, 3


def main(out_path: str) -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = prepare_dataloader(
        DataLoader(list(range(N)), batch_size=BATCH, shuffle=True, num_workers=2), rank=rank, world_size=world, seed=11
    )
    record = {"rank": rank, "world_size": world, "epochs": []}
    for epoch in range(2):
        set_loader_epoch(loader, epoch)
        record["epochs"].append([batch.tolist() for batch in loader])
    set_loader_epoch(loader, 2)
    it = iter(loader)
    record["epoch2_taken"] = [next(it).tolist() for _ in range(STEPS)]
    record["state"] = loader_state_dict(loader)
    gathered = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        torch.save(gathered, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
