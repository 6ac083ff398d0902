"""Several evaluation loaders as Lightning runs them (issue 20): the step and the batch hooks get
``dataloader_idx`` after ``batch_idx``, logged names get ``/dataloader_idx_N``, ``validate``/``test``
return one dict per loader and ``predict`` one list per loader. Lightning 2.6 gave, for this program
(``Multi`` below), the names and the per-loader split asserted here; the values are computed here."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import ConfigurationError, Trainer, TrainingModule
from trainforge.callbacks import Callback


def loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g)), batch_size=8)


def make(root, **kwargs) -> Trainer:
    kwargs.setdefault("max_epochs", 1)
    return Trainer(
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        enable_model_summary=False,
        **kwargs,
    )


class Multi(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 2)
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.seen.append(dataloader_idx)
        self.log("v", self.layer(batch[0]).pow(2).mean())
        if dataloader_idx == 1:
            self.log("plain", 2.0, add_dataloader_idx=False)

    def on_validation_epoch_end(self):
        self.log("ep", 5.0)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("t", self.layer(batch[0]).pow(2).mean())

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return dataloader_idx

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def mean_loss(module: Multi, dl: DataLoader) -> float:
    with torch.no_grad():
        return float(module.layer(torch.cat([b[0] for b in dl])).pow(2).mean())


class BatchIndices(Callback):
    def __init__(self) -> None:
        self.calls: list = []

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.calls.append((batch_idx, dataloader_idx))


def test_several_val_loaders_get_dataloader_idx_and_one_dict_each(tmp_path, capsys):
    module, spy = Multi(), BatchIndices()
    trainer = make(tmp_path, num_sanity_val_steps=0, callbacks=[spy])
    trainer.fit(module, loader(32, 0), [loader(16, 1), loader(8, 2)])
    assert module.seen == [0, 0, 1] and spy.calls == [(0, 0), (1, 0), (0, 1)]
    v0, v1 = mean_loss(module, loader(16, 1)), mean_loss(module, loader(8, 2))
    cm = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert cm == pytest.approx({"v/dataloader_idx_0": v0, "v/dataloader_idx_1": v1, "plain": 2.0, "ep": 5.0})
    results = trainer.validate(module, [loader(16, 1), loader(8, 2)])
    assert results == [
        {"v/dataloader_idx_0": pytest.approx(v0), "ep": 5.0},
        {"v/dataloader_idx_1": pytest.approx(v1), "plain": 2.0, "ep": 5.0},
    ]
    table = capsys.readouterr().out  # Lightning prints the names without the suffix
    assert "DataLoader 1" in table and "dataloader_idx" not in table
    assert trainer.test(module, loader(16, 1), verbose=False) == [{"t": pytest.approx(v0)}]  # one: no suffix
    assert trainer.predict(module, [loader(16, 1), loader(8, 2)]) == [[0, 0], [1]]
    assert trainer.predict(module, loader(8, 2)) == [0]


class NoIndex(Multi):
    def validation_step(self, batch, batch_idx):
        pass


class RequiredIndex(Multi):
    def validation_step(self, batch, batch_idx, dataloader_idx):
        pass


class OldCallback(Callback):
    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx):
        pass


def test_a_signature_that_cannot_take_the_index_is_refused_as_lightning(tmp_path):
    two = [loader(16, 1), loader(8, 2)]
    with pytest.raises(ConfigurationError, match=r"several val_dataloaders \(2\).*NoIndex.validation_step\(\)"):
        make(tmp_path).validate(NoIndex(), two, verbose=False)
    with pytest.raises(ConfigurationError, match=r"one val_dataloader is given, but RequiredIndex.validation_step"):
        make(tmp_path).validate(RequiredIndex(), loader(16, 1), verbose=False)
    with pytest.raises(ConfigurationError, match=r"OldCallback.on_validation_batch_end\(\) has no dataloader_idx"):
        make(tmp_path, callbacks=[OldCallback()]).validate(Multi(), two, verbose=False)
    assert make(tmp_path, callbacks=[OldCallback()]).validate(Multi(), loader(16, 1), verbose=False)


def test_add_dataloader_idx_must_be_a_bool(tmp_path):
    class Bad(Multi):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("v", 1.0, add_dataloader_idx="no")

    with pytest.raises(ConfigurationError, match=r"add_dataloader_idx='no'\) must be True or False"):
        make(tmp_path).validate(Bad(), loader(8, 1), verbose=False)
