"""Accelerate's DummyOptim/DummyScheduler under the DeepSpeed strategy (tests/trainer/test_accelerate_ds_dummies.py):
the DeepSpeed config's optimizer (AdamW, torch's) and scheduler (WarmupLR, linear) sections, their "auto" values
from the stand-ins, on one CPU process (DS_ACCELERATOR=cpu). Then the same steps by hand: torch.optim.AdamW at the
learning rates DeepSpeed's scheduler gave. Writes OUT/result.json."""

import copy
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Accelerator
from trainforge.strategies import DeepSpeedStrategy
from trainforge.utils import DummyOptim, DummyScheduler

out_dir = sys.argv[1]
CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "warmup_type": "linear",
        },
    },
}
torch.manual_seed(0)
start = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
x, y = torch.randn(6, 4, 4), torch.randn(6, 4, 1)

accelerator = Accelerator(cpu=True, strategy=DeepSpeedStrategy(stage=1, config=CONFIG))
accelerator.update_run_settings(micro_batch_size=4)
model = copy.deepcopy(start)
optimizer = DummyOptim(model.parameters(), lr=0.1, weight_decay=0.01)
scheduler = DummyScheduler(optimizer, warmup_num_steps=4)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
lrs, losses = [], []
for step in range(6):
    loss = nn.functional.mse_loss(model(x[step]), y[step])
    accelerator.backward(loss)
    lrs.append(optimizer.param_groups[0]["lr"])
    optimizer.step()
    scheduler.step()  # DeepSpeed's engine stepped it already: a no-op, as in Accelerate
    optimizer.zero_grad()
    losses.append(loss.item())
trained = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]

reference = copy.deepcopy(start)
by_hand = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.01)
for step, lr in enumerate(lrs):
    for group in by_hand.param_groups:
        group["lr"] = lr
    nn.functional.mse_loss(reference(x[step]), y[step]).backward()
    by_hand.step()
    by_hand.zero_grad()
result = {
    "lrs": lrs,
    "last_lr": scheduler.get_last_lr(),
    "losses": losses,
    "max_diff": max(float((a - b).abs().max()) for a, b in zip(trained, reference.parameters())),
    "config_optimizer": accelerator.strategy.config["optimizer"],
    "config_scheduler": accelerator.strategy.config["scheduler"],
    "optimizer": type(optimizer.optimizer).__name__,
}
with open(os.path.join(out_dir, "result.json"), "w") as f:
    json.dump(result, f)
