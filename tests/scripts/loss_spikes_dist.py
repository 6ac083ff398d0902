"""Launched on 2 processes (gloo): LossSpikes with a NaN sample that only one rank reads. Rank 0 writes
to OUT what each rank saw (a NaN loss or not), skipped and stepped, and whether the weights agree."""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer, seed_everything
from trainforge.callbacks import LossSpikes


def main(out):
    seed_everything(0)
    x, y = regression_data(n=32).tensors
    x = x.clone()
    x[5] = float("nan")  # sample 5: one rank's shard
    module = Regressor(make_net())
    spikes = LossSpikes(threshold=10.0, window=2)
    trainer = Trainer(
        strategy="ddp",
        max_epochs=1,
        callbacks=[spikes],
        default_root_dir=out + ".root",
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    both = trainer.strategy.all_gather(weights)
    saw_nan = any(not torch.isfinite(v).all() for v in module.losses)
    row = [saw_nan, spikes.skipped_steps, trainer.global_step, len(module.losses)]
    rows = trainer.strategy.all_gather_object(row)
    if trainer.is_global_zero:
        result = {"rows": rows, "agree": bool(torch.equal(both[0], both[1])), "finite": bool(weights.isfinite().all())}
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
