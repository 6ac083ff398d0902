"""HF Accelerate's examples/by_feature/tracking.py (nlp_example.py with experiment tracking), as written
upstream, on a tiny text classifier and local synthetic data instead of BERT on GLUE MRPC (accuracy and
F1 by hand instead of `evaluate`). Only the import lines differ between ``--backend trainforge`` and
``--backend accelerate`` (HF Accelerate, for comparison by hand; trainforge never depends on it).
Prints ``RESULT <json>`` on the main process: per-epoch metrics and the final weights' sum.
"""

import argparse
import json
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--backend", default="trainforge", choices=["trainforge", "accelerate"])
p.add_argument("--mixed_precision", default="no")
p.add_argument("--cpu", action="store_true")
p.add_argument("--with_tracking", action="store_true")
p.add_argument("--log_with", default="all")
p.add_argument("--project_dir", default="logs")
p.add_argument("--num_epochs", type=int, default=3)
args = p.parse_args()

if args.backend == "accelerate":
    from accelerate import Accelerator, DistributedType
    from accelerate.logging import get_logger
    from accelerate.utils import set_seed
else:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from trainforge import Accelerator, DistributedType
    from trainforge.utils import get_logger, set_seed

logger = get_logger(__name__)
MAX_GPU_BATCH_SIZE = 4
EVAL_BATCH_SIZE = 5
VOCAB, LENGTH = 32, 8


class Pairs(Dataset):
    """Token sequences of varying length; the label says whether most valid tokens are below VOCAB/2."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(3, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        low = ((self.ids < VOCAB // 2) & (self.mask == 1)).sum(1)
        self.labels = (2 * low > lengths).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Output(dict):
    __getattr__ = dict.__getitem__


class TinyClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask, labels=None):
        hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        pooled = hidden.sum(1) / attention_mask.sum(1, keepdim=True)
        logits = self.head(self.dropout(pooled))
        return Output(loss=F.cross_entropy(logits, labels) if labels is not None else None, logits=logits)


def get_dataloaders(accelerator, batch_size=16):
    with accelerator.main_process_first():
        train, evaluation = Pairs(40, 1), Pairs(18, 2)
    train_dataloader = DataLoader(train, shuffle=True, batch_size=batch_size, drop_last=True)
    eval_dataloader = DataLoader(evaluation, shuffle=False, batch_size=EVAL_BATCH_SIZE, drop_last=False)
    return train_dataloader, eval_dataloader


def linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):  # transformers' formula
    def lr_lambda(step):
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def accuracy_f1(predictions, references):
    accuracy = (predictions == references).float().mean().item()
    tp = ((predictions == 1) & (references == 1)).sum().item()
    fp = ((predictions == 1) & (references == 0)).sum().item()
    fn = ((predictions == 0) & (references == 1)).sum().item()
    return accuracy, (2 * tp / (2 * tp + fp + fn) if tp else 0.0)


def training_function(config, args):  # noqa: C901, PLR0915 - Accelerate's example as written upstream
    if args.with_tracking:
        accelerator = Accelerator(
            cpu=args.cpu, mixed_precision=args.mixed_precision, log_with=args.log_with, project_dir=args.project_dir
        )
    else:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    logger.info(accelerator.state, main_process_only=False)
    lr, num_epochs, seed, batch_size = (
        config["lr"],
        int(config["num_epochs"]),
        int(config["seed"]),
        config["batch_size"],
    )

    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE and accelerator.distributed_type != DistributedType.XLA:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = TinyClassifier()
    model = model.to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = linear_schedule_with_warmup(
        optimizer,
        num_warmup_steps=2,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if args.with_tracking:
        run = os.path.split(__file__)[-1].split(".")[0]
        accelerator.init_trackers(run, config)

    epochs = []
    for epoch in range(num_epochs):
        model.train()
        if args.with_tracking:
            total_loss = 0
        for step, batch in enumerate(train_dataloader):
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            outputs = model(**batch)
            loss = outputs.loss
            if args.with_tracking:
                total_loss += loss.detach().float()
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

        model.eval()
        all_predictions, all_references = [], []
        for step, batch in enumerate(eval_dataloader):
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            all_predictions.append(predictions)
            all_references.append(references)
        accuracy, f1 = accuracy_f1(torch.cat(all_predictions), torch.cat(all_references))
        accelerator.print(f"epoch {epoch}:", {"accuracy": accuracy, "f1": f1})
        record = {"accuracy": accuracy, "f1": f1, "evaluated": len(torch.cat(all_references))}
        if args.with_tracking:
            record["train_loss"] = total_loss.item() / len(train_dataloader)
            accelerator.log(
                {"accuracy": accuracy, "f1": f1, "train_loss": record["train_loss"], "epoch": epoch}, step=epoch
            )
        epochs.append(record)

    if args.with_tracking:
        accelerator.end_training()
    weights = accelerator.unwrap_model(model).state_dict()
    if accelerator.is_main_process:
        result = {
            "epochs": epochs,
            "weights_sum": float(sum(v.double().sum() for v in weights.values())),
            "lr": lr_scheduler.get_last_lr()[0],
            "distributed_type": str(accelerator.distributed_type.value),
            "mixed_precision": accelerator.mixed_precision,
        }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    training_function({"lr": 2e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 8}, args)
