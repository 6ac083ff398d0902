"""Data order follows the user, as torch's RandomSampler does: the DataLoader's generator when
given, else the global torch RNG (``seed_everything``); on one process the order is exactly the
plain DataLoader's, and the random stream after the loop is the plain loop's too.

Accelerate: on one process a prepared loader iterates like the DataLoader it was given
(test_data_loader / test_script "dl_preparation"); Lightning: ``seed_everything(s)`` decides the
shuffle order."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

from trainforge import Accelerator, Trainer, TrainingModule, seed_everything
from trainforge.strategies.data.loader import prepare_dataloader
from trainforge.strategies.precision import Precision
from trainforge.trainer.accelerator.wrappers import GradientState, PreparedDataLoader

DATA = TensorDataset(torch.arange(40))


class Augmented(Dataset):
    """Random augmentation in ``__getitem__`` (torch, python ``random``, numpy); the last column is
    the worker's seed (int64: a float64 would round ``base + 1`` to ``base``)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        info = get_worker_info()
        noise = [torch.rand(()), torch.tensor(random.random()), torch.tensor(np.random.rand())]
        bits = [x.to(torch.float64).view(torch.int64) for x in noise]  # bit for bit
        return torch.stack([torch.tensor(i), *bits, torch.tensor(info.seed if info else -1)])


def _augmented(epochs: int, prepare=None):
    loader = DataLoader(Augmented(), batch_size=3, shuffle=True, num_workers=2)
    loader = prepare(loader) if prepare is not None else loader
    return torch.cat([b for _ in range(epochs) for b in loader])


def _plain(epochs: int, generator=None, workers: int = 0):
    loader = DataLoader(DATA, batch_size=4, shuffle=True, generator=generator, num_workers=workers)
    return [b[0].tolist() for _ in range(epochs) for b in loader]


def _prepared(epochs: int, generator=None, workers: int = 0):
    loader = Accelerator().prepare(
        DataLoader(DATA, batch_size=4, shuffle=True, generator=generator, num_workers=workers)
    )
    return [b[0].tolist() for _ in range(epochs) for b in loader]


def test_one_process_order_is_the_plain_dataloaders_and_the_global_stream_continues_the_same():
    for workers in (0, 2):
        seed_everything(21)
        plain, after_plain = _plain(3, workers=workers), torch.rand(3)
        seed_everything(21)
        prepared, after_prepared = _prepared(3, workers=workers), torch.rand(3)
        assert prepared == plain
        assert torch.equal(after_prepared, after_plain), "the global random stream moved differently"


def test_seed_everything_changes_the_order():
    seed_everything(21)
    first = _prepared(1)
    seed_everything(42)
    assert _prepared(1) != first


def test_the_users_generator_decides_the_order_and_advances_as_the_plain_loaders():
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    seed_everything(0)
    plain = _plain(2, generator=g1)
    seed_everything(1)  # the global stream is not used when a generator is given
    assert _prepared(2, generator=g2) == plain
    assert torch.equal(g1.get_state(), g2.get_state())
    assert _prepared(1, generator=torch.Generator().manual_seed(6)) != plain[:10]


class _Collect(TrainingModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].tolist())
        return (self.w * batch[0].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_trainer_order_is_the_plain_dataloaders(tmp_path):
    """Lightning: on one process the Trainer iterates the user's DataLoader as it is."""
    seed_everything(3)
    module = _Collect()  # no random draws in __init__: the plain loop below starts from the same state
    Trainer(
        max_epochs=2,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    ).fit(module, DataLoader(DATA, batch_size=4, shuffle=True))
    seed_everything(3)
    assert module.seen == _plain(2)


def test_one_process_workers_get_the_plain_dataloaders_seeds():
    """Accelerate's cv_example: the same augmentation as a plain DataLoader (workers seeded base + i,
    base drawn as the plain loader draws it), epoch after epoch."""
    seed_everything(21)
    plain, after_plain = _augmented(2), torch.rand(3)
    seed_everything(21)
    prepared, after_prepared = _augmented(2, Accelerator().prepare), torch.rand(3)
    assert torch.equal(prepared, plain)
    assert torch.equal(after_prepared, after_plain)


def test_each_rank_gets_its_own_worker_seeds_rank_0_the_plain_ones():
    def on_rank(rank):
        seed_everything(5)  # every process seeded alike
        sharded = prepare_dataloader(
            DataLoader(Augmented(), batch_size=3, shuffle=True, num_workers=2), rank=rank, world_size=2
        )
        sharded.generator = torch.Generator()  # as Accelerator.prepare_data_loader does
        loader = PreparedDataLoader(sharded, torch.device("cpu"), GradientState(), Precision())
        return {int(seed) for b in loader for seed in b[:, 4]}

    seed_everything(5)
    plain = {int(seed) for seed in _augmented(1)[:, 4]}
    rank0, rank1 = on_rank(0), on_rank(1)
    assert rank0 == plain and len(rank1) == 2 and not rank0 & rank1


def test_trainer_batches_with_augmenting_workers_are_the_plain_dataloaders(tmp_path):
    """Lightning (seed_everything's default, workers=False) leaves a plain DataLoader's worker seeds."""
    seen = []

    class Record(_Collect):
        def training_step(self, batch, batch_idx):
            seen.append(batch.clone())
            return (self.w * batch.sum()).sum()

    seed_everything(3)
    module = Record()
    Trainer(max_epochs=2, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False).fit(
        module, DataLoader(Augmented(), batch_size=3, shuffle=True, num_workers=2)
    )
    seed_everything(3)
    assert torch.equal(torch.cat(seen), _augmented(2))


def test_resumed_mid_epoch_the_workers_keep_their_seeds_and_the_next_epoch_is_the_same(tmp_path):
    """What resume restores with workers: the order, each batch's worker and its seed (torchdata saves
    the base seed), each worker's random streams where its last batch handed out left them (trainforge
    saves them: strategies/data/worker_rng.py), so the rest of the epoch's augmentation too, and the
    next epoch, bit for bit."""

    def build():
        acc = Accelerator()
        return acc, acc.prepare(DataLoader(Augmented(), batch_size=3, shuffle=True, num_workers=2))

    seed_everything(4)
    _, loader = build()
    whole = torch.cat([b for _ in range(2) for b in loader])
    seed_everything(4)
    acc, loader = build()
    first = []
    for batch in loader:
        first.append(batch)
        if len(first) == 2:
            break
    acc.save_state(str(tmp_path / "state"))
    seed_everything(99)  # a new process starts elsewhere
    acc, loader = build()
    acc.load_state(str(tmp_path / "state"))
    resumed = torch.cat(first + list(loader) + list(loader))
    assert torch.equal(resumed[:, [0, 4]], whole[:, [0, 4]])  # sample indices, worker seeds
    assert torch.equal(resumed, whole)  # augmentation included, in the saved epoch and the next
