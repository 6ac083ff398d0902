"""self.log with a torchmetrics.Metric, as Lightning logs it: on_epoch its compute() at the epoch end
(over every rank's samples), reset after the epoch-end hooks and after the sanity check; on_step the
batch's forward value. Every expected value is counted by hand from the predictions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import forklaunch, procs
from trainforge import Trainer, TrainingModule
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:
    from torchmetrics.classification import MulticlassAccuracy

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module", autouse=True)
def needs_torchmetrics():
    """Imported here and where a metric is made, not at the top: collection would import torchmetrics
    (and scipy) in every worker."""
    return pytest.importorskip("torchmetrics")


def class_data(seed: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


def accuracy() -> MulticlassAccuracy:
    from torchmetrics.classification import MulticlassAccuracy

    return MulticlassAccuracy(num_classes=2, average="micro")


class Classifier(TrainingModule):
    """Logs val/acc (on_epoch: validation's default), train/acc (on_step and on_epoch) and
    val/hook_acc (from on_validation_epoch_end, updated with .update()), and counts by hand what it
    predicts: one record per validation run and per training epoch, with the logged values."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)
        self.lr = lr
        self.val_acc, self.hook_acc, self.train_acc = accuracy(), accuracy(), accuracy()
        self.val_runs: list = []  # {"sanity", "correct", "total", "logged", "hook", "sent"}
        self.train_epochs: list = []  # {"correct", "total", "logged", "steps": [(by hand, logged)]}

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        preds = logits.argmax(1)
        self.train_acc(preds, y)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        if batch_idx == 0:
            self.train_epochs.append({"correct": 0, "total": 0, "steps": []})
        epoch = self.train_epochs[-1]
        epoch["correct"] += int((preds == y).sum())
        epoch["total"] += len(y)
        epoch["steps"].append([float((preds == y).float().mean()), float(self.trainer.callback_metrics["train/acc"])])
        return nn.functional.cross_entropy(logits, y)

    def on_validation_epoch_start(self):
        self.val_runs.append({"sanity": self.trainer.sanity_checking, "correct": 0, "total": 0})

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self.net(x).argmax(1)
        self.val_acc(preds, y)
        self.log("val/acc", self.val_acc)
        self.hook_acc.update(preds, y)
        self.val_runs[-1]["correct"] += int((preds == y).sum())
        self.val_runs[-1]["total"] += len(y)

    def on_validation_epoch_end(self):
        self.log("val/hook_acc", self.hook_acc)

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            cm = self.trainer.callback_metrics
            run = self.val_runs[-1]
            run.update(logged=float(cm["val/acc"]), hook=float(cm["val/hook_acc"]))
            run["sent"] = self.trainer.logged_metrics.get("val/acc")

    def on_train_epoch_end(self):
        self.train_epochs[-1]["logged"] = float(self.trainer.callback_metrics["train/acc_epoch"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit_classifier(tmp_path, module: TrainingModule, **kwargs) -> Trainer:
    settings = dict(
        max_epochs=3,
        num_sanity_val_steps=2,
        limit_val_batches=3,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    settings.update(kwargs)
    trainer = Trainer(**settings)
    trainer.fit(module, DataLoader(class_data(1, 64), batch_size=16), DataLoader(class_data(2, 50), batch_size=8))
    return trainer


def test_epoch_value_is_compute_over_the_epoch_then_reset(tmp_path):
    # Lightning 2.6 with torchmetrics 1.9, the same program: val/acc 0.875, 0.9583, 1.0
    module = Classifier()
    fit_classifier(tmp_path, module)
    sanity, *runs = module.val_runs
    assert sanity["sanity"] and sanity["total"] == 16 and len(runs) == 3
    for run in runs:
        hand = run["correct"] / run["total"]
        assert run["total"] == 24  # limit_val_batches=3 of 8
        assert run["logged"] == pytest.approx(hand, abs=1e-6)  # callback_metrics: what monitors read
        assert run["sent"] == pytest.approx(hand, abs=1e-6)  # logged_metrics: what trackers got
        assert run["hook"] == pytest.approx(hand, abs=1e-6)  # logged from on_validation_epoch_end
    # the values tell a reset metric from one that kept the sanity check's or the last epoch's samples
    assert (sanity["correct"] + runs[0]["correct"]) / 40 != pytest.approx(runs[0]["logged"])
    assert (runs[0]["correct"] + runs[1]["correct"]) / 48 != pytest.approx(runs[1]["logged"])
    # training: on_step the batch's value, on_epoch the epoch's (reset between epochs)
    assert len(module.train_epochs) == 3
    for epoch in module.train_epochs:
        assert epoch["logged"] == pytest.approx(epoch["correct"] / epoch["total"], abs=1e-6)
        assert all(hand == pytest.approx(logged, abs=1e-6) for hand, logged in epoch["steps"])
    assert not module.val_acc.update_called and not module.train_acc.update_called  # reset after the last epoch


class WithCollection(Classifier):
    def __init__(self) -> None:
        import torchmetrics
        from torchmetrics.classification import MulticlassAccuracy

        super().__init__()
        self.test_metrics = torchmetrics.MetricCollection(
            {"acc": accuracy(), "macro_acc": MulticlassAccuracy(num_classes=2, average="macro")}, prefix="test/"
        )
        self.preds: list = []

    def test_step(self, batch, batch_idx):
        x, y = batch
        preds = self.net(x).argmax(1)
        self.test_metrics(preds, y)
        self.log_dict(self.test_metrics)  # each metric under its prefixed name (Lightning)
        self.preds.append((preds, y))


def test_log_dict_of_a_metric_collection_in_test_resets_between_runs(tmp_path):
    module, data = WithCollection(), class_data(3, 40)
    trainer = Trainer(
        max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False
    )
    (first,) = trainer.test(module, DataLoader(data, batch_size=16))
    preds, y = (torch.cat(t) for t in zip(*module.preds))
    per_class = [float((preds[y == c] == c).float().mean()) for c in (0, 1)]
    assert first["test/acc"] == pytest.approx(float((preds == y).float().mean()), abs=1e-6)
    assert first["test/macro_acc"] == pytest.approx(sum(per_class) / 2, abs=1e-6)
    (second,) = trainer.test(module, DataLoader(TensorDataset(*data[:8]), batch_size=8))  # a reset metric: 8 samples
    preds8, y8 = module.preds[-1]
    assert second["test/acc"] == pytest.approx(float((preds8 == y8).float().mean()), abs=1e-6)


class BadLog(Classifier):
    def __init__(self, case: str) -> None:
        import torchmetrics
        from torchmetrics.classification import MulticlassAccuracy

        super().__init__()
        self.case = case
        self.per_class = MulticlassAccuracy(num_classes=2, average=None)
        self.collection = torchmetrics.MetricCollection({"acc": accuracy()})

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self.net(x).argmax(1)
        if self.case == "not_an_attribute":  # a new Metric per batch would hold one batch
            made_here = accuracy()
            made_here(preds, y)
            self.log("val/acc", made_here)
        elif self.case == "collection":
            self.collection(preds, y)
            self.log("val/acc", self.collection)
        elif self.case == "on_step_after_update":  # no forward value for the batch
            self.val_acc.update(preds, y)
            self.log("val/acc", self.val_acc, on_step=True)
        elif self.case == "per_class":
            self.per_class(preds, y)
            self.log("val/acc", self.per_class)


@pytest.mark.parametrize(
    "case,expected",
    [
        ("not_an_attribute", r"self.log\('val/acc', MulticlassAccuracy\): this Metric is not an attribute of "
         r"BadLog \(its Metric attributes: \['val_acc', 'hook_acc', 'train_acc', 'per_class', 'collection.acc'\]\)"
         r".*create it once in __init__"),
        ("collection", r"self.log\('val/acc', MetricCollection\).*log it with self.log_dict\(collection\)"),
        ("on_step_after_update", r"on_step=True\): on_step logs the value the metric's forward returned.*"
         r"call the metric, metric\(preds, target\), before self.log, or log it with on_step=False, on_epoch=True"),
        ("per_class", r"self.log\('val/acc', MulticlassAccuracy\): its compute\(\) is a tensor of shape \(2,\).*"
         r"average='macro'"),
    ],
)  # fmt: skip
def test_bad_metric_logging_is_refused_with_the_fix(tmp_path, case, expected):
    with pytest.raises(ConfigurationError, match=expected):
        fit_classifier(tmp_path, BadLog(case), max_epochs=1, num_sanity_val_steps=0)


def test_trainforge_does_not_import_torchmetrics():
    code = "import sys, trainforge, trainforge.trainer, trainforge.callbacks; assert 'torchmetrics' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=procs.test_env(), timeout=120)


@pytest.mark.slow
def test_ddp_epoch_value_is_over_both_ranks(tmp_path):
    """Two gloo processes: the logged value is the accuracy over both ranks' samples (torchmetrics'
    own sync in compute), on every rank, reset between epochs and after the sanity check."""
    out = tmp_path / "ranks"
    forklaunch.launch(SCRIPTS / "torchmetrics_ddp.py", str(out), nproc=2, timeout=180)
    ranks = [json.loads((tmp_path / f"ranks.{r}.json").read_text()) for r in (0, 1)]
    val0, val1 = (r["val_runs"] for r in ranks)
    assert [r["sanity"] for r in val0] == [True, False, False]
    local_differs = False
    for run0, run1 in zip(val0[1:], val1[1:]):
        assert run0["total"] == run1["total"] == 16  # limit_val_batches=2 of 8 on each rank
        both = (run0["correct"] + run1["correct"]) / 32
        for run in (run0, run1):
            assert run["logged"] == pytest.approx(both, abs=1e-6)
            assert run["hook"] == pytest.approx(both, abs=1e-6)
        local_differs |= run0["correct"] / 16 != pytest.approx(both)
    assert local_differs, "the data cannot tell rank 0's value from both ranks'"
    for epoch0, epoch1 in zip(ranks[0]["train_epochs"], ranks[1]["train_epochs"]):
        both = (epoch0["correct"] + epoch1["correct"]) / (epoch0["total"] + epoch1["total"])
        assert epoch0["logged"] == pytest.approx(both, abs=1e-6) == epoch1["logged"]
