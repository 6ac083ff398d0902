"""A short run that checkpoints to object storage (tests/strategies/test_checkpoint_remote.py).

  --root URL         Trainer(default_root_dir=URL), e.g. s3://bucket/run (credentials and endpoint from the env)
  --max-steps N      stop after N optimizer steps (fit's own end: the checkpoint of step N is saved)
  --every K          ModelCheckpoint(every_n_steps=K)
  --keep K           ModelCheckpoint(keep_last_k=K)
  --resume           Trainer(resume="auto"): continue from the newest valid checkpoint in the bucket
  --async-save       ModelCheckpoint(async_save=True): the upload runs in the background
  --strategy S       Trainer(strategy=S) (ddp or fsdp on 2 processes: FSDP writes DCP shards)
  --one-per-node     describe each rank as alone on its node (LOCAL_WORLD_SIZE=1, GROUP_RANK=RANK), as on
                     several machines: each "node" stages in its own directory and uploads its own files
  --out FILE         rank 0 writes the final weights there (safetensors), and the resumed step to FILE.json
Dropout on and shuffling on, so an inexact resume shows in the weights.
"""

import argparse
import json
import os
import sys

from safetensors.torch import save_file
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer, seed_everything
from trainforge.callbacks import ModelCheckpoint


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--keep", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--one-per-node", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.one_per_node:  # what torchrun sets on each of WORLD_SIZE machines of one process
        os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", GROUP_RANK=os.environ["RANK"])
    seed_everything(3)
    module = Regressor(make_net(dropout=0.2))
    loader = DataLoader(regression_data(64), batch_size=8, shuffle=True)
    ckpt = ModelCheckpoint(every_n_steps=a.every, keep_last_k=a.keep, async_save=a.async_save)
    trainer = Trainer(
        strategy=a.strategy,
        max_steps=a.max_steps,
        default_root_dir=a.root,
        callbacks=[ckpt],
        resume="auto" if a.resume else None,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        seed=3,
    )
    trainer.fit(module, loader)
    if a.one_per_node:  # the writer saw two nodes: each staged and uploaded its own files
        from trainforge.strategies.checkpoint.remote_write import placement

        assert placement(trainer.global_rank, trainer.world_size) == (trainer.global_rank, 0, 1)
    full = trainer.strategy.module_state_dict(trainer.model)  # collective: consolidated on rank 0 (FSDP)
    if trainer.is_global_zero:
        weights = {k: v.detach().cpu().contiguous() for k, v in full.items()}
        save_file(weights, a.out)
        with open(a.out + ".json", "w") as f:
            json.dump({"final_step": trainer.global_step, "last_path": ckpt.last_path}, f)


if __name__ == "__main__":
    main()
