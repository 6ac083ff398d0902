"""Accelerate's names on two processes (tests/trainer/test_accelerate_names.py): LocalSGD, the trigger,
get_logger, PartialState and the kwargs handlers. Writes OUT_DIR/rank<r>.json."""

import json
import logging
import os
import sys
from datetime import timedelta

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Accelerator
from trainforge.utils import (
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    LocalSGD,
    PartialState,
    get_logger,
    set_seed,
)

out_dir = sys.argv[1]
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
logger = get_logger(__name__)
accelerator = Accelerator(
    log_with="csv",
    project_dir=out_dir,
    kwargs_handlers=[
        DistributedDataParallelKwargs(find_unused_parameters=True),
        InitProcessGroupKwargs(timeout=timedelta(seconds=77)),
    ],
)
rank = accelerator.process_index
logger.info("logged by the main process")
logger.info("logged by every process", main_process_only=False)
state = PartialState()
record = {
    "distributed_type": str(accelerator.distributed_type),
    "state": [state.num_processes, state.process_index],
    "is_last": accelerator.is_last_process,
    "timeout": accelerator.strategy.timeout.total_seconds(),
}

set_seed(0)
model = nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
record["find_unused_parameters"] = model.find_unused_parameters


def params():
    return [float(x) for p in accelerator.unwrap_model(model).parameters() for x in p.detach().flatten()]


x = torch.full((4, 2), float(rank + 1))  # each rank its own data: local steps differ
with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2) as local_sgd:
    for step in range(2):
        loss = model(x).pow(2).mean() * (rank + 1)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            record["before_average"] = params()
        local_sgd.step()
record["after"] = params()

trigger = [accelerator.check_trigger()]
if rank == 1:
    accelerator.set_trigger()
trigger += [accelerator.check_trigger(), accelerator.check_trigger()]
record["trigger"] = trigger
accelerator.init_trackers("names", config={"lr": 0.1})
tracker = accelerator.get_tracker("csv")  # every rank may call it, as in Accelerate; only rank 0's writes
tracker.flush()
accelerator.log({"from_tracker": float(rank + 1)}, step=1)
record["tracker"] = type(tracker).__name__
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
accelerator.end_training()
