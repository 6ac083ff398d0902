"""Data order follows the user, as torch's RandomSampler does: the DataLoader's generator when
given, else the global torch RNG (``seed_everything``); on one process the order is exactly the
plain DataLoader's, and the random stream after the loop is the plain loop's too.

Accelerate: on one process a prepared loader iterates like the DataLoader it was given
(test_data_loader / test_script "dl_preparation"); Lightning: ``seed_everything(s)`` decides the
shuffle order."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Accelerator, Trainer, TrainingModule, seed_everything

DATA = TensorDataset(torch.arange(40))


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
