"""A strategy whose backend moves batches itself (``Strategy.device_batches``, XLA's MpDeviceLoader)
reads ahead of the loop; a checkpoint must still hold the data position of the last batch the loop
received, not of those prefetched. Checked on CPU with a deterministic read-ahead strategy (the same
mechanism runs on XLA in test_xla_device.py)."""

from __future__ import annotations

import collections
import copy

import torch
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer, seed_everything
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies import SingleDeviceStrategy


class ReadAhead(SingleDeviceStrategy):
    """Pulls ``ahead`` batches from the loader before handing one out (as a prefetching loader does)."""

    def __init__(self, ahead: int = 3) -> None:
        super().__init__("cpu")
        self.ahead, self.pulled = ahead, 0

    def device_batches(self, batches):
        buffer = collections.deque()
        for item in batches:
            self.pulled += 1
            buffer.append(item)
            if len(buffer) > self.ahead:
                yield buffer.popleft()
        while buffer:
            yield buffer.popleft()


def _fit(strategy, root, initial, max_steps, ckpt_path=None, every=0):
    seed_everything(1)
    module = Regressor(copy.deepcopy(initial))
    trainer = Trainer(
        strategy=strategy,
        max_steps=max_steps,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=bool(every),
        callbacks=[ModelCheckpoint(every_n_steps=every, save_last=True)] if every else [],
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return [float(v) for v in module.losses], {k: v.clone() for k, v in module.state_dict().items()}


def test_mid_epoch_resume_is_exact_when_the_strategy_reads_ahead(tmp_path):
    seed_everything(0)
    initial = make_net()
    plain_losses, plain = _fit("single", tmp_path / "plain", initial, max_steps=16)
    ahead = ReadAhead()
    full_losses, full = _fit(ahead, tmp_path / "full", initial, max_steps=16)
    assert ahead.pulled == 16  # it did read ahead: the whole of both epochs
    assert full_losses == plain_losses and all(torch.equal(full[k], plain[k]) for k in plain)

    cut = ReadAhead()
    cut_losses, _ = _fit(cut, tmp_path / "cut", initial, max_steps=11, every=11)  # epoch 1, batch 3
    assert cut.pulled > 11  # batches past the checkpoint had left the loader when it was written
    seed_everything(123)
    resumed_losses, resumed = _fit(ReadAhead(), tmp_path / "cut", initial, max_steps=16, ckpt_path="last")
    assert cut_losses + resumed_losses == full_losses
    assert all(torch.equal(resumed[k], full[k]) for k in full)
