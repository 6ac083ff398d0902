"""An HF ``run_clm_no_trainer``-style Accelerator loop for the schedule-resume test.

The schedule is sized as those scripts size it: ``num_training_steps`` from the length of the
unsharded loader, warmup times ``num_processes``; the per-process batch is --global-batch // world
size. Rank 0 appends {step, lr} after each optimizer step to ROOT/lr_{tag}.jsonl.

  --save-at S   save_state(ROOT/ckpt) after optimizer step S (the run goes on)
  --resume      load_state(ROOT/ckpt) first (with the same --save-at: the step it holds)
"""

import argparse
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from trainforge import Accelerator, seed_everything

p = argparse.ArgumentParser()
p.add_argument("root")
p.add_argument("--tag", required=True)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--accumulation", type=int, default=1)
p.add_argument("--save-at", type=int, default=0)
p.add_argument("--resume", action="store_true")
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()

seed_everything(0)
acc = Accelerator(gradient_accumulation_steps=args.accumulation)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
loader = DataLoader(data, batch_size=args.global_batch // acc.num_processes, shuffle=True)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
total = args.epochs * len(loader) // args.accumulation  # len of the unsharded loader: per-process units
warmup = 2 * acc.num_processes


def linear(step):  # transformers.get_linear_schedule_with_warmup
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


sched = torch.optim.lr_scheduler.LambdaLR(opt, linear)
model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
steps = start_epoch = 0
if args.resume:  # load_state puts the loader back mid-epoch; the script counts its own steps (as run_clm)
    acc.load_state(os.path.join(args.root, "ckpt"))
    steps = args.save_at
    start_epoch = steps * args.accumulation // len(loader)
out = open(os.path.join(args.root, f"lr_{args.tag}.jsonl"), "a") if acc.is_main_process else None
for epoch in range(start_epoch, args.epochs):
    for x, y in loader:
        with acc.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            steps += 1
            if out is not None:
                out.write(json.dumps({"step": steps, "lr": opt.param_groups[0]["lr"]}) + "\n")
                out.flush()
            if steps == args.save_at and not args.resume:
                acc.save_state(os.path.join(args.root, "ckpt"))
acc.end_training()
