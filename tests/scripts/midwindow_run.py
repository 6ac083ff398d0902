"""Resume from a checkpoint written inside an accumulation window (trainer/checkpoint/partial_grads.py), shared by
tests/trainer/test_midwindow_resume.py (in process) and run by it on 2 processes:

    trainforge launch --nproc-per-node 2 tests/scripts/midwindow_run.py OUT_DIR

The Accelerator's loop, 4 accumulation steps, both loss modes (mean of means; summed with num_items):
an uninterrupted run, a run that saves after micro-batch 2 of its second window and ends there, and a
run in a new Accelerator that loads that checkpoint and continues; rank 0 writes the final weights of
the uninterrupted and the resumed run to ``OUT_DIR/weights.pt``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Accelerator

ACCUM, BATCH, CUT = 4, 2, 6  # micro-batch 6 is the 2nd of the 2nd window: a save inside it


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, generator=g)
    y = torch.randint(0, 3, (64,), generator=g)
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.drop, self.head = nn.Linear(6, 16), nn.Dropout(0.2), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.body(x))))


def loss_of(model: nn.Module, batch, summed: bool):
    x, y = batch
    n = int(y.numel()) - int(y[0]) % 2  # uneven item counts: the first item left out when its label is odd
    out = model(x)
    if summed:
        return F.cross_entropy(out[-n:], y[-n:], reduction="sum"), n
    return F.cross_entropy(out, y), None


def train(ckpt: Path, phase: str, summed: bool) -> Optional[Dict[str, torch.Tensor]]:
    """``phase``: "full" (uninterrupted), "cut" (save at micro-batch CUT, then stop), "resume"."""
    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    if phase == "resume":
        acc.load_state(str(ckpt))
    for seen, batch in enumerate(loader, 1):
        with acc.accumulate(model):
            loss, n = loss_of(model, batch, summed)
            acc.backward(loss, num_items=n)
            opt.step()
            opt.zero_grad()
        if phase == "cut" and seen == CUT:
            acc.save_state(str(ckpt))
            return None
    # no end_training: under DDP every phase shares the one process group (tearing it down between
    # phases and starting a new one races between ranks); it is released at exit
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def compare(root: Path, summed: bool) -> Dict[str, Dict[str, torch.Tensor]]:
    full = train(root / "unused", "full", summed)
    train(root / "ckpt", "cut", summed)
    resumed = train(root / "ckpt", "resume", summed)
    assert full is not None and resumed is not None
    return {"full": full, "resumed": resumed}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    results = {mode: compare(out / mode, mode == "summed") for mode in ("mean", "summed")}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        sys.exit(0)
    torch.save(results, out / "weights.pt")
