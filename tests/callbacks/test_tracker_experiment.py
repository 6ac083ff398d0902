"""``self.logger`` / ``self.loggers`` and ``logger.experiment`` as Lightning programs use them (issue 20):
Lightning's GAN example calls ``self.logger.experiment.add_image(...)`` with TensorBoardLogger."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import ConfigurationError, Trainer, TrainingModule
from trainforge.callbacks import CSVLogger, TensorBoardLogger
from trainforge.callbacks.trackers.experiment import NO_EXPERIMENT, experiment_or_stand_in


class Images(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def on_train_epoch_end(self):
        self.seen.append((self.logger, list(self.loggers), self.logger.experiment))
        self.logger.experiment.add_image("generated", torch.rand(3, 4, 4), self.current_epoch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(root, logger, module=None):
    module = module or Images()
    trainer = Trainer(
        default_root_dir=str(root), max_epochs=1, logger=logger, enable_progress_bar=False, enable_checkpointing=False
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    return trainer, module


def test_self_logger_experiment_is_tensorboards_summary_writer(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    tb, csv = TensorBoardLogger(), CSVLogger()
    trainer, module = fit(tmp_path, [tb, csv])
    ((first, every, experiment),) = module.seen
    assert first is tb and every == [tb, csv] and isinstance(experiment, SummaryWriter)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb.directory), size_guidance={"images": 0})
    events.Reload()
    assert events.Tags()["images"] == ["generated"]
    assert Images().logger is None and Images().loggers == []  # no trainer: as Lightning


def test_csvlogger_experiment_and_before_fit_are_clear_errors(tmp_path):
    with pytest.raises(
        ConfigurationError, match="CSVLogger writes the logged numbers to a CSV file.*TensorBoardLogger"
    ):
        fit(tmp_path, CSVLogger())
    with pytest.raises(ConfigurationError, match=r"TensorBoardLogger.experiment is opened at fit start"):
        TensorBoardLogger().experiment


def test_other_ranks_and_a_dead_backend_get_a_stand_in_that_does_nothing():
    assert experiment_or_stand_in("X", object(), False, UserWarning) is NO_EXPERIMENT
    assert NO_EXPERIMENT.add_image("a", 1, step=2).flush() is NO_EXPERIMENT
    with pytest.warns(UserWarning, match="X.experiment: the backend is not open"):
        assert experiment_or_stand_in("X", None, True, UserWarning) is NO_EXPERIMENT
    found = object()
    assert experiment_or_stand_in("X", found, True, UserWarning) is found
