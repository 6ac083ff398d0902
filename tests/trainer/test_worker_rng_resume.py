"""Exact mid-epoch resume with random augmentation inside DataLoader workers (num_workers > 0).

After a resume, worker ``w`` must continue its random streams (torch, python ``random``, numpy) from
where they were after the last batch it produced that the loop received, not from its seed: the
rest of the interrupted epoch is then augmented exactly as in the uninterrupted run. In process,
through the Trainer and through the Accelerator; the SIGKILL tests of test_resume.py cover the same
with the augmentation of tests/scripts/resume_run.py."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from trainforge import Accelerator, Trainer, TrainingModule, seed_everything
from trainforge.callbacks import Callback
from trainforge.trainer.accelerator.seed import worker_init_fn

N, BATCH = 24, 4  # 6 batches an epoch, 3 per worker


def _noise() -> torch.Tensor:
    return torch.rand(3) + random.random() + float(np.random.rand())


class Noisy(Dataset):
    """Map-style; ``x`` is the sample plus augmentation noise from the three random streams."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(i), self.x[i] + _noise(), self.y[i]


class NoisyStream(IterableDataset):
    """Each worker its own stream (samples w, w + workers, ...). Without state_dict torchdata resumes
    it by reading its batches again, which draws the same noise again: nothing to restore then."""

    def __init__(self):
        self.data, self.done = Noisy(), 0

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start + self.done * step, N, step):
            self.done += 1
            yield self.data[i]


class StatefulNoisyStream(NoisyStream):
    """torchdata restores its position without reading again: only the saved worker states can restore
    the noise of the rest of the epoch."""

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


class Linear(TrainingModule):
    def __init__(self, net):
        super().__init__()
        self.net, self.seen = net, []

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.seen.append(torch.cat([idx[:, None].double(), x.double()], 1))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(persistent=False, init=None, workers=2, dataset=None):
    shuffle = dataset is None
    return DataLoader(
        dataset if dataset is not None else Noisy(),
        batch_size=BATCH,
        shuffle=shuffle,
        num_workers=workers,
        persistent_workers=persistent,
        worker_init_fn=init,
    )


class SaveAt(Callback):
    def __init__(self, step, path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(save_at=None, ckpt_path=None):
    """2 epochs (12 steps), which end with the workers' last batch: none is left running for the cyclic
    GC, where torch's worker shutdown waits 5 s per worker (a Trainer and its Accelerator form a cycle)."""
    module = Linear(nn.Linear(3, 1))
    torch.nn.init.constant_(module.net.weight, 0.5)
    Trainer(
        max_steps=12,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[SaveAt(*save_at)] if save_at else [],
    ).fit(module, _loader(), ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize("cut", [2, 6])
def test_trainer_resumed_mid_epoch_continues_each_workers_augmentation(tmp_path, cut):
    """A checkpoint at step 2 of a 6-batch epoch, or on its last batch (the next epoch's new workers
    get that epoch's seeds, not the saved ones), resumed by a new Trainer for the rest of 2 epochs."""
    seed_everything(0)
    full = _fit()
    seed_everything(0)
    saving = _fit(save_at=(cut, str(tmp_path / "cut")))
    seed_everything(123)  # the resumed run must not depend on the random state it starts in
    resumed = _fit(ckpt_path=str(tmp_path / "cut"))
    assert len(resumed.seen) == 12 - cut
    for step, (got, expected) in enumerate(zip(saving.seen, full.seen), 1):
        assert torch.equal(got, expected), f"step {step}: saving a checkpoint changed the run"
    for step, (got, expected) in enumerate(zip(resumed.seen, full.seen[cut:]), cut + 1):
        assert torch.equal(got[:, 0], expected[:, 0]), f"step {step}: other samples"
        assert torch.equal(got, expected), f"step {step}: other augmentation"
    assert torch.equal(resumed.net.weight, full.net.weight) and torch.equal(resumed.net.bias, full.net.bias)


def _acc_run(tmp_path, stop=None, load=False, **loader_args):
    """2 epochs through the Accelerator; ``stop``: save_state after that many batches and return."""
    acc = Accelerator()
    net = nn.Linear(3, 1)
    torch.nn.init.constant_(net.weight, 0.5)
    model, opt, loader = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), _loader(**loader_args))
    if load:
        acc.load_state(str(tmp_path / "state"))
    seen = []
    while loader.epoch < 2:
        for idx, x, y in loader:
            seen.append(torch.cat([idx[:, None].double(), x.double()], 1))
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            if len(seen) == stop:
                acc.save_state(str(tmp_path / "state"))
                return seen, None
    return seen, copy.deepcopy(acc.unwrap_model(model).state_dict())


@pytest.mark.parametrize(
    "stop,loader_args",
    [
        (3, {}),
        (3, {"init": worker_init_fn}),
        (3, {"persistent": True}),
        (6, {"persistent": True}),
        (3, {"dataset": StatefulNoisyStream()}),
        (3, {"dataset": NoisyStream()}),
    ],
    ids=["map", "user-worker_init_fn", "persistent", "persistent-epoch-end", "stateful-stream", "stream-read-again"],
)
def test_accelerator_load_state_mid_epoch_continues_each_workers_augmentation(tmp_path, stop, loader_args):
    """A user's worker_init_fn (here one that reseeds random and numpy) runs first, then the restore.
    Persistent workers keep their streams from epoch to epoch: restored also after an epoch's end."""
    seed_everything(0)
    whole, reference = _acc_run(tmp_path, **copy.deepcopy(loader_args))
    seed_everything(0)
    first, _ = _acc_run(tmp_path, stop=stop, **copy.deepcopy(loader_args))
    seed_everything(99)  # a new process starts elsewhere
    rest, weights = _acc_run(tmp_path, load=True, **copy.deepcopy(loader_args))
    assert len(first) + len(rest) == len(whole) == 12
    for step, (got, expected) in enumerate(zip(first + rest, whole), 1):
        assert torch.equal(got, expected), f"batch {step} differs"
    assert all(torch.equal(weights[k], v) for k, v in reference.items())


def test_another_number_of_workers_resumes_the_position_and_says_the_augmentation_restarts(tmp_path, caplog):
    seed_everything(0)
    _acc_run(tmp_path, stop=3)
    with pytest.warns(UserWarning, match="random streams"):
        rest, _ = _acc_run(tmp_path, load=True, workers=1)
    assert len(rest) == 12 - 3


@pytest.mark.parametrize(
    "bad",
    [
        "abc",
        {5: {}},  # a worker id the loader does not have
        {0: {"torch": b"short"}},  # not a generator state trainforge saves
        {"0": {}},
    ],
)
def test_a_malformed_worker_rng_in_a_data_position_is_refused(bad):
    from trainforge.strategies.data.worker_rng import check_states
    from trainforge.strategies.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"random states in this data position are malformed.*0\.\.1"):
        check_states(bad, num_workers=2)
