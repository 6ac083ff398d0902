"""Run by `trainforge launch` in the CLI tests: a gloo all_reduce; each rank writes what it saw."""

import json
import os
import sys

import torch
import torch.distributed as dist

from trainforge.strategies.environment import default_backend, detect_environment
from trainforge.trainer.cli.launch_settings import launch_defaults


def main(out_dir: str) -> None:
    env = detect_environment()
    dist.init_process_group(default_backend("cpu"), init_method="env://")
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    record = {
        "rank": env.rank,
        "world_size": env.world_size,
        "kind": env.kind,
        "sum": value.item(),
        "defaults": launch_defaults(),
        "argv": sys.argv,
        "sys_path0": sys.path[0],
    }
    with open(os.path.join(out_dir, f"rank{env.rank}.json"), "w") as handle:
        json.dump(record, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--out") + 1])
