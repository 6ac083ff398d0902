"""A fit that would train nothing says so, a module or DataModule that would lose part of the run is
refused, and notebook_launcher's args must be a tuple: silent no-ops turned into a warning or an error
before work is lost."""

from __future__ import annotations

import logging

import pytest
from torch.utils.data import DataLoader, IterableDataset

from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import ConfigurationError, Trainer, notebook_launcher


def trainer(tmp_path, **kwargs) -> Trainer:
    kwargs.setdefault("max_epochs", 2)
    return Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, **kwargs)


def test_resume_past_max_epochs_warns_that_nothing_is_trained(tmp_path, caplog):
    trainer(tmp_path, max_epochs=3).fit(Regressor(make_net()), DataLoader(regression_data(16), batch_size=4))
    resumed = trainer(tmp_path, max_epochs=2)
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        resumed.fit(Regressor(make_net()), DataLoader(regression_data(16), batch_size=4), ckpt_path="last")
    assert resumed.global_step == 12
    assert "fit has nothing to train: the run has done 3 epoch(s) and 12 step(s)" in caplog.text
    assert "max_epochs=2 is reached; raise max_epochs" in caplog.text


def test_a_second_fit_of_a_finished_trainer_warns_and_a_first_fit_does_not(tmp_path, caplog):
    t, module = trainer(tmp_path), Regressor(make_net())
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        t.fit(module, DataLoader(regression_data(16), batch_size=4))
        assert "nothing to train" not in caplog.text
        t.fit(module, DataLoader(regression_data(16), batch_size=4))
    assert t.global_step == 8 and "fit has nothing to train" in caplog.text


class Empty(IterableDataset):
    def __iter__(self):
        return iter(())


def test_an_empty_stream_is_an_error_and_writes_no_checkpoint(tmp_path):
    with pytest.raises(ConfigurationError, match=r"train_dataloaders yielded no batch in epoch 0"):
        trainer(tmp_path).fit(Regressor(make_net()), DataLoader(Empty(), batch_size=2))
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_notebook_launcher_refuses_args_that_are_not_a_tuple():
    called = []
    with pytest.raises(ConfigurationError, match=r"args='abc' must be a tuple.*args=\('abc',\)"):
        notebook_launcher(lambda *a: called.append(a), args="abc")
    assert called == []
    notebook_launcher(lambda *a: called.append(a), args=["abc"])
    assert called == [("abc",)]


def test_a_module_that_skips_training_module_init_is_refused(tmp_path):
    """nn.Module.__init__(self) instead of super().__init__() would train with no hyperparameters."""
    from torch import nn

    class Skips(Regressor):
        def __init__(self):
            nn.Module.__init__(self)
            self.net = make_net()
            self.lr, self.step_lr, self.losses = 0.01, False, []

    with pytest.raises(ConfigurationError, match=r"Skips.__init__ did not run TrainingModule.__init__.*super\(\)"):
        trainer(tmp_path).fit(Skips(), DataLoader(regression_data(16), batch_size=4))


def test_a_datamodule_with_two_training_loaders_is_refused(tmp_path):
    """The second loader would be dropped without a word."""
    from trainforge import DataModule

    class Two(DataModule):
        def train_dataloader(self):
            return [DataLoader(regression_data(16), batch_size=4), DataLoader(regression_data(64), batch_size=4)]

    with pytest.raises(ConfigurationError, match=r"Two.train_dataloader\(\) returned 2 loaders.*ConcatDataset"):
        trainer(tmp_path).fit(Regressor(make_net()), datamodule=Two())
