"""Lightning's Trainer names and arguments (issue 20): a Lightning program runs with its imports changed.
One test per argument or attribute, and its bad input refused with the value, the choices and the fix.
Expected values are computed here (Lightning is not a dependency)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import forklaunch
from trainforge import CheckpointError, ConfigurationError, DataModule, Trainer, TrainingModule
from trainforge.callbacks import CSVLogger, EarlyStopping, ModelCheckpoint, ModelSummary, TensorBoardLogger
from trainforge.callbacks.model_summary import summarize
from trainforge.strategies import resolve_strategy
from trainforge.strategies.environment import ClusterEnvironment
from trainforge.trainer.compat.lightning.trainer_args import (
    DevicePlan,
    check_launched,
    parse_devices,
    strategy_with_device,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g))


class Boring(TrainingModule):
    """Lightning's BoringModel: its train loss falls, its validation loss (distance to 1) rises."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the losses below fall from the start
        self.layer = nn.Linear(8, 2)
        self.params_at_configure = None

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", (self(batch[0]) - 1).pow(2).mean())

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self(batch[0]).pow(2).mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        self.params_at_configure = [id(p) for p in self.trainer.model.parameters()]  # Lightning's FSDP guide
        return torch.optim.SGD(self.trainer.model.parameters(), lr=0.1)


def loader(n: int = 32, seed: int = 0) -> DataLoader:
    return DataLoader(data(n, seed), batch_size=8)


def make(root, **kwargs) -> Trainer:
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("enable_progress_bar", False)
    return Trainer(default_root_dir=str(root), **kwargs)


def loss_of(module: nn.Module, batches: DataLoader, target: float = 0.0) -> float:
    with torch.no_grad():
        x = torch.cat([b[0] for b in batches])
        return float((module(x) - target).pow(2).mean())


# ---- min_epochs / min_steps ---------------------------------------------------------------------
def test_min_epochs_keeps_training_past_early_stopping(tmp_path):
    stop = EarlyStopping("valid_loss", patience=0)  # the loss rises from the start: asks to stop after epoch 1
    trainer = make(tmp_path, max_epochs=10, min_epochs=4, callbacks=[stop], enable_checkpointing=False)
    trainer.fit(Boring(), loader(), loader(16, 1))
    assert trainer.should_stop and stop.stopped_epoch == 3
    assert trainer.current_epoch == 4 and trainer.global_step == 4 * 4


def test_min_steps_keeps_training_past_should_stop(tmp_path):
    stop = EarlyStopping("valid_loss", patience=0)
    trainer = make(tmp_path, max_epochs=10, min_steps=10, callbacks=[stop], enable_checkpointing=False)
    trainer.fit(Boring(), loader(), loader(16, 1))
    # Lightning 2.6: stopped at step 10 mid-epoch 2, after validating there and ending the epoch
    assert stop.stopped_epoch == 2 and trainer.global_step == 10 and trainer.current_epoch == 3


@pytest.mark.parametrize("name, value", [("min_epochs", -1), ("min_steps", 2.5), ("min_epochs", True)])
def test_min_limits_refuse_bad_values(tmp_path, name, value):
    with pytest.raises(ConfigurationError, match=f"{name}={value!r}"):
        make(tmp_path, **{name: value})


# ---- callbacks, checkpoint_callback, early_stopping_callback ------------------------------------
def test_a_single_callback_and_the_callback_attributes(tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="valid_loss")
    trainer = make(tmp_path, callbacks=ckpt)  # one callback, not in a list (Lightning takes it)
    assert trainer.checkpoint_callback is ckpt and trainer.checkpoint_callbacks == [ckpt]
    assert trainer.early_stopping_callback is None and trainer.early_stopping_callbacks == []
    stop = EarlyStopping("valid_loss")
    trainer = make(tmp_path, callbacks=[stop], enable_checkpointing=False)
    assert trainer.early_stopping_callback is stop and trainer.checkpoint_callback is None


def test_trainer_model_is_set_before_configure_optimizers(tmp_path):
    module = Boring()
    make(tmp_path, enable_checkpointing=False, logger=False).fit(module, loader())
    assert module.params_at_configure == [id(p) for p in module.parameters()]


# ---- logger ---------------------------------------------------------------------------------------
def test_logger_true_false_a_tracker_or_a_list(tmp_path):
    pytest.importorskip("tensorboard")  # Lightning's default logger: TensorBoard when installed, else CSVLogger
    default = make(tmp_path)
    assert isinstance(default.logger, TensorBoardLogger) and default.loggers == [default.logger]
    on = make(tmp_path, logger=True)
    assert isinstance(on.logger, TensorBoardLogger) and on.loggers == [on.logger]
    off = make(tmp_path, logger=False)
    assert off.logger is None and off.loggers == []
    mine = CSVLogger(str(tmp_path / "mine"))
    assert make(tmp_path, logger=mine).loggers == [mine]
    other = CSVLogger(str(tmp_path / "other"))
    assert make(tmp_path, logger=[mine, other]).loggers == [mine, other]
    assert make(tmp_path, logger=mine, callbacks=[mine]).loggers == [mine]  # the same tracker once


def test_logger_false_writes_no_metrics_file(tmp_path):
    make(tmp_path, logger=False, enable_checkpointing=False).fit(Boring(), loader())
    assert not list(tmp_path.rglob("*.csv"))


@pytest.mark.parametrize(
    "logger, match",
    [
        ("tensorboard", r"logger='tensorboard'.* is not a trainforge tracker; pass one of trainforge.callbacks"),
        (CSVLogger, r"logger=CSVLogger is not a trainforge tracker; pass an instance, CSVLogger\(...\)"),
        ([object()], r"logger\[0\]=object\(...\) is not a trainforge tracker"),
    ],
)
def test_logger_refuses_what_is_not_a_tracker(tmp_path, logger, match):
    with pytest.raises(ConfigurationError, match=match):
        make(tmp_path, logger=logger)


def test_logger_false_with_a_tracker_in_callbacks_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="logger=False turns the trackers off, but callbacks holds CSVLogger"):
        make(tmp_path, logger=False, callbacks=[CSVLogger(str(tmp_path / "x"))])


# ---- enable_model_summary / ModelSummary ------------------------------------------------------------
class Nested(Boring):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
        self.frozen.requires_grad_(False)
        self.frozen.eval()


def test_model_summary_printed_at_fit_start(tmp_path, capsys):
    module = Nested()
    make(tmp_path, enable_checkpointing=False, logger=False).fit(module, loader())
    out = capsys.readouterr().out
    total = sum(p.numel() for p in module.parameters())
    frozen = sum(p.numel() for p in module.frozen.parameters())
    assert "| Name   | Type       | Params | Mode" in out
    assert "0 | layer  | Linear     | 18     | train" in out and "1 | frozen | Sequential | 36     | eval" in out
    assert f"{total - frozen:<10} Trainable params" in out and f"{frozen:<10} Non-trainable params" in out
    assert f"{total:<10} Total params" in out and "Total estimated model params size (MB)" in out
    assert "1          Modules in train mode" in out and "3          Modules in eval mode" in out
    assert "frozen.0" not in out  # max_depth=1 by default


def test_model_summary_off_and_depth(tmp_path, capsys):
    make(tmp_path, enable_checkpointing=False, logger=False, enable_model_summary=False).fit(Nested(), loader())
    assert "Trainable params" not in capsys.readouterr().out
    assert "frozen.0" in summarize(Nested(), max_depth=-1) and "frozen.0" not in summarize(Nested(), max_depth=1)
    trainer = make(tmp_path, enable_checkpointing=False, logger=False, callbacks=[ModelSummary(max_depth=2)])
    trainer.fit(Nested(), loader())
    assert "frozen.1 | ReLU" in capsys.readouterr().out


def test_model_summary_bad_input(tmp_path):
    with pytest.raises(ConfigurationError, match=r"ModelSummary\(max_depth=-2\) must be an int"):
        ModelSummary(max_depth=-2)
    with pytest.raises(ConfigurationError, match="enable_model_summary=False, but callbacks holds a ModelSummary"):
        make(tmp_path, enable_model_summary=False, callbacks=[ModelSummary()])
    with pytest.raises(ConfigurationError, match="enable_model_summary='no' must be True or False"):
        make(tmp_path, enable_model_summary="no")


# ---- deterministic ----------------------------------------------------------------------------------
@pytest.fixture
def restore_determinism():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic(tmp_path, restore_determinism):
    make(tmp_path, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    make(tmp_path, deterministic="warn")
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    make(tmp_path, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    make(tmp_path)  # None: torch's setting is left alone
    assert torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("value", ["yes", 1, "true"])
def test_deterministic_refuses_other_values(tmp_path, value):
    with pytest.raises(ConfigurationError, match=rf"deterministic={value!r} is not one of: True, False, warn, None"):
        make(tmp_path, deterministic=value)


# ---- devices / num_nodes ----------------------------------------------------------------------------
def test_devices_on_one_cpu_process(tmp_path):
    for devices in (1, "1", "auto", None):
        assert make(tmp_path, accelerator="cpu", devices=devices, num_nodes=1).world_size == 1


@pytest.mark.parametrize(
    "devices, num_nodes, match",
    [
        (0, 1, "devices=0: 'auto', an int N >= 1 .* for a CPU run pass accelerator='cpu' and devices=1"),
        (-1, 1, "devices=-1: .* on CPU pass the number of processes, devices=N"),
        ([0, 1], 1, r"devices=\[0, 1\]: a list picks accelerator devices by index, .* pass devices=2"),
        ("two", 1, "devices='two' is not 'auto', an int N >= 1"),
        (True, 1, "devices=True is not 'auto'"),
        (1, 0, "num_nodes=0 must be an int >= 1"),
        (1, 2, r"num_nodes=2 from a plain `python` process: .*trainforge launch --nnodes 2"),
    ],
)
def test_devices_and_num_nodes_refuse_bad_values(tmp_path, devices, num_nodes, match):
    with pytest.raises(ConfigurationError, match=match):
        make(tmp_path, accelerator="cpu", devices=devices, num_nodes=num_nodes)


def test_devices_must_match_the_launchers_processes():
    env = ClusterEnvironment("torchrun", 1, 4, 1, 2, 0, "127.0.0.1", 29500)
    check_launched(parse_devices(2, "cpu", 2), env)
    check_launched(parse_devices("auto", "cpu", 2), env)
    with pytest.raises(ConfigurationError, match=r"devices=3, num_nodes=1\) asks for 3 process\(es\).* started 2 per"):
        check_launched(parse_devices(3, "cpu", 1), env)


def test_device_indices_pick_each_ranks_device():
    plan = DevicePlan(2, 1, "cuda", (1, 3))  # devices=[1, 3] on a machine with GPUs
    strategy = strategy_with_device("ddp_find_unused_parameters_true", plan, local_rank=1)
    assert strategy.root_device == torch.device("cuda", 3) and strategy.ddp_kwargs["find_unused_parameters"]
    with pytest.raises(ConfigurationError, match="CUDA_VISIBLE_DEVICES=1,3 and pass devices=2"):
        strategy_with_device("xla", plan, local_rank=0)


def test_devices_n_needs_a_script_to_run_again(monkeypatch):
    import os
    import types

    from trainforge.trainer.cluster import script_launcher

    # what `python -c CODE` shows the program: sys.argv[0] == "-c", a __main__ module without a spec or a file
    monkeypatch.setattr(sys, "argv", ["-c"])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    rank_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_PORT")
    for name in (*rank_vars, "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)  # a plain process, not a launched rank

    def started(*args, **kwargs):
        raise AssertionError("a copy of the program was started: devices=2 should have been refused")

    monkeypatch.setattr(script_launcher, "_Child", started)
    try:
        with pytest.raises(ConfigurationError) as refused:
            Trainer(accelerator="cpu", devices=2, max_epochs=1)
    finally:  # had it made this process rank 0: not for the tests after this one
        for name in (*rank_vars, "MASTER_ADDR"):
            os.environ.pop(name, None)
    assert "Trainer(devices=N) with N > 1 starts N - 1 copies of the running script" in str(refused.value)
    assert "notebook_launcher" in str(refused.value)


# `python lightning_devices.py` is forked from the rank server (tests/helpers/forklaunch.py): rank 0 is that
# process; rank 1 is what is tested, the real copy of the script that Trainer(devices=2) starts (a fresh
# `python lightning_devices.py`, trainer/cluster/script_launcher.py).
@pytest.mark.slow
def test_devices_2_from_python_script_runs_two_ranks(tmp_path):
    import json

    out = forklaunch.run_script(SCRIPTS / "lightning_devices.py", tmp_path, timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    assert {r["strategy"] for r in ranks} == {"ddp"} and ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[0]["step"] == ranks[1]["step"] == 2 * 32 // (4 * 2)  # 2 epochs, batches of 4 split over 2 ranks
    assert ranks[0]["weight"] == ranks[1]["weight"], out.stdout[-2000:]  # gradients averaged over the two


@pytest.mark.slow
def test_a_failing_child_fails_rank_0_with_its_traceback(tmp_path):
    # teardown: rank 0's uncaught error goes through sys.excepthook (the launcher's hook) and the interpreter's
    # own exit, as under `python`; without it the rank server would print it and skip the hook
    out = forklaunch.run_script(
        SCRIPTS / "lightning_devices.py", tmp_path, "fail", timeout=240, check=False, teardown=True
    )
    assert out.returncode != 0
    report = out.stdout[out.stdout.index("trainforge: Trainer(devices=2): rank 1") :]
    assert "exited with code 1; its last output:" in report and "ValueError: rank 1 breaks on purpose" in report


@pytest.mark.slow
def test_a_child_failing_before_its_trainer_ends_rank_0_waiting_in_the_rendezvous(tmp_path):
    # rank 0 waits for rank 1 in the rendezvous (native code, no Python signal handler runs): it used to wait
    # for the process group's timeout (30 min)
    start = time.monotonic()
    out = forklaunch.run_script(
        SCRIPTS / "lightning_devices.py", tmp_path, "early", timeout=120, check=False, teardown=True
    )
    assert out.returncode == 1 and time.monotonic() - start < 100, out.stdout[-2000:]
    report = out.stdout[out.stdout.index("trainforge: Trainer(devices=2): rank 1") :]
    assert (
        "exited with code 1; its last output:" in report and "RuntimeError: rank 1 fails before its Trainer" in report
    )


# ---- Lightning 1.x's arguments, Lightning's own callbacks, Lightning 1.x's signatures ------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gpus": 1}, r"Trainer\(gpus=1\) is Lightning's .* pass accelerator='gpu', devices=N"),
        ({"plugins": ["bf16"]}, r"Trainer\(plugins=\['bf16'\]\) is Lightning's .* precision= for a precision plugin"),
        ({"resume_from_checkpoint": "x.ckpt"}, r"pass trainer.fit\(model, ..., ckpt_path=PATH\)"),
        ({"fast_dev_run": True}, r"unknown argument fast_dev_run=True; its arguments are: accelerator, strategy"),
    ],
)
def test_lightning_1x_trainer_arguments_get_the_2x_way(tmp_path, kwargs, match):
    # a TypeError from __init__ named neither the argument's replacement nor the valid ones
    with pytest.raises(ConfigurationError, match=match):
        make(tmp_path, **kwargs)


def test_a_lightning_callback_is_refused_with_trainforges_name_for_it(tmp_path):
    # stands for lightning.pytorch's (Lightning is not a dependency): only its module path matters
    lightning_checkpoint = type("ModelCheckpoint", (), {"__module__": "lightning.pytorch.callbacks.model_checkpoint"})
    instead = r"use trainforge.callbacks.ModelCheckpoint \(`from trainforge.callbacks import ModelCheckpoint`\)"
    with pytest.raises(ConfigurationError, match=r"callbacks is Lightning's lightning\.pytorch.*" + instead):
        make(tmp_path, callbacks=lightning_checkpoint())
    with pytest.raises(ConfigurationError, match=r"callbacks\[1\] is Lightning's .*" + instead):
        make(tmp_path, callbacks=[ModelCheckpoint(), lightning_checkpoint()])


def test_lightning_1x_hook_and_step_signatures_fail_at_fit_start_with_the_2x_form(tmp_path):
    class EpochOutputs(Boring):
        def on_train_epoch_end(self, outputs):
            pass

    class OptimizerIdx(Boring):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return super().training_step(batch, batch_idx)

    # the hook fired only at the epoch's end (or never, with max_steps inside it): a TypeError after training
    with pytest.raises(
        ConfigurationError,
        match=r"EpochOutputs.on_train_epoch_end\(outputs\) needs outputs, which "
        r"Lightning 2.x does not pass: the Trainer calls on_train_epoch_end\(\)\. Lightning 2.0 removed",
    ):
        make(tmp_path, max_steps=1, logger=False).fit(EpochOutputs(), loader())
    with pytest.raises(
        ConfigurationError,
        match=r"training_step\(batch, batch_idx, optimizer_idx\) takes "
        r"optimizer_idx: .* Set self.automatic_optimization = False",
    ):
        make(tmp_path, max_steps=1, logger=False).fit(OptimizerIdx(), loader())


# ---- strategies ---------------------------------------------------------------------------------
def test_lightning_strategy_names():
    assert resolve_strategy("ddp_find_unused_parameters_true").ddp_kwargs["find_unused_parameters"] is True
    assert resolve_strategy("ddp_find_unused_parameters_false").ddp_kwargs["find_unused_parameters"] is False
    assert resolve_strategy("single_device").name == resolve_strategy("single").name


@pytest.mark.parametrize(
    "name, match",
    [
        ("ddp_spawn", "strategy='ddp_spawn' \\(Lightning's\\) is not supported: .* pass strategy='ddp'"),
        ("ddp_fork_find_unused_parameters_true", "is not supported: .*notebook_launcher"),
        ("ddp_notebook", "notebook_launcher"),
        ("dp", "DataParallel is not supported"),
        ("deepspeed_stage_9", "is not one of: auto, single, ddp.*deepspeed_stage_2"),
    ],
)
def test_lightning_strategy_names_refused_with_the_trainforge_way(tmp_path, name, match):
    with pytest.raises(ConfigurationError, match=match):
        make(tmp_path, strategy=name)


# ---- fit / validate / test / predict ----------------------------------------------------------------
class Data(DataModule):
    def train_dataloader(self):
        return loader()

    def val_dataloader(self):
        return loader(16, 1)

    def test_dataloader(self):
        return loader(16, 2)

    def predict_dataloader(self):
        return loader(16, 3)


def test_a_datamodule_passed_where_the_loaders_go(tmp_path):
    trainer, dm, module = make(tmp_path, enable_checkpointing=False, logger=False), Data(), Boring()
    trainer.fit(module, dm)  # positional, as Lightning detects it
    assert trainer.global_step == 4 and "valid_loss" in trainer.callback_metrics
    (result,) = trainer.test(module, dm, verbose=False)
    assert result["test_loss"] == pytest.approx(loss_of(module, dm.test_dataloader()), abs=1e-6)
    predictions = trainer.predict(module, dm)
    assert torch.allclose(torch.cat(predictions), module(data(16, 3).tensors[0]))
    with pytest.raises(ConfigurationError, match="got both dataloaders and datamodule="):
        trainer.test(module, loader(), datamodule=dm)
    with pytest.raises(ConfigurationError, match=r"Trainer.fit\(\) got loaders and datamodule="):
        trainer.fit(module, loader(), datamodule=dm)


def test_test_and_validate_return_one_dict_per_loader_and_print_the_table(tmp_path, capsys):
    module = Boring()
    trainer = make(tmp_path, enable_checkpointing=False, logger=False, enable_model_summary=False)
    trainer.fit(module, loader())
    capsys.readouterr()
    results = trainer.test(module, loader(16, 2))
    assert results == [{"test_loss": pytest.approx(loss_of(module, loader(16, 2)), abs=1e-6)}]
    table = capsys.readouterr().out
    assert "Test metric" in table and "DataLoader 0" in table and f"{results[0]['test_loss']}" in table
    validated = trainer.validate(module, loader(16, 1), verbose=False)
    assert validated == [{"valid_loss": pytest.approx(loss_of(module, loader(16, 1), 1.0), abs=1e-6)}]
    assert capsys.readouterr().out == ""
    assert trainer.predict(module, loader(16, 3), return_predictions=False) is None


def test_ckpt_path_best_and_last_and_model_none(tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="valid_loss", mode="min", save_last=True)
    module = Boring()
    trainer = make(tmp_path, max_epochs=3, callbacks=[ckpt], logger=False)
    trainer.fit(module, loader(), loader(16, 1))
    last = loss_of(module, loader(16, 1), 1.0)
    (best,) = trainer.validate(module, loader(16, 1), ckpt_path="best", verbose=False)
    assert best["valid_loss"] == pytest.approx(ckpt.best_model_score, abs=1e-6) and best["valid_loss"] != last
    with pytest.warns(UserWarning, match=r"ckpt_path=None\) was called without a model: the best checkpoint"):
        (again,) = trainer.validate(dataloaders=loader(16, 1), verbose=False)  # model=None: the best
    assert again == best
    (from_last,) = trainer.validate(module, loader(16, 1), ckpt_path="last", verbose=False)
    assert from_last["valid_loss"] == pytest.approx(last, abs=1e-6)


def test_eval_arguments_refused(tmp_path):
    trainer = make(tmp_path, enable_checkpointing=False, logger=False)
    with pytest.raises(ConfigurationError, match=r"Trainer.test\(\) got no model and this Trainer has run none"):
        trainer.test(dataloaders=loader())
    with pytest.raises(CheckpointError, match=r"ckpt_path='best'\): this Trainer has no ModelCheckpoint"):
        trainer.test(Boring(), loader(), ckpt_path="best")
    with pytest.raises(ConfigurationError, match="ckpt_path=3 must be 'best', 'last' or a checkpoint directory"):
        trainer.test(Boring(), loader(), ckpt_path=3)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        trainer.validate(Boring(), loader(), ckpt_path=str(tmp_path / "nope"))
    with pytest.raises(ConfigurationError, match="return_predictions='yes' must be True, False or None"):
        trainer.predict(Boring(), loader(), return_predictions="yes")


def test_a_child_that_saved_on_a_stop_signal_is_not_a_failure_of_the_script_launch():
    """Trainer(devices=N) from a plain script: a rank that exits 128 + a stop signal (it saved its step,
    trainer/cluster/stop_signals.py) did not fail, so rank 0 neither raises nor exits 1; any other code does.
    Rank 0's own failure signal is a real-time one, leaving SIGUSR1 (a default stop signal) free."""
    import signal

    from trainforge.trainer.cluster import script_launcher

    assert script_launcher._FAILURE_SIGNAL not in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
    stopped = [script_launcher._Child(r, [sys.executable, "-c", "raise SystemExit(143)"], {}) for r in (1, 2)]
    launch = script_launcher._Launch(stopped)  # not started: at_exit alone judges the exit codes
    for child in stopped:
        child.proc.wait(timeout=60)
    launch.at_exit()  # would os._exit(1) on a failure
    assert launch.failure is None
    failing = script_launcher._Child(1, [sys.executable, "-c", "raise SystemExit(3)"], {})
    failing.proc.wait(timeout=60)
    launch = script_launcher._Launch([failing])
    launch.rank0_failed = True  # rank0_failed: report, do not os._exit the test
    launch.at_exit()
    assert launch.failure is not None and "exited with code 3" in launch.failure


def test_trainforge_lightning_gives_lightnings_names_for_trainforges_classes():
    import trainforge
    import trainforge.lightning as L

    assert (L.LightningModule, L.LightningDataModule, L.Trainer) == (
        trainforge.TrainingModule,
        trainforge.DataModule,
        trainforge.Trainer,
    )
    assert L.Callback is trainforge.callbacks.Callback and L.seed_everything is trainforge.seed_everything
