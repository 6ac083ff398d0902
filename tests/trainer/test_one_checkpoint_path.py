"""One checkpoint format for the Trainer and the Accelerator (trainer/checkpoint/contents.py): a checkpoint
written by either API resumes with the other, exactly, and a part one side needs that the
checkpoint lacks is an error naming it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import make_net, regression_data
from trainforge import Accelerator, CheckpointError, Trainer, TrainingModule, seed_everything

EPOCH = 16  # batches per epoch: 64 samples, batch 4


class Net(TrainingModule):
    """The same step under both APIs: forward, MSE, AdamW, StepLR per optimizer step; dropout draws RNG."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), "interval": "step"},
        }


def loader():
    return DataLoader(regression_data(), batch_size=4, shuffle=True)


def trainer(root, **kwargs):
    return Trainer(
        max_epochs=2,
        seed=0,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
        **kwargs,
    )


def weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def accelerator_run(initial, stop_after, path=None):
    """Accelerate's loop over 2 epochs; stops (and saves) after ``stop_after`` batches."""
    seed_everything(0)
    acc = Accelerator(seed=0)
    module = Net(copy.deepcopy(initial))
    config = module.configure_optimizers()
    model, opt, sched, dl = acc.prepare(module, config["optimizer"], config["lr_scheduler"]["scheduler"], loader())
    done = 0
    for _ in range(2):
        for batch in dl:
            loss = model.training_step(batch, done)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            done += 1
            if done == stop_after:
                if path is not None:
                    acc.save_state(str(path))
                return acc, model, opt, sched, dl
    return acc, model, opt, sched, dl


@pytest.mark.parametrize("stop_after", [EPOCH + 5, EPOCH])  # mid-epoch, and at an epoch's end
def test_accelerator_checkpoint_resumes_trainer_fit_exactly(tmp_path, stop_after):
    initial = make_net(dropout=0.2)
    reference = Net(copy.deepcopy(initial))
    trainer(tmp_path / "ref").fit(reference, loader())
    acc, model, *_ = accelerator_run(initial, 2 * EPOCH)
    assert_same(weights(model.net), weights(reference.net))  # the two loops compute the same thing

    accelerator_run(initial, stop_after, tmp_path / "acc_state")
    resumed = Net(copy.deepcopy(initial))
    seed_everything(123)  # a new process starts elsewhere: the checkpoint restores every stream
    t = trainer(tmp_path / "resumed")
    t.fit(resumed, loader(), ckpt_path=str(tmp_path / "acc_state"))
    assert t.global_step == 2 * EPOCH
    assert_same(weights(resumed.net), weights(reference.net))


def test_trainer_checkpoint_loads_with_accelerator_load_state(tmp_path):
    initial = make_net(dropout=0.2)
    acc, model, opt, sched, dl = accelerator_run(initial, 2 * EPOCH)
    reference = weights(model.net)

    first = Net(copy.deepcopy(initial))
    t = trainer(tmp_path / "t", max_steps=EPOCH + 5)
    t.fit(first, loader())
    t.save_checkpoint(str(tmp_path / "trainer_ckpt"))

    seed_everything(123)
    acc = Accelerator(seed=0)
    module = Net(copy.deepcopy(initial))
    config = module.configure_optimizers()
    model, opt, sched, dl = acc.prepare(module, config["optimizer"], config["lr_scheduler"]["scheduler"], loader())
    acc.load_state(str(tmp_path / "trainer_ckpt"))
    assert sched.scheduler.last_epoch == EPOCH + 5
    assert opt.step_count == EPOCH + 5
    done = EPOCH + 5
    for _ in range(2):
        for batch in dl:  # the restored loader continues in epoch 1 at batch 5
            acc.backward(model.training_step(batch, done))
            opt.step()
            sched.step()
            opt.zero_grad()
            done += 1
        if done == 2 * EPOCH:
            break
    assert done == 2 * EPOCH
    assert_same(weights(model.net), reference)


def test_a_part_the_checkpoint_lacks_is_named(tmp_path):
    initial = make_net()
    accelerator_run(initial, 3, tmp_path / "acc_state")
    acc = Accelerator()
    module = Net(copy.deepcopy(initial))
    config = module.configure_optimizers()
    acc.prepare(module, config["optimizer"], loader())  # the scheduler that was saved is not prepared
    with pytest.raises(CheckpointError, match=r"1 learning-rate scheduler state.*0 scheduler\(s\) are prepared"):
        acc.load_state(str(tmp_path / "acc_state"))

    class Counter:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, state):
            pass

    t = trainer(tmp_path / "t", max_steps=2)
    t.fit(Net(copy.deepcopy(initial)), loader())
    t.save_checkpoint(str(tmp_path / "trainer_ckpt"))
    acc = Accelerator()
    module = Net(copy.deepcopy(initial))
    config = module.configure_optimizers()
    acc.prepare(module, config["optimizer"], config["lr_scheduler"]["scheduler"], loader())
    acc.register_for_checkpointing(Counter())
    with pytest.raises(CheckpointError, match=r"written by the Trainer\) holds 0 registered object.*1 are registered"):
        acc.load_state(str(tmp_path / "trainer_ckpt"))


def test_a_checkpoint_without_a_data_position_is_refused_by_the_trainer(tmp_path):
    initial = make_net()
    acc = Accelerator()
    module = Net(copy.deepcopy(initial))
    config = module.configure_optimizers()
    acc.prepare(module, config["optimizer"], config["lr_scheduler"]["scheduler"])  # no DataLoader prepared
    acc.save_state(str(tmp_path / "no_data"))
    t = trainer(tmp_path / "t")
    with pytest.raises(CheckpointError, match="holds no data position"):
        t.fit(Net(copy.deepcopy(initial)), loader(), ckpt_path=str(tmp_path / "no_data"))
