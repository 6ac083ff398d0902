"""Two processes (gloo): rank 1 "runs out of memory" above batch size 8, rank 0 above 32; the decorator
and the tuner must settle on 8 on both. Started by tests/trainer/test_tuner.py."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))

from test_tuner import Regression

from trainforge import Trainer, Tuner
from trainforge.utils import find_executable_batch_size

rank = int(os.environ["RANK"])
limit = 8 if rank == 1 else 32
out = os.environ["TUNER_OUT"]
trainer = Trainer(
    strategy="ddp",
    accelerator="cpu",
    max_steps=2,
    default_root_dir=os.path.join(out, "run"),
    enable_progress_bar=False,
    logger=False,
)


@find_executable_batch_size(starting_batch_size=64)
def attempt(batch_size):
    if batch_size > limit:
        raise torch.OutOfMemoryError(f"CUDA out of memory (simulated on rank {rank})")
    return batch_size  # no collective inside an attempt: one rank may have skipped it (see the docstring)


size = attempt()
sizes = [None, None]
torch.distributed.all_gather_object(sizes, size)  # after the search every rank goes on together, same size
assert sizes == [size, size], sizes
found = [f"decorator={size}"]
for mode in ("power", "binsearch"):
    found.append(f"{mode}={Tuner(trainer).scale_batch_size(Regression(limit=limit), mode=mode, init_val=2)}")
with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
    f.write(" ".join(found))
