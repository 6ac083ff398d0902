"""An Accelerate ``examples/by_feature``-like program (tests/trainer/test_accelerate_sharding.py): a tiny
model with dropout over variable-length sequences padded per batch by the collate function, shuffled,
gradient accumulation, an evaluation with ``gather_for_metrics``; only the imports differ between
``--backend accelerate`` (HF Accelerate, to record its figures) and trainforge. Rank 0 prints
``WEIGHTS <sha256 of the final parameters' bytes>``, ``EVAL <samples gathered> <correct>`` and the losses."""

import hashlib
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

BACKEND = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "trainforge"
SPLIT = "--split_batches" in sys.argv
if BACKEND == "accelerate":
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
else:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from trainforge import Accelerator
    from trainforge.utils import DataLoaderConfiguration, set_seed


class Sequences(Dataset):
    """Sequences of 2..9 tokens; the label is whether their sum is odd."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            tokens = torch.randint(1, 20, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g)
            self.items.append((tokens, int(tokens.sum()) % 2))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items):
    """Pads to the longest sequence of the batch (as tokenizer.pad does): the batch's make-up changes its shape."""
    longest = max(len(tokens) for tokens, _ in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    for row, (tokens, _) in enumerate(items):
        ids[row, : len(tokens)] = tokens
    return {"ids": ids, "labels": torch.tensor([label for _, label in items])}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1).float()
        pooled = (self.embed(ids) * mask).sum(1) / mask.sum(1)
        return self.head(pooled)


def main():
    config = DataLoaderConfiguration(split_batches=SPLIT)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=config)
    set_seed(42)
    model = Model()
    batch = 4 * accelerator.num_processes if SPLIT else 4
    train = DataLoader(Sequences(45, 1), batch_size=batch, shuffle=True, collate_fn=collate)
    evaluation = DataLoader(Sequences(19, 2), batch_size=batch, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    losses = []
    for _ in range(3):
        model.train()
        for step in train:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(step["ids"]), step["labels"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
    model.eval()
    seen = correct = 0
    for step in evaluation:
        with torch.no_grad():
            predictions = model(step["ids"]).argmax(-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, step["labels"]))
        seen += len(labels)
        correct += int((predictions == labels).sum())
    weights = accelerator.unwrap_model(model).state_dict()
    digest = hashlib.sha256(b"".join(weights[k].detach().cpu().numpy().tobytes() for k in sorted(weights)))
    if accelerator.is_main_process:
        print(f"WEIGHTS {digest.hexdigest()}")
        print(f"EVAL {seen} {correct}")
        print("LOSSES " + " ".join(f"{x:.6f}" for x in losses))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
