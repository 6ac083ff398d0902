"""Accelerator behaviours Accelerate users rely on (one process; the multi-process ones are in
tests/scripts/dist_collectives.py via tests/trainer/test_distributed.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.models import make_net, regression_data
from trainforge import Accelerator, CheckpointError, ConfigurationError


class ProjectConfiguration:  # the shape of accelerate.utils.ProjectConfiguration
    def __init__(self, project_dir, automatic_checkpoint_naming=False, total_limit=None):
        self.project_dir, self.total_limit = project_dir, total_limit
        self.automatic_checkpoint_naming = automatic_checkpoint_naming


def _prepared(acc):
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return acc.prepare(model, opt)


def test_automatic_checkpoint_naming_and_total_limit(tmp_path):
    """Accelerate test_state_checkpointing: ProjectConfiguration(automatic_checkpoint_naming=True,
    total_limit=2): save_state() writes checkpoints/checkpoint_<i>, keeps 2; load_state() loads the newest."""
    acc = Accelerator(
        project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    )
    model, opt = _prepared(acc)
    for i in range(3):
        with torch.no_grad():
            model[0].bias.fill_(float(i))
        acc.save_state(safe_serialization=True)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith("."))
    assert names == ["checkpoint_1", "checkpoint_2"]
    with torch.no_grad():
        model[0].bias.zero_()
    assert acc.load_state().name == "checkpoint_2"
    assert torch.all(model[0].bias == 2.0)
    same = Accelerator(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    _prepared(same)
    assert same.save_state().name == "checkpoint_3"  # numbering continues from what is on disk
    with pytest.raises(ConfigurationError, match="project_dir"):
        Accelerator(automatic_checkpoint_naming=True)
    with pytest.raises(CheckpointError, match="no checkpoint_<i>"):
        fresh = Accelerator(project_dir=str(tmp_path / "empty"), automatic_checkpoint_naming=True)
        fresh.load_state()
    with pytest.warns(UserWarning, match="always writes weights as safetensors"):
        acc.save_state(str(tmp_path / "unsafe"), safe_serialization=False)


def test_skip_first_batches_and_its_no_op_after_load_state(tmp_path, caplog):
    """Accelerate: skip_first_batches(loader, n) starts the next pass n batches in (without loading
    them); after load_state (which restores the position, unlike Accelerate) skipping that same
    position again logs and skips nothing more, another count is an error naming both."""
    data = TensorDataset(torch.arange(32))
    acc = Accelerator()
    loader = acc.prepare(DataLoader(data, batch_size=4))
    assert [b[0].tolist() for b in acc.skip_first_batches(loader, 6)] == [[24, 25, 26, 27], [28, 29, 30, 31]]
    assert len(list(loader)) == 8  # the next pass is whole again
    for i, _ in enumerate(loader):
        if i == 2:
            acc.save_state(str(tmp_path / "mid"))
            break
    acc2 = Accelerator()
    loader2 = acc2.prepare(DataLoader(data, batch_size=4))
    acc2.load_state(str(tmp_path / "mid"))
    with pytest.raises(ConfigurationError, match=r"skip_first_batches\(5\) does not match .* batch 3 of epoch 2"):
        acc2.skip_first_batches(loader2, 5)
    with caplog.at_level("WARNING", logger="trainforge"):
        resumed = acc2.skip_first_batches(loader2, 3)
    assert "restored this loader to batch 3 of epoch 2; the next pass continues from there" in caplog.text
    assert [b[0].tolist() for b in resumed][0] == [12, 13, 14, 15]


def test_skip_first_batches_after_a_checkpoint_on_the_last_batch_of_an_epoch(tmp_path, caplog):
    """run_clm_no_trainer.py after a step checkpoint saved on an epoch's last batch: it starts the next
    epoch and asks skip_first_batches(0); the restored loader then starts that epoch (logged). Bad
    input: another count there, 0 in mid-epoch, a bool, a negative count are errors."""
    data = TensorDataset(torch.arange(16))
    acc = Accelerator()
    loader = acc.prepare(DataLoader(data, batch_size=4))
    for _ in loader:  # epoch 0
        pass
    for i, _ in enumerate(loader):  # epoch 1, saved on its last batch
        if i == 3:
            acc.save_state(str(tmp_path / "end"))
            acc.save_state(str(tmp_path / "end_again"))
        if i == 1:
            acc.save_state(str(tmp_path / "mid"))

    def restored(name):
        again = Accelerator()
        prepared = again.prepare(DataLoader(data, batch_size=4))
        again.load_state(str(tmp_path / name))
        return again, prepared

    again, loader2 = restored("end")
    with caplog.at_level("WARNING", logger="trainforge"):
        assert again.skip_first_batches(loader2, 0) is loader2
    assert "to the end of epoch 1 (batch 4 of 4); the next pass starts epoch 2" in caplog.text
    assert [b[0].tolist() for b in loader2] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert loader2.epoch == 3
    again, loader3 = restored("end_again")
    with pytest.raises(ConfigurationError, match=r"skip_first_batches\(2\) .* batch 4 of epoch 1 \(of 4 batches\)"):
        again.skip_first_batches(loader3, 2)
    again, loader4 = restored("mid")
    with pytest.raises(ConfigurationError, match=r"skip_first_batches\(0\) .* batch 2 of epoch 1 .* Drop the"):
        again.skip_first_batches(loader4, 0)
    for bad in (True, -1, 2.0):
        with pytest.raises(ConfigurationError, match="must be an int >= 0"):
            again.skip_first_batches(loader4, bad)


def test_process_control_on_one_process():
    """Accelerate: main_process_first, on_main_process/on_local_main_process/on_process decorators,
    gather_object, no_sync (a no-op wrapper on one process)."""
    acc = Accelerator()
    with acc.main_process_first():
        ran = True
    assert ran
    assert acc.on_main_process(lambda: "main")() == "main"
    assert acc.on_local_main_process(lambda: "local")() == "local"
    assert acc.on_process(lambda: "p1", process_index=1)() is None
    assert acc.on_process(process_index=0)(lambda: "p0")() == "p0"
    assert acc.gather_object(["a", "b"]) == ["a", "b"] and acc.gather_object({"k": 1}) == [{"k": 1}]
    model, opt = _prepared(acc)
    with acc.no_sync(model):
        acc.backward(model(torch.randn(2, 8)).sum())
    assert model[0].weight.grad is not None


def test_prepared_scheduler_and_split_batches_on_one_process():
    """Accelerate: a prepared scheduler steps once per process per optimizer step (one here);
    split_batches=True makes the loader's batch_size the global batch."""
    acc = Accelerator(split_batches=True)
    model, opt = _prepared(acc)
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    loader = acc.prepare(DataLoader(regression_data(n=16), batch_size=8))
    for x, y in loader:
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    assert sched.steps_per_call == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert Accelerator().prepare(torch.optim.lr_scheduler.StepLR(opt, 1)).steps_per_call == 1


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_a_prepared_model_computes_in_the_mixed_precision_and_returns_float32():
    """Accelerate runs a prepared model's forward under autocast (issue 20: trainforge did only
    inside an explicit accelerator.autocast(), so mixed precision was silently off)."""
    x = torch.randn(4, 8)
    reference = _mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x).float()
    acc = Accelerator(precision="bf16-mixed")
    model = _mlp()
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    prepared = acc.prepare(model)
    out = prepared(x)
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert torch.equal(out, expected)
    acc.prepare(prepared)  # prepared again: wrapped once, not twice
    assert torch.equal(prepared(x), expected)
    twin = copy.deepcopy(prepared)  # the copy's forward runs the copy
    with torch.no_grad():
        twin[2].bias.add_(1.0)
    assert torch.allclose(twin(x), expected + 1.0, atol=2e-2)  # bf16 rounding
    assert torch.equal(prepared(x), expected)


def test_a_prepared_model_in_float32_keeps_its_own_forward():
    acc = Accelerator(precision="32")
    model = acc.prepare(_mlp())
    assert model.forward.__func__ is nn.Sequential.forward


def test_gather_for_metrics_keeps_the_last_batchs_samples_however_many_rows_each_gave():
    """Accelerate trims the last batch to the dataset's remainder: the HF `*_no_trainer` scripts'
    `gather_for_metrics(loss.repeat(batch_size))` counts 10 samples as 10 values, not 12 (issue 20)."""
    from torch.utils.data import DataLoader, TensorDataset

    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4))
    repeated, samples = [], []
    for (x,) in loader:
        repeated.append(len(acc.gather_for_metrics(x.mean().repeat(4))))
        samples.extend(acc.gather_for_metrics(x).tolist())
    assert repeated == [4, 4, 2]
    assert samples == [float(i) for i in range(10)]
    assert len(acc.gather_for_metrics(torch.ones(4))) == 4  # outside the loop: a plain gather
