"""Issue 25: a checkpoint that cannot be written says why, what is intact and what to do, the same way on
the synchronous and the asynchronous path (strategies/checkpoint/write_errors.py)."""

import resource
import signal

import pytest
import torch
from safetensors import SafetensorError
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies.checkpoint import io
from trainforge.strategies.checkpoint.io import CheckpointWriter, read_latest_pointer
from trainforge.strategies.errors import CheckpointError


def _save(path, value):
    w = CheckpointWriter(path)
    w.save_tensors("model", {"w": torch.full((4096,), float(value))})
    return w.finalize({"step": value})


def test_a_write_past_the_file_size_limit_names_the_cause_and_the_intact_checkpoint(tmp_path):
    """A real failed write: RLIMIT_FSIZE makes write() fail with EFBIG, as a full disk fails with ENOSPC.
    Before: safetensors' raw SafetensorError ("Error while serializing: I/O error ...") only."""
    first = _save(tmp_path / "step-1", 1)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails instead of killing us
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    writer = CheckpointWriter(tmp_path / "step-2")
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        with pytest.raises(CheckpointError) as err:
            writer.save_tensors("model", {"w": torch.zeros(8192)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    message = str(err.value)
    assert f"save of {tmp_path / 'step-2'} failed (SafetensorError: " in message
    assert "(os error 27)): the file is larger than this process may write (see `ulimit -f`)" in message
    assert f"'latest' was not moved and the previous checkpoint {first} is intact" in message
    assert "GiB free on" in message and "save elsewhere (ModelCheckpoint(dirpath=...))" in message
    assert isinstance(err.value.__cause__, SafetensorError)
    assert read_latest_pointer(tmp_path) == "step-1"


def test_disk_full_during_a_trainer_save_is_one_clear_error(tmp_path, monkeypatch):
    """ENOSPC as safetensors reports it, raised where the synchronous save writes the weights."""
    calls = []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:  # the first checkpoint is written, the second finds the disk full
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(*args, **kwargs)

    real = io.save_file
    monkeypatch.setattr(io, "save_file", full_disk)
    trainer = Trainer(
        max_steps=4,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_steps=1, save_top_k=-1)],
    )
    with pytest.raises(CheckpointError) as err:
        trainer.fit(Regressor(make_net()), DataLoader(regression_data(16), batch_size=4))
    message = str(err.value)
    assert "save of " in message and "epoch=0-step=2 failed (SafetensorError: " in message
    assert "(os error 28)): the disk is full; it was not committed" in message
    assert "the previous checkpoint " in message and "epoch=0-step=1 is intact" in message
    assert "Fix the cause (disk space: " in message
    assert read_latest_pointer(tmp_path / "ck") == "epoch=0-step=1"


def test_a_bug_in_the_saved_state_is_not_reported_as_a_disk_problem(tmp_path):
    writer = CheckpointWriter(tmp_path / "step-1")
    with pytest.raises(AttributeError):  # a local object cannot be pickled: torch.save's own error
        writer.save_object("state", {"f": lambda: 0})
