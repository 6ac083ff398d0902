"""The training loop of HF transformers' run_clm_no_trainer.py with its checkpoint and resume code (the
arithmetic of ``--resume_from_checkpoint .../step_<n>`` and ``skip_first_batches``, as upstream), on a
tiny model and local data, shuffled, dropout on. ``--backend accelerate`` runs the same on HF Accelerate
(for comparison by hand; trainforge never depends on it). The main process writes the final weights to
OUTPUT_DIR/final.pt and prints ``FINAL completed_steps=<n>`` and ``WEIGHTS <sha256 of their bytes>``."""

import argparse
import hashlib
import math
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--output_dir", required=True)
p.add_argument("--backend", default="trainforge", choices=["trainforge", "accelerate"])
p.add_argument("--gradient_accumulation_steps", type=int, default=2)
p.add_argument("--num_train_epochs", type=int, default=3)
p.add_argument("--checkpointing_steps", default=None)  # an int, or "epoch"
p.add_argument("--resume_from_checkpoint", default=None)
p.add_argument("--samples", type=int, default=48)
p.add_argument("--per_device_train_batch_size", type=int, default=4)
# "plain": save when `completed_steps % checkpointing_steps == 0` without `and accelerator.sync_gradients`, as
# earlier versions of run_clm_no_trainer.py and many copies of it do: step_<n> is then written again on the next
# micro-batch (inside an accumulation window), and that is the checkpoint a resume reads
p.add_argument("--save_check", default="sync", choices=["sync", "plain"])
p.add_argument("--skip_offset", type=int, default=0)  # tests: a skip count other than the script's
args = p.parse_args()

if args.backend == "accelerate":
    from accelerate import Accelerator
    from accelerate.utils import set_seed
else:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from trainforge import Accelerator
    from trainforge import seed_everything as set_seed


class Data(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
set_seed(42)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
train_dataloader = DataLoader(Data(args.samples), shuffle=True, batch_size=args.per_device_train_batch_size)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / (max_train_steps + 1)))
model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)

checkpointing_steps = args.checkpointing_steps
if checkpointing_steps is not None and checkpointing_steps.isdigit():
    checkpointing_steps = int(checkpointing_steps)

# ---- from here on as in run_clm_no_trainer.py ----
completed_steps = 0
starting_epoch = 0
resume_step = None
if args.resume_from_checkpoint:
    checkpoint_path = args.resume_from_checkpoint
    path = os.path.basename(checkpoint_path)
    accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
    accelerator.load_state(checkpoint_path)
    training_difference = os.path.splitext(path)[0]
    if "epoch" in training_difference:
        starting_epoch = int(training_difference.replace("epoch_", "")) + 1
        resume_step = None
        completed_steps = starting_epoch * num_update_steps_per_epoch
    else:
        # need to multiply `gradient_accumulation_steps` to reflect real steps
        resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step // args.gradient_accumulation_steps
        resume_step -= starting_epoch * len(train_dataloader)
        resume_step += args.skip_offset

for epoch in range(starting_epoch, args.num_train_epochs):
    model.train()
    if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
        active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
    else:
        active_dataloader = train_dataloader
    for step, batch in enumerate(active_dataloader):
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
        if (
            isinstance(checkpointing_steps, int)
            and completed_steps % checkpointing_steps == 0
            and (accelerator.sync_gradients or args.save_check == "plain")
        ):
            accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
        if completed_steps >= max_train_steps:
            break
    if checkpointing_steps == "epoch":
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

accelerator.wait_for_everyone()
if accelerator.is_main_process:
    weights = accelerator.unwrap_model(model).state_dict()
    torch.save({k: v.detach().cpu().clone() for k, v in weights.items()}, os.path.join(args.output_dir, "final.pt"))
    print(f"FINAL completed_steps={completed_steps}")
    print(
        "WEIGHTS "
        + hashlib.sha256(b"".join(weights[k].detach().cpu().numpy().tobytes() for k in sorted(weights))).hexdigest()
    )
accelerator.end_training()
