"""Launched on 2 processes: a raw DDP loop, the Trainer (strategy auto -> DDP) and the Accelerator,
same seed and sampler, with accumulation 1 and 2. Rank 0 writes each run's weights to OUT_DIR. The Trainer
shards as Lightning's DistributedSampler (``RandomShard``), the Accelerator as Accelerate (``AccelerateShard``)."""

import copy
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Accelerator, Trainer, seed_everything

EPOCHS, BATCH = 2, 4


class RandomShard(torch.utils.data.Sampler):
    """The order trainforge gives a shuffled DataLoader on several processes, written out: at each
    epoch start the draws a plain DataLoader makes from the global RNG (worker base seed, then the
    RandomSampler's seed), rank 0's permutation shared, rank r taking positions r, r+W, ... (padded
    like DistributedSampler)."""

    def __init__(self, n, rank, world):
        self.n, self.rank, self.world = n, rank, world
        self.total = -(-n // world) * world

    def __len__(self):
        return self.total // self.world

    def __iter__(self):
        torch.empty((), dtype=torch.int64).random_()  # the worker base seed
        seed = torch.empty((), dtype=torch.int64).random_()
        dist.broadcast(seed, 0)
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(int(seed))).tolist()
        order += order[: self.total - self.n]
        return iter(order[self.rank :: self.world])


class AccelerateShard(RandomShard):
    """The order Accelerate 1.15 gives a shuffled DataLoader on several processes (BatchSamplerShard and its
    synchronized generator), written out; trainforge's Accelerator follows it. Built where the loader is prepared:
    a generator seeded by one draw of the global RNG. At each epoch start: the worker base seed from the global RNG,
    rank 0's generator state on every rank, two randperm from it (RandomSampler's); the epoch cut into rounds of
    one batch per rank, rank r taking the r-th batch of each, the last round completed by wrapping around to the
    epoch's start."""

    def __init__(self, n, rank, world):
        super().__init__(n, rank, world)
        self.g = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_()))
        self.total = -(-n // (BATCH * world)) * BATCH * world

    def __iter__(self):
        torch.empty((), dtype=torch.int64).random_()  # the worker base seed
        state = self.g.get_state()
        dist.broadcast(state, 0)
        self.g.set_state(state)
        order = torch.randperm(self.n, generator=self.g).tolist()
        torch.randperm(self.n, generator=self.g)
        order = [order[p % self.n] for p in range(self.total)]
        return iter([order[p] for p in range(self.total) if p // BATCH % self.world == self.rank])


def raw_ddp(net, accum, shard=RandomShard):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(net)
    ds = regression_data()
    loader = DataLoader(
        ds, batch_size=BATCH, sampler=shard(len(ds), rank, world), generator=torch.Generator()
    )  # the sampler makes the global draws
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for epoch in range(EPOCHS):
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accum == 0 or i + 1 == len(loader)
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = nn.functional.mse_loss(model(x), y) / accum
                loss.backward()
            if last:
                opt.step()
                opt.zero_grad()
    return net


def via_trainer(net, accum, root):
    module = Regressor(net)
    trainer = Trainer(
        max_epochs=EPOCHS,
        accumulate_grad_batches=accum,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=BATCH, shuffle=True))
    assert trainer.strategy.name == "ddp" and trainer.world_size == 2
    return module.net


def via_accelerator(net, accum):
    acc = Accelerator(gradient_accumulation_steps=accum)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(net, opt, DataLoader(regression_data(), batch_size=BATCH, shuffle=True))
    for _ in range(EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
    return acc.unwrap_model(model)


def main(out_dir):
    seed_everything(0)
    initial = make_net()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    results = {}
    for accum in (1, 2):
        seed_everything(1)  # each run starts from the same random state: the shuffle order draws from it
        results[f"raw_accum{accum}"] = raw_ddp(copy.deepcopy(initial), accum)
        seed_everything(1)
        results[f"trainer_accum{accum}"] = via_trainer(copy.deepcopy(initial), accum, os.path.join(out_dir, "root"))
        seed_everything(1)
        results[f"raw_accelerate_accum{accum}"] = raw_ddp(copy.deepcopy(initial), accum, AccelerateShard)
        seed_everything(1)
        results[f"accelerator_accum{accum}"] = via_accelerator(copy.deepcopy(initial), accum)
    if dist.get_rank() == 0:
        for name, net in results.items():
            save_file(
                {k: v.contiguous() for k, v in net.state_dict().items()}, os.path.join(out_dir, name + ".safetensors")
            )
        save_file(
            {k: v.contiguous() for k, v in initial.state_dict().items()}, os.path.join(out_dir, "initial.safetensors")
        )


if __name__ == "__main__":
    main(sys.argv[1])
