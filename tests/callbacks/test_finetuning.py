"""``BaseFinetuning`` (Lightning's freeze/unfreeze schedules, callbacks/finetuning.py): the same weights as
Lightning 2.6, and a resume that is exact.

Lightning 2.6.6 figures: the program of ``fit_program`` with ``import lightning as L`` and ``BaseFinetuning``,
``ModelCheckpoint`` from ``lightning.pytorch.callbacks`` (``Trainer(max_epochs=4, enable_progress_bar=False,
enable_model_summary=False, logger=False)``), run with /tmp/refvenv/bin/python: groups ``[2, 4]`` with lrs
``[0.01, 0.001]`` and the weights in ``LIGHTNING``. Lightning's own resume from ``epoch=1-step=8.ckpt`` (after
the unfreeze) does not give them: ``freeze_before_training`` freezes the backbone again at setup and nothing
unfreezes it (backbone weights ``[-0.0996, -0.1017, ...]``, BatchNorm running mean ``[-0.1734, ...]``).
trainforge also keeps which parameters were unfrozen and which BatchNorm layers track statistics, so its
resume gives the uninterrupted run's weights exactly (a deliberate difference).

On several processes, DDP leaves out of its gradient averaging the parameters frozen when it wrapped the model; the
backbone unfrozen later then trains apart on each rank (Lightning's behaviour: the ranks drift, 0.26 apart here).
BaseFinetuning averages those gradients itself, so 2 ranks of 4 samples give the 1-process run of 8.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainforge.lightning as L
from tests.helpers.procs import REPO, run, trainforge_launch
from trainforge.callbacks import BaseFinetuning, ModelCheckpoint
from trainforge.strategies.errors import ConfigurationError

LIGHTNING = {
    "head": [-0.12185140699148178, 0.2082647830247879, -0.4075256884098053, -0.1010824590921402],
    "backbone": [-0.10521047562360764, -0.10875892639160156, -0.4443724751472473, -0.42441460490226746],
    "bn_mean": [-0.3597660958766937, 0.018439143896102905, -0.1484142392873764],
    "bn_weight": [1.0104634761810303, 0.9984039664268494, 1.0105451345443726],
}


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)


class Unfreeze(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone, train_bn=False)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, train_bn=True)


def fit_program(root: Path, ckpt_path=None):
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(32, 1)
    model = Net()
    checkpoints = ModelCheckpoint(dirpath=str(root / "ck"), save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(
        max_epochs=4,
        callbacks=[Unfreeze(), checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=str(root),
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8), ckpt_path=ckpt_path)
    return trainer, model


def test_freeze_then_unfreeze_gives_lightnings_weights_and_an_exact_resume(tmp_path):
    trainer, model = fit_program(tmp_path / "full")
    groups = trainer.optimizers[0].param_groups
    assert [len(g["params"]) for g in groups] == [2, 4] and [g["lr"] for g in groups] == [0.01, 0.001]
    assert model.head.weight.flatten()[:4].tolist() == pytest.approx(LIGHTNING["head"], abs=1e-7)
    assert model.backbone[0].weight.flatten()[:4].tolist() == pytest.approx(LIGHTNING["backbone"], abs=1e-7)
    assert model.backbone[1].running_mean[:3].tolist() == pytest.approx(LIGHTNING["bn_mean"], abs=1e-7)
    assert model.backbone[1].weight[:3].tolist() == pytest.approx(LIGHTNING["bn_weight"], abs=1e-7)

    resumed_trainer, resumed = fit_program(tmp_path / "resumed", ckpt_path=str(tmp_path / "full/ck/epoch=1-step=8"))
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    before, after = trainer.optimizers[0].state_dict(), resumed_trainer.optimizers[0].state_dict()
    assert [len(g["params"]) for g in after["param_groups"]] == [2, 4]
    for key, state in before["state"].items():
        assert all(torch.equal(state[k], after["state"][key][k]) for k in state), key


def test_the_helpers_follow_lightning():
    net = Net()
    leaves = BaseFinetuning.flatten_modules(torch.nn.ModuleDict({"a": net.backbone, "b": net.head}))
    assert [type(m).__name__ for m in leaves] == ["Linear", "BatchNorm1d", "ReLU", "Linear"]
    BaseFinetuning.freeze(net.backbone, train_bn=True)  # BatchNorm stays trainable
    assert [p.requires_grad for p in net.backbone.parameters()] == [False, False, True, True]
    assert len(list(BaseFinetuning.filter_params(net.backbone, train_bn=False, requires_grad=False))) == 2
    opt = torch.optim.SGD(net.head.parameters(), lr=0.5)
    BaseFinetuning.unfreeze_and_add_param_group(net.backbone, opt, lr=0.2)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.2] and len(opt.param_groups[1]["params"]) == 4
    with pytest.warns(UserWarning, match="already exist within another group"):
        BaseFinetuning.unfreeze_and_add_param_group(net.backbone, opt)
    assert len(opt.param_groups) == 2


def test_a_schedule_must_override_both_methods_and_name_modules(tmp_path):
    with pytest.raises(NotImplementedError, match="must override freeze_before_training"):
        BaseFinetuning().freeze_before_training(Net())
    with pytest.raises(ConfigurationError, match=r"BaseFinetuning: 3 is not a torch.nn.Module"):
        BaseFinetuning.freeze(3)


def test_a_checkpoint_without_the_flags_keeps_what_setup_froze():
    """Lightning's state (only ``internal_optimizer_metadata``) loads as Lightning loads it."""
    callback, net = Unfreeze(), Net()
    callback.freeze_before_training(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.load_state_dict({"internal_optimizer_metadata": {0: [{"lr": 0.01, "params": ["head.weight"]}]}})
    assert callback._internal_optimizer_metadata == {0: [{"lr": 0.01, "params": ["head.weight"]}]}
    assert not net.backbone[0].weight.requires_grad


@pytest.mark.slow
def test_two_ranks_train_the_unfrozen_backbone_as_one_process_does(tmp_path):
    script = REPO / "tests/scripts/finetuning_ddp.py"
    run([sys.executable, script, tmp_path / "one", "8"], timeout=180)
    run(trainforge_launch(script, tmp_path / "two", "4"), timeout=180)
    one, *ranks = (torch.load(tmp_path / d / f"rank-{r}.pt") for d, r in (("one", 0), ("two", 0), ("two", 1)))
    for name, value in one.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # the ranks agree
        assert torch.allclose(ranks[0][name], value, atol=1e-6), name  # and train as one process


def test_several_processes_other_than_ddp_are_refused():
    class View:
        world_size, strategy = 2, type("FSDPStrategy", (), {})()

    with pytest.raises(ConfigurationError, match=r"on 2 processes needs strategy='ddp'"):
        Unfreeze().on_setup(View(), Net(), "fit")


BACKBONE_LIGHTNING = {  # /tmp/w6/bb_prog.py with lightning.pytorch.callbacks.BackboneFinetuning, Lightning 2.6.6
    "head": [-0.1567666083574295, 0.21166378259658813, -0.4424745440483093, -0.07311700284481049],
    "backbone": [-0.16470953822135925, -0.18046657741069794, -0.3848710060119629, -0.37291285395622253],
    "bn_mean": [-0.42884504795074463, 0.02919848822057247, -0.1948382407426834],
}


class HeadOnly(Net):
    def configure_optimizers(self):
        return torch.optim.Adam(self.head.parameters(), lr=0.01)


def test_backbone_finetuning_gives_lightnings_weights_and_rates(tmp_path):
    """``BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 3.0, backbone_initial_ratio_lr=0.1)``
    over 5 epochs: the backbone's rate 0.001, then x3 each epoch, aligned at the head's 0.01 (Lightning's)."""
    from trainforge.callbacks import BackboneFinetuning

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(32, 1)
    model = HeadOnly()
    callback = BackboneFinetuning(
        unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 3.0, backbone_initial_ratio_lr=0.1
    )
    trainer = L.Trainer(
        max_epochs=5,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [0.01, 0.01]
    assert callback.previous_backbone_lr == 0.01
    assert model.head.weight.flatten()[:4].tolist() == pytest.approx(BACKBONE_LIGHTNING["head"], abs=1e-7)
    assert model.backbone[0].weight.flatten()[:4].tolist() == pytest.approx(BACKBONE_LIGHTNING["backbone"], abs=1e-7)
    assert model.backbone[1].running_mean[:3].tolist() == pytest.approx(BACKBONE_LIGHTNING["bn_mean"], abs=1e-7)


def test_backbone_finetuning_needs_a_backbone(tmp_path):
    from trainforge.callbacks import BackboneFinetuning

    class NoBackbone(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(2, 1)

    class View:
        world_size, strategy = 1, object()

    with pytest.raises(ConfigurationError, match=r"NoBackbone has no torch.nn.Module attribute 'backbone'"):
        BackboneFinetuning().on_setup(View(), NoBackbone(), "fit")
