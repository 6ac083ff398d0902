"""A prepared loader reads one batch ahead, as Accelerate's DataLoaderShard (a collate or dataset that draws
from the global RNG then draws where Accelerate's does). The batch read ahead was made under RNG states a
checkpoint taken at the previous step has already passed; ``save_state`` keeps them and the resumed pass makes
that batch again under them, so the resumed run is the uninterrupted one bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from trainforge import Accelerator

EPOCHS, BATCHES = 2, 8


class Augmented(Dataset):
    """Random augmentation from the global generators (torch and Python's), as a transform would draw."""

    def __len__(self):
        return BATCHES * 4

    def __getitem__(self, i):
        x = torch.full((4,), i / 32) + torch.rand(4) + random.random()
        return x, torch.tensor([float(i % 3)])


def train(root, stop_at=None, resume=False, stream=False):
    torch.manual_seed(0)
    random.seed(0)
    acc = Accelerator()
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = (
        DataLoader(AugmentedStream(), batch_size=4) if stream else DataLoader(Augmented(), batch_size=4, shuffle=True)
    )
    model, opt, loader = acc.prepare(model, opt, data)
    if resume:
        acc.load_state(str(root))
    while loader.epoch < EPOCHS:
        epoch = loader.epoch
        for x, y in loader:
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            if (epoch, loader.batch_in_epoch) == stop_at:
                acc.save_state(str(root))
                return None
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
@pytest.mark.parametrize("stop_at", [(0, 3), (0, BATCHES), (1, 5)], ids=["mid-epoch", "epoch-end", "second-epoch"])
def test_resume_with_an_augmenting_dataset_is_exact(tmp_path, stop_at, stream):
    uninterrupted = train(tmp_path / "unused", stream=stream)
    train(tmp_path / "ckpt", stop_at=stop_at, stream=stream)
    resumed = train(tmp_path / "ckpt", resume=True, stream=stream)
    assert torch.equal(resumed, uninterrupted)


class AugmentedStream(IterableDataset):
    """A stream with a resumable position whose samples draw from the global RNG."""

    def __init__(self):
        self.start = 0

    def __iter__(self):
        data = Augmented()
        for i in range(self.start, len(data)):
            self.start = i + 1
            yield data[i]
        self.start = 0

    def state_dict(self):
        return {"start": self.start}

    def load_state_dict(self, state):
        self.start = state["start"]
