"""Started by `trainforge launch` on two one-process "nodes" with only a cluster's variables
(tests/trainer/test_cluster_env.py): a short DDP fit; each rank writes where it sat and its weights."""

import hashlib
import json
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer, seed_everything
from trainforge.strategies.environment import detect_environment


def main(out_dir: str) -> None:
    seed_everything(7)
    env = detect_environment()
    module = Regressor(make_net())
    before = [p.detach().clone() for p in module.parameters()]
    trainer = Trainer(
        accelerator="cpu",
        max_steps=4,
        default_root_dir=out_dir,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(module, DataLoader(regression_data(n=32), batch_size=4, shuffle=True))
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    record = {
        "rank": env.rank,
        "world_size": env.world_size,
        "node_rank": env.node_rank,
        "strategy": trainer.strategy.name,
        "step": trainer.global_step,
        "changed": any(not torch.equal(a, b) for a, b in zip(before, module.parameters())),
        "weights": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
    }
    with open(os.path.join(out_dir, f"rank{env.rank}.json"), "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--out") + 1])
