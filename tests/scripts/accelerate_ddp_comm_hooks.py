"""Accelerate's DDP communication hooks on two processes (tests/trainer/test_accelerate_ddp_comm_hooks.py):
``DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType..., comm_wrapper=..., comm_state_option=...)``.
Each rank computes its own gradients (its own data) three times through a prepared model, and each rank's local
gradients are gathered, so the hooked gradients can be compared with what each hook computes. Writes
OUT_DIR/rank<r>.json: per hook, per backward, whether the gradients equal the fp32 mean, the fp16/bf16-compressed
mean, and the rank of the 16x16 weight gradient."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Accelerator, ConfigurationError
from trainforge.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

out_dir = sys.argv[1]
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
HOOKS = {
    "none": {},
    "fp16": {"comm_hook": DDPCommunicationHookType.FP16},
    "bf16": {"comm_hook": "bf16"},
    "power_sgd": {"comm_hook": DDPCommunicationHookType.POWER_SGD, "comm_state_option": {"start_powerSGD_iter": 2}},
    "power_sgd+fp16": {
        "comm_hook": DDPCommunicationHookType.POWER_SGD,
        "comm_wrapper": DDPCommunicationHookType.FP16,
        "comm_state_option": {"start_powerSGD_iter": 2},
    },
}


def grads(module):
    return [p.grad.detach().clone() for p in module.parameters()]


def compressed_mean(per_rank, dtype):
    """What the fp16/bf16 hooks compute: each rank's gradient cast and divided by the world size, summed in
    that type (two ranks: one addition, whatever the order), cast back."""
    return [(a.to(dtype) / 2 + b.to(dtype) / 2).float() for a, b in zip(*per_rank)]


def equal(xs, ys):
    return all(torch.equal(x, y) for x, y in zip(xs, ys))


record = {"use_distributed": Accelerator(cpu=True).use_distributed}
for name, kwargs in HOOKS.items():
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(**kwargs)])
    rank = accelerator.process_index
    local = copy.deepcopy(base)
    try:
        model = accelerator.prepare(copy.deepcopy(base))
    except ConfigurationError as err:  # bf16 on a torch without NCCL: refused by name
        record[name] = str(err)
        continue
    steps = []
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        local.zero_grad()
        local(x).pow(2).mean().backward()
        mine = grads(local)
        gathered = [[torch.empty_like(g) for g in mine] for _ in range(2)]
        for i, g in enumerate(mine):
            dist.all_gather([gathered[0][i], gathered[1][i]], g)
        model.zero_grad()
        accelerator.backward(model(x).pow(2).mean())
        hooked = grads(model)
        steps.append(
            {
                "mean": equal(hooked, [a / 2 + b / 2 for a, b in zip(*gathered)]),
                "fp16": equal(hooked, compressed_mean(gathered, torch.float16)),
                "bf16": equal(hooked, compressed_mean(gathered, torch.bfloat16)),
                "weight_rank": int(torch.linalg.matrix_rank(hooked[0])),
                "bias_mean": torch.allclose(hooked[1], (gathered[0][1] + gathered[1][1]) / 2, atol=1e-6),
            }
        )
        both = [torch.empty_like(hooked[0]) for _ in range(2)]
        dist.all_gather(both, hooked[0])
        steps[-1]["same_on_ranks"] = torch.equal(both[0], both[1])
    record[name] = steps
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
