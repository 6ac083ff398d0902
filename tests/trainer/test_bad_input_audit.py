"""The bad-input audit (issue 10): each mistake is a clear error before training starts (naming the
value and the fix) or a warning once, never silence, a late ZeroDivisionError or a deep TypeError."""

from __future__ import annotations

import logging
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from tests.helpers.procs import run
from tests.helpers.procs import test_env as child_env
from trainforge import CheckpointError, ConfigurationError, Trainer
from trainforge.callbacks import EarlyStopping, ModelCheckpoint
from trainforge.strategies import DDPStrategy, FSDPStrategy
from trainforge.strategies.checkpoint.io import CheckpointWriter
from trainforge.trainer.cli.launch_settings import validate


def loader():
    return DataLoader(regression_data(), batch_size=16)


def fit(tmp_path, module=None, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("enable_checkpointing", False)
    trainer = Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, **kwargs)
    trainer.fit(module if module is not None else Regressor(make_net()), loader())
    return trainer


# ---- Trainer arguments: errors at construction ---------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"check_val_every_n_epoch": 0}, r"check_val_every_n_epoch=0 must be an int >= 1 .* or None"),
        ({"val_check_interval": 0}, r"val_check_interval=0 .* pass an int >= 1"),
        ({"gradient_clip_val": "1.0"}, r"gradient_clip_val='1.0' is a string; pass a number: gradient_clip_val=1.0"),
        ({"check_val_every_n_epoch": "2"}, r"check_val_every_n_epoch='2' is a string; .*=2"),
        ({"max_epochs": True}, r"max_epochs=True is a bool"),
        ({"max_steps": "100"}, r"max_steps='100' is a string"),
        ({"limit_val_batches": "0.5"}, r"limit_val_batches='0.5' is a string"),
        (
            {"callbacks": ModelCheckpoint},
            r"callbacks=ModelCheckpoint is not a list",
        ),  # one instance is taken (Lightning)
        ({"callbacks": [EarlyStopping]}, r"callbacks\[0\] is the class EarlyStopping, not an instance"),
        ({"callbacks": ["ckpt"]}, r"callbacks\[0\]='ckpt' is a str, not a Callback"),
        (
            {"strategy": DDPStrategy},
            r"strategy=DDPStrategy is a class; pass an instance, strategy=DDPStrategy\(...\), "
            r"or its name 'ddp'",
        ),
        ({"strategy": 3}, r"strategy=3 is neither a name"),
    ],
)
def test_constructor_mistakes_name_the_value_and_the_fix(tmp_path, kwargs, message):
    kwargs.setdefault("max_epochs", 1)
    with pytest.raises(ConfigurationError, match=message):
        Trainer(default_root_dir=str(tmp_path), **kwargs)


def test_default_root_dir_that_is_a_file(tmp_path):
    (tmp_path / "runs").write_text("not a directory")
    for root in (tmp_path / "runs", tmp_path / "runs" / "sub"):
        with pytest.raises(ConfigurationError, match=r"runs is a file, not a directory"):
            Trainer(default_root_dir=str(root), max_epochs=1)


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda: DDPStrategy(timeout=30),
            r"DDPStrategy\(timeout=30\) must be a datetime.timedelta, e.g. "
            r"timeout=timedelta\(seconds=30\)",
        ),
        (lambda: FSDPStrategy(timeout="30m"), r"FSDPStrategy\(timeout='30m'\) must be a datetime.timedelta"),
        (lambda: DDPStrategy(timeout=timedelta(0)), r"must be positive"),
        (
            lambda: DDPStrategy(find_unused_parameter=True),
            r"unknown keyword argument\(s\) \['find_unused_parameter'\].*"
            r"accepts: .*find_unused_parameters",
        ),
    ],
)
def test_strategy_arguments_checked_at_construction(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()


# ---- callbacks and metric names --------------------------------------------------------------------
@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: EarlyStopping("val/loss", patience=2.7), r"patience=2.7\) must be an integer >= 0"),
        (lambda: EarlyStopping("val/loss", patience=True), r"patience=True\) must be an integer"),
        (lambda: EarlyStopping(""), r"EarlyStopping\(monitor\)='': a metric name must be a non-empty string"),
        (lambda: EarlyStopping(None), r"EarlyStopping\(monitor\)=None"),
        (lambda: ModelCheckpoint(monitor=3), r"ModelCheckpoint\(monitor\)=3: a metric name"),
    ],
)
def test_callback_arguments(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()


@pytest.mark.parametrize("name", ["", "  ", 3, None])
def test_logged_metric_names_must_be_non_empty_strings(tmp_path, name):
    class BadName(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log(name, loss)
            return loss

    with pytest.raises(ConfigurationError, match=r"self.log\(name\)=.*non-empty string"):
        fit(tmp_path, BadName(make_net()))


# ---- what training_step returns ----------------------------------------------------------------------
class Returns(Regressor):
    def __init__(self, what):
        super().__init__(make_net())
        self.what = what

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        x, _ = batch
        return {
            "dict": lambda: {"los": loss},
            "detached": lambda: loss.detach(),
            "item": lambda: loss.item(),
            "unreduced": lambda: self.net(x) ** 2,
            "none": lambda: None,
        }[self.what]()


@pytest.mark.parametrize(
    "what,message",
    [
        ("dict", r"batch 0\) returned a dict without a 'loss' key \(keys: \['los'\]\)"),
        ("detached", r"batch 0\) returned a loss that does not require grad"),
        ("item", r"batch 0\) returned a float .*not loss.item\(\)"),
        ("unreduced", r"batch 0\) returned a loss of shape \(16, 1\); reduce it"),
    ],
)
def test_bad_training_step_output_fails_at_the_first_batch(tmp_path, what, message):
    module = Returns(what)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ConfigurationError, match=message):
        fit(tmp_path, module)
    assert len(module.losses) == 1  # the first batch, not an epoch later
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_training_step_returning_none_for_a_whole_epoch_warns_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        fit(tmp_path, Returns("none"), max_epochs=3)
    warnings = [r for r in caplog.records if "returned None for all 4 batches" in r.getMessage()]
    assert len(warnings) == 1 and "nothing was trained" in warnings[0].getMessage()


def test_skipping_some_batches_with_none_stays_silent(tmp_path, caplog):
    class SkipOdd(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx % 2 else loss

    with caplog.at_level(logging.WARNING, logger="trainforge"):
        fit(tmp_path, SkipOdd(make_net()), max_epochs=2)
    assert "returned None" not in caplog.text


# ---- configure_optimizers' scheduler -----------------------------------------------------------------
def test_unknown_scheduler_key(tmp_path):
    class Typo(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "intreval": "step"},
            }

    with pytest.raises(
        ConfigurationError,
        match=r"unknown key\(s\) \['intreval'\]; valid keys: scheduler, "
        r"interval, frequency, name",
    ):
        fit(tmp_path, Typo(make_net()))


def test_scheduler_on_another_optimizer(tmp_path):
    class Other(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            other = torch.optim.Adam(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(other, 1)}

    with pytest.raises(ConfigurationError, match=r"StepLR was built on another optimizer .*\(Adam vs SGD\)"):
        fit(tmp_path, Other(make_net()))


# ---- resuming --------------------------------------------------------------------------------------
def _saved(tmp_path):
    trainer = fit(tmp_path / "first", enable_checkpointing=False)
    return trainer.save_checkpoint(str(tmp_path / "ckpt"))


def test_resume_into_another_model_shape_names_checkpoint_and_keys(tmp_path):
    path = _saved(tmp_path)
    wider = Regressor(
        torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Dropout(0.0), torch.nn.Linear(64, 1))
    )
    trainer = Trainer(
        default_root_dir=str(tmp_path), enable_progress_bar=False, max_epochs=2, enable_checkpointing=False
    )
    with pytest.raises(
        CheckpointError,
        match=r"ckpt does not fit this model \(different shapes: \['net.0.weight: "
        r"checkpoint \(32, 8\) vs model \(64, 8\)'",
    ):
        trainer.fit(wider, loader(), ckpt_path=str(path))


def test_resume_with_another_optimizer_names_the_settings(tmp_path):
    path = _saved(tmp_path)

    class WithSGD(Regressor):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    trainer = Trainer(
        default_root_dir=str(tmp_path), enable_progress_bar=False, max_epochs=2, enable_checkpointing=False
    )
    with pytest.raises(
        CheckpointError,
        match=r"optimizer 0 \(SGD\) group 0 does not match the checkpoint: "
        r"settings differ: .*'betas'",
    ):
        trainer.fit(WithSGD(make_net()), loader(), ckpt_path=str(path))


def test_ckpt_path_pointing_at_the_checkpoints_root(tmp_path):
    first = fit(tmp_path, callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=0)], enable_checkpointing=True)
    trainer = Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, max_epochs=2)
    with pytest.raises(
        CheckpointError,
        match=r"is a directory of checkpoints, not one checkpoint; pass one of "
        r"them \(newest: \['epoch=0-step=4'\]\), or ckpt_path='last'",
    ):
        trainer.fit(Regressor(make_net()), loader(), ckpt_path=first.default_checkpoint_dir)


def test_fsdp_load_failure_is_a_checkpoint_error_not_a_base_exception(tmp_path):
    """torch's CheckpointException is a BaseException: it must not escape ``except Exception``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    writer = CheckpointWriter(tmp_path / "step-1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(  # the model's weights, but no optimizer state: DCP itself fails (the model check passes)
            {"model": {"weight": torch.ones(2, 3), "bias": torch.ones(2)}, "optimizers": {}},
            checkpoint_id=str(writer.tmp_dir / "dcp"),
            no_dist=True,
        )
    path = writer.finalize({"step": 1, "strategy": "fsdp"})
    model = torch.nn.Linear(3, 2)
    missing = r"step-1/dcp: cannot load the sharded checkpoint into Linear \(rank 0: RuntimeError: Missing key"
    with pytest.raises(CheckpointError, match=missing), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FSDPStrategy().load_checkpoint(path, model, [torch.optim.SGD(model.parameters(), lr=0.1)])


# ---- processes and launch settings -----------------------------------------------------------------
def test_single_strategy_in_a_multi_process_launch(tmp_path):
    script = tmp_path / "single.py"
    script.write_text(
        textwrap.dedent("""
        from trainforge import Trainer, ConfigurationError
        try:
            Trainer(strategy="single", max_epochs=1)
        except ConfigurationError as e:
            print("refused:", e, flush=True)
    """)
    )
    out = run(
        [sys.executable, str(script)], timeout=120, env=child_env(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1")
    ).stdout
    assert "refused: strategy='single' runs one process, but this one was launched as one of WORLD_SIZE=2" in out


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"strategy": "single", "nproc_per_node": 2}, r"strategy='single' runs one process, but nproc_per_node=2"),
        ({"strategy": "single", "nproc_per_node": 1, "nnodes": 2}, r"nnodes=2"),
        ({"accelerator": "cpu", "precision": "16-mixed"}, r"precision='16-mixed' needs a GPU, but accelerator='cpu'"),
    ],
)
def test_config_never_writes_what_launch_refuses(settings, message):
    with pytest.raises(ConfigurationError, match=message):
        validate(settings)


class Plateau(Regressor):
    """ReduceLROnPlateau configured as in Lightning, with its 'monitor' key (refusing the key would leave
    no way to configure it at all)."""

    def __init__(self, net, entry):
        super().__init__(net)
        self.entry = entry

    def validation_step(self, batch, batch_idx):
        self.log("val/const", 1.0)  # never improves

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, **self.entry}}


def test_reduce_lr_on_plateau_with_monitor_steps_on_the_metric_like_torch(tmp_path):
    module = Plateau(make_net(), {"monitor": "val/const"})
    trainer = Trainer(
        max_epochs=3, default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False
    )
    trainer.fit(module, DataLoader(regression_data(16), batch_size=4), DataLoader(regression_data(8), batch_size=4))
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(reference, mode="min", factor=0.5, patience=0)
    for _ in range(3):
        plateau.step(1.0)
    assert trainer.optimizers[0].param_groups[0]["lr"] == reference.param_groups[0]["lr"] == 0.025


def test_reduce_lr_on_plateau_needs_a_monitor_and_strict_false_skips_with_a_warning(tmp_path):
    with pytest.raises(ConfigurationError, match=r"ReduceLROnPlateau steps on a metric; name it"):
        fit(tmp_path / "a", Plateau(make_net(), {}))
    trainer = Trainer(
        max_epochs=2, default_root_dir=str(tmp_path / "b"), enable_progress_bar=False, enable_checkpointing=False
    )
    with pytest.warns(UserWarning, match=r"monitors 'val/missing'.*skipped \('strict': False\)"):
        trainer.fit(
            Plateau(make_net(), {"monitor": "val/missing", "strict": False}),
            DataLoader(regression_data(16), batch_size=4),
            DataLoader(regression_data(8), batch_size=4),
        )
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1


class OnMetric(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler of the user's own that takes the metric, as ReduceLROnPlateau does."""

    def __init__(self, optimizer):
        super().__init__(optimizer, lambda epoch: 1.0)
        self.seen = []

    def step(self, metric=None):  # LambdaLR's constructor calls step() once, without a metric
        if metric is not None:
            self.seen.append(metric)
        super().step()


def test_every_lightning_lr_scheduler_key_is_accepted_and_reduce_on_plateau_steps_on_the_metric(tmp_path):
    """Issue 25: Lightning's keys (scheduler, interval, frequency, monitor, strict, name, reduce_on_plateau)
    are accepted; reduce_on_plateau was refused as unknown."""

    class Marked(Plateau):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            self.sched = OnMetric(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": self.sched, **self.entry}}

    entry = {"interval": "epoch", "frequency": 1, "monitor": "val/const", "strict": True, "name": "lr"}
    module = Marked(make_net(), {**entry, "reduce_on_plateau": True})
    trainer = Trainer(
        max_epochs=2, default_root_dir=str(tmp_path / "a"), enable_progress_bar=False, enable_checkpointing=False
    )
    trainer.fit(module, loader(), DataLoader(regression_data(8), batch_size=4))
    assert module.sched.seen == [1.0, 1.0]  # step(metric) at each epoch end, as Lightning does
    with pytest.raises(ConfigurationError, match=r"reduce_on_plateau='yes' must be True \(step\(metric\) with the v"):
        fit(tmp_path / "b", Marked(make_net(), {"reduce_on_plateau": "yes", "monitor": "val/const"}))
    with pytest.raises(ConfigurationError, match=r"scheduler with reduce_on_plateau=True steps on a metric; name it"):
        fit(tmp_path / "c", Marked(make_net(), {"reduce_on_plateau": True}))
    with pytest.raises(ConfigurationError, match=r"unknown key\(s\) \['monitr'\]; valid keys: .*reduce_on_plateau"):
        fit(tmp_path / "d", Marked(make_net(), {"monitr": "val/const"}))
