"""bf16 mixed precision under the Accelerator as Accelerate runs it (tests/trainer/test_accelerate_bf16.py): a tiny
BERT-like encoder (embeddings, LayerNorm, softmax attention, GELU, dropout, a classifier head), AdamW with a
linear warm-up, 30 steps on CPU. Only the import lines differ between ``--backend accelerate`` (HF Accelerate, to
record its figures), ``--backend trainforge`` and ``--backend by_hand`` (what Accelerate does, written out: the
model's forward under ``torch.autocast("cpu", torch.bfloat16)``, its outputs converted to float32, the loss's
backward outside autocast). Prints ``LOSSES <json>`` and ``WEIGHTS <sum of the final weights, float64>``."""

import json
import math
import os
import sys
from functools import wraps

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

VOCAB, LENGTH, WIDTH, HEADS = 50, 12, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.ff1, self.ff2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.1)

    def forward(self, h, mask):
        b, t, _ = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(WIDTH // HEADS) + (1.0 - mask[:, None, None, :]) * -1e4
        attended = (self.dropout(scores.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, WIDTH)
        h = self.norm1(h + self.dropout(self.out(attended)))
        return self.norm2(h + self.dropout(self.ff2(F.gelu(self.ff1(h)))))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, ids, mask, labels):
        h = self.embed(ids) + self.position(torch.arange(ids.shape[1]))
        for block in self.blocks:
            h = block(h, mask)
        logits = self.head(h[:, 0])
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (240, LENGTH), generator=g)
    lengths = torch.randint(4, LENGTH + 1, (240,), generator=g)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).float()
    return TensorDataset(ids, mask, (ids[:, 1] > VOCAB // 2).long())


class ByHand:
    """What Accelerate 1.15 does on one CPU process with mixed_precision="bf16" (prepare_model: the forward
    wrapped by torch.autocast(device_type="cpu", dtype=torch.bfloat16) and convert_outputs_to_fp32)."""

    def prepare(self, model, optimizer, loader, scheduler):
        forward = model.forward

        @wraps(forward)
        def autocast_forward(*args, **kwargs):
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                out = forward(*args, **kwargs)
            return {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in out.items()}

        model.forward = autocast_forward
        return model, optimizer, loader, scheduler

    def backward(self, loss):
        loss.backward()


def library(backend):
    """(Accelerator class, set_seed) of ``backend``; only these imports differ."""
    if backend == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import set_seed
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
        from trainforge import Accelerator
        from trainforge.utils import set_seed
    return Accelerator, set_seed


def train(backend):
    """(the 30 losses, the sum of the final weights) under ``backend``."""
    if backend == "by_hand":
        accelerator = ByHand()
        torch.manual_seed(42)
    else:
        Accelerator, set_seed = library(backend)
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        set_seed(42)
    model = Encoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    loader = DataLoader(data(), batch_size=8, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    model.train()
    for ids, mask, labels in loader:
        loss = model(ids, mask, labels)["loss"]
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, sum(float(p.detach().double().sum()) for p in model.parameters())


if __name__ == "__main__":
    losses, weights = train(sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "trainforge")
    print("LOSSES " + json.dumps(losses))
    print(f"WEIGHTS {weights!r}", flush=True)
