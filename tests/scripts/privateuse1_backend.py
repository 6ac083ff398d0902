"""Run in a fresh process: registers a PrivateUse1 accelerator named "tpu" (as torch-tpu does) with
torch's own python-backend registration and a "tpu" process-group backend (built on gloo, since this
machine has no TPU), then starts trainforge's strategies with accelerator='auto' and prints what they
chose. Nothing of trainforge names "tpu": it must come from torch.accelerator."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

_setup_privateuseone_for_python_backend("tpu")


def _gloo_for_tpu(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


dist.Backend.register_backend("tpu", _gloo_for_tpu, devices=["tpu"])

from trainforge.strategies import DDPStrategy, SingleDeviceStrategy
from trainforge.strategies.devices import default_device, normalize_accelerator
from trainforge.strategies.environment import default_backend
from trainforge.strategies.errors import ConfigurationError

out = {
    "current": str(torch.accelerator.current_accelerator()),
    "normalized": normalize_accelerator("TPU"),
    "auto_device": str(default_device("auto", 0)),
    "backend": default_backend("tpu:0"),
}
try:
    default_device("auto", local_rank=torch.accelerator.device_count())
except ConfigurationError as error:
    out["rank_error"] = str(error)
single = SingleDeviceStrategy()
single.setup_environment()
out["single_device"] = str(single.root_device)
os.environ.update(
    RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1]
)
ddp = DDPStrategy()
ddp.setup_environment()
out["ddp_device"], out["ddp_backend"] = str(ddp.root_device), dist.get_backend()
ddp.teardown()
pinned = DDPStrategy()
pinned.setup_environment("cpu")  # the Trainer(accelerator="cpu") choice still pins the CPU and gloo
out["cpu_device"], out["cpu_backend"] = str(pinned.root_device), dist.get_backend()
pinned.teardown()
print(json.dumps(out))
