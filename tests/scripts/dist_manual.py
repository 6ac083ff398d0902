"""Launched on 2 processes: manual optimization with two optimizers under DDP (Lightning's GAN
pattern; DDP needs find_unused_parameters=True, each backward touching one player). Rank 0 writes
whether the ranks' weights agree, the global step and the raw-loop comparison to OUT."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers.models import make_net, regression_data
from tests.trainer.test_manual_optimization import TwoNets
from trainforge import Trainer, seed_everything
from trainforge.strategies import DDPStrategy


def main(out):
    seed_everything(0)
    g0, d0 = make_net(), make_net()
    module = TwoNets(copy.deepcopy(g0), copy.deepcopy(d0))
    trainer = Trainer(
        strategy=DDPStrategy(find_unused_parameters=True),
        max_epochs=1,
        default_root_dir=out + ".root",
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    loader = DataLoader(regression_data(n=32), batch_size=4)  # unshuffled: the raw loop below shards the same way
    trainer.fit(module, loader)
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    both = trainer.strategy.all_gather(weights)
    # the same with raw DDP: each rank takes positions rank, rank + 2, ... of the sequential order
    rank, world = dist.get_rank(), dist.get_world_size()
    g, d = DistributedDataParallel(copy.deepcopy(g0)), DistributedDataParallel(copy.deepcopy(d0))
    opt_g = torch.optim.AdamW(g.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(d.parameters(), lr=1e-1)
    sched = torch.optim.lr_scheduler.StepLR(opt_d, step_size=2, gamma=0.5)
    data = regression_data(n=32)
    for step in range(4):
        idx = [step * 8 + rank + world * j for j in range(4)]
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        loss_g = nn.functional.mse_loss(g(x), y)
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        loss_d = nn.functional.mse_loss(d(x), g(x).detach())
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        sched.step()
    raw = torch.cat([p.detach().flatten() for p in [*g.module.parameters(), *d.module.parameters()]])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "agree": bool(torch.equal(both[0], both[1])),
                    "global_step": trainer.global_step,
                    "matches_raw_ddp": bool(torch.equal(weights, raw)),
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1])
