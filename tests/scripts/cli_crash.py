"""Run by `trainforge launch` in the CLI tests: rank 1 raises while rank 0 hangs (sleeps).

Rank 1 writes the time of its crash to the file given as the first argument, if any.
"""

import sys
import time

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == 1:
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as handle:
                handle.write(repr(time.time()))
        raise RuntimeError("rank one exploded on purpose")
    time.sleep(120)  # a hang: torchrun must stop this rank as soon as rank 1 fails
