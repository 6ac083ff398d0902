"""Per-rank batch indices of prepared loaders on several processes, for Accelerate's sharding rules
(tests/trainer/test_accelerate_sharding.py). For each case (dataset length, batch size, shuffle, split_batches,
even_batches, drop_last) the script seeds the global RNG, prepares a DataLoader over a dataset that returns its
indices, runs an epoch, then epoch 5 (``set_epoch(5)``), and records each batch, then one draw of the global RNG (so the draws the loader
made are compared too). Rank 0 prints ``CASES <json>``: the cases, and per case, per rank, the epochs'
batches, ``len()`` and the draw.

``--backend accelerate`` runs the same on HF Accelerate (to record its figures; trainforge never imports it)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

BACKEND = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "trainforge"
if BACKEND == "accelerate":
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
else:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from trainforge import Accelerator
    from trainforge import seed_everything as set_seed
    from trainforge.utils import DataLoaderConfiguration

# (dataset length, batch_size, shuffle, split_batches, even_batches, drop_last[, data_seed]); a seventh field is
# DataLoaderConfiguration(use_seedable_sampler=True, data_seed=<it>), "initial" for data_seed=None
CASES = [
    (8, 2, False, False, True, False),  # the example: rank 0 [0,1],[4,5]; rank 1 [2,3],[6,7]
    (11, 2, False, False, True, False),  # uneven: the last round wraps around to the epoch's start
    (11, 2, False, False, False, False),  # uneven, no duplicates: the last batches are short or missing
    (11, 4, False, True, True, False),  # split: each rank its half of every batch of 4
    (11, 4, False, True, False, False),
    (11, 2, False, False, True, True),  # drop_last: whole rounds only
    (13, 3, True, False, True, False),  # shuffled, seeded
    (13, 3, True, False, False, False),
    (13, 4, True, True, True, False),
    (13, 4, True, True, False, False),
    (3, 2, False, False, True, False),  # fewer samples than one round: wrapped around more than once
    (13, 3, True, False, True, False, 99),  # SeedableRandomSampler: epoch e is the permutation of seed 99 + e
    (13, 4, True, True, True, False, "initial"),  # data_seed None: torch.initial_seed() when prepared
]
# IterableDatasets and dispatch_batches (rank 0 reads, every rank gets its slice): (dataset length, batch_size,
# split_batches, kind); "stream" is an IterableDataset (dispatched by default, as Accelerate), "shuffled" a
# shuffled map-style dataset dispatched, "split" an IterableDataset with dispatch_batches=False (each rank reads
# the stream and keeps its batches: Accelerate's IterableDatasetShard)
DISPATCH_CASES = [
    (11, 2, False, "stream"),  # the last group [8, 9, 10] completed with the epoch's first row: rank 1 [10, 0]
    (11, 4, True, "stream"),
    (11, 2, False, "shuffled"),  # only rank 0's sampler draws from the global RNG
    (11, 2, False, "split"),  # the last round [8, 9, 10] completed with the first round's start: rank 1 [10, 0]
    (11, 4, True, "split"),
    (3, 2, False, "split"),  # the first round is the last: completed with itself
]


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class Indices(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def seedable_accelerator(data_seed):
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=None if data_seed == "initial" else data_seed)
    return Accelerator(cpu=True, dataloader_config=config)


def run_case(accelerator, case):
    n, batch_size, shuffle, split, even, drop_last = case[:6]
    if len(case) > 6:
        accelerator = seedable_accelerator(case[6])
    if BACKEND == "accelerate":
        accelerator.dataloader_config.split_batches = split
        accelerator.dataloader_config.even_batches = even
    else:
        accelerator.split_batches, accelerator.even_batches = split, even
    set_seed(1234)
    loader = DataLoader(Indices(n), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
    prepared = accelerator.prepare_data_loader(loader)
    epochs = [[batch.tolist() for batch in prepared]]
    prepared.set_epoch(5)  # the next pass is epoch 5 (a SeedableRandomSampler's seed + 5)
    epochs.append([batch.tolist() for batch in prepared])
    return {"epochs": epochs, "len": len(prepared), "draw": torch.rand(1).item()}


def run_dispatch_case(case):
    n, batch_size, split, kind = case
    dispatch = {"stream": None, "shuffled": True, "split": False}[kind]  # map-style: dispatched when asked
    config = DataLoaderConfiguration(split_batches=split, dispatch_batches=dispatch)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    set_seed(1234)
    dataset = Indices(n) if kind == "shuffled" else Stream(n)
    prepared = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=batch_size, shuffle=kind == "shuffled"))
    epochs = [[batch.tolist() for batch in prepared] for _ in range(2)]
    return {"epochs": epochs, "draw": torch.rand(1).item()}


def gathered(results, cases):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    return [[every[r][i] for r in range(len(every))] for i in range(len(cases))]


def main():
    accelerator = Accelerator(cpu=True)
    results = gathered([run_case(accelerator, case) for case in CASES], CASES)
    dispatched = gathered([run_dispatch_case(case) for case in DISPATCH_CASES], DISPATCH_CASES)
    if dist.get_rank() == 0:
        print("CASES " + json.dumps({"specs": CASES, "results": results}))
        print("DISPATCH " + json.dumps({"specs": DISPATCH_CASES, "results": dispatched}))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
