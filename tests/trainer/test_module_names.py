"""Issue 20: the TrainingModule and DataModule names Lightning programs use -- hparams and
save_hyperparameters, load_from_checkpoint (trainforge directories and Lightning .ckpt files, read
without unpickling code), toggle_optimizer/untoggle_optimizer, clip_gradients, steps without
batch_idx, a validation loader without validation_step, DataModule.trainer/hparams."""

from __future__ import annotations

import functools
import os
import sys
import types
import warnings
from argparse import Namespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import regression_data
from trainforge import CheckpointError, ConfigurationError, DataModule, Trainer, TrainingModule
from trainforge.trainer.loop.module_hooks import takes_batch_idx


def _trainer(tmp_path, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    return Trainer(default_root_dir=str(tmp_path), enable_progress_bar=False, enable_checkpointing=False, **kwargs)


def _loader(n=16, batch_size=8):
    return DataLoader(regression_data(n=n), batch_size=batch_size)


class Net(TrainingModule):
    """A Lightning-style module: every __init__ argument is a hyperparameter."""

    def __init__(self, hidden: int = 16, lr: float = 0.05, opt=None, note: str = "x", **extra):
        super().__init__()
        scratch = hidden * 2  # a local, not an argument: never a hyperparameter  # noqa: F841
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):  # no batch_idx: Lightning calls it with the batch alone
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        make = self.hparams.opt or functools.partial(torch.optim.SGD)
        return make(self.parameters(), lr=self.hparams["lr"])


# ---- hparams / save_hyperparameters --------------------------------------------------------------
def test_save_hyperparameters_records_init_arguments_as_lightning():
    m = Net(hidden=4, lr=0.1, depth=3)
    assert dict(m.hparams) == {"hidden": 4, "lr": 0.1, "opt": None, "note": "x", "depth": 3}  # **extra spread
    assert m.hparams.lr == m.hparams["lr"] == 0.1
    m.hparams.lr = 0.2  # mutable; hparams_initial keeps what was saved
    assert m.hparams["lr"] == 0.2 and m.hparams_initial.lr == 0.1
    with pytest.raises(AttributeError, match="no hyperparameter 'lrr'"):
        m.hparams.lrr

    class Child(Net):
        def __init__(self, width: int, lr: float = 0.3):
            super().__init__(hidden=width, lr=lr)
            self.inner = Net(hidden=2)  # a module built in __init__ records its own arguments only

    c = Child(width=5)
    assert c.hparams.hidden == 5 and c.hparams.width == 5 and c.hparams.lr == 0.3
    assert c.inner.hparams.hidden == 2 and "width" not in c.inner.hparams


def test_save_hyperparameters_names_dicts_ignore_and_logger():
    class Picks(TrainingModule):
        def __init__(self, a, b, c=3, net=None):
            super().__init__()
            self.save_hyperparameters("a", "c")

    assert dict(Picks(1, 2).hparams) == {"a": 1, "c": 3}

    class Ignores(Picks):
        def __init__(self, a, b, net=None):
            TrainingModule.__init__(self)
            self.save_hyperparameters(ignore=["net", "b"], logger=False)

    assert dict(Ignores(1, 2, net=nn.Linear(1, 1)).hparams) == {"a": 1}

    class FromDict(TrainingModule):
        def __init__(self, hparams):
            super().__init__()
            self.save_hyperparameters(hparams)

    assert FromDict(Namespace(lr=1, k="v")).hparams.k == "v"
    assert dict(FromDict({"lr": 2}).hparams) == {"lr": 2}


def test_save_hyperparameters_bad_input_is_refused_or_warned():
    class Bad(TrainingModule):
        def __init__(self, lr=0.1, net=None, **how):
            super().__init__()
            self.save_hyperparameters(*how.pop("args", ()), **how)

    with pytest.raises(ConfigurationError, match=r"'lrr' is not an argument of Bad.__init__ \(its arguments: lr, net"):
        Bad(args=("lrr",))
    with pytest.raises(ConfigurationError, match="an argument name or a list of argument names"):
        Bad(ignore=3)
    with pytest.raises(ConfigurationError, match="logger=1"):
        Bad(logger=1)
    with pytest.raises(ConfigurationError, match="either names of Bad.__init__ arguments or one dict"):
        Bad(args=({"a": 1}, {"b": 2}))
    with pytest.raises(ConfigurationError, match=r"int\): give names"):
        Bad(args=(3,))
    with pytest.warns(UserWarning, match=r"ignore=\['lrr'\]\): Bad.__init__ has no argument 'lrr'"):
        Bad(ignore="lrr")
    with pytest.warns(UserWarning, match=r"'net' of Bad is an nn.Module.*ignore=\['net'\]"):
        Bad(net=nn.Linear(1, 1))


def test_logged_hparams_follow_logger_flag_and_merge_with_the_datamodule(tmp_path):
    class DM(DataModule):
        def __init__(self, batch_size=8, lr=0.05):  # no super().__init__(): hparams still work
            self.save_hyperparameters()

        def train_dataloader(self):
            return _loader(batch_size=self.hparams.batch_size)

    trainer = _trainer(tmp_path)
    trainer.fit(Net(lr=0.05), datamodule=DM())
    assert trainer.hparams["hidden"] == 16 and trainer.hparams["batch_size"] == 8
    with pytest.raises(ConfigurationError, match="'lr' is 0.01 in Net and 0.05 in DM, and both are logged"):
        _trainer(tmp_path).fit(Net(lr=0.01), datamodule=DM())  # Lightning refuses it at fit start too

    class Quiet(Net):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters(logger=False)

    trainer = _trainer(tmp_path)
    trainer.fit(Quiet(), _loader())
    assert "hidden" not in trainer.hparams and "trainer" in trainer.hparams


# ---- load_from_checkpoint: trainforge directories --------------------------------------------------
def test_load_from_checkpoint_of_a_trainforge_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Net(hidden=6, lr=0.1, note="saved")
    trainer = _trainer(tmp_path)
    trainer.fit(model, _loader())
    trainer.save_checkpoint(tmp_path / "ckpt")
    x = torch.randn(4, 8)
    loaded = Net.load_from_checkpoint(tmp_path / "ckpt", lr=0.5)
    assert type(loaded) is Net and loaded.hparams.note == "saved" and loaded.hparams.lr == 0.5
    assert torch.equal(loaded(x), model(x))
    with pytest.raises(TypeError, match="cannot be called on an instance: model = Net.load_from_checkpoint"):
        model.load_from_checkpoint(tmp_path / "ckpt")

    trainer.save_weights(tmp_path / "weights")  # weights alone: no hyperparameters
    assert torch.equal(Net.load_from_checkpoint(tmp_path / "weights", hidden=6)(x), model(x))

    class Needs(Net):
        def __init__(self, hidden):
            super().__init__(hidden=hidden)

    with pytest.raises(ConfigurationError, match=r"needs 'hidden' .* it holds no hyperparameters.*hidden=\.\.\."):
        Needs.load_from_checkpoint(tmp_path / "weights")


def test_hyperparameters_that_are_not_plain_data_are_asked_for_by_name(tmp_path):
    model = Net(hidden=3, opt=functools.partial(torch.optim.SGD, momentum=0.9))
    trainer = _trainer(tmp_path)
    trainer.fit(model, _loader())
    trainer.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigurationError, match=r"does not hold the hyperparameter\(s\) opt \(functools.partial\)"):
        Net.load_from_checkpoint(tmp_path / "ckpt")
    loaded = Net.load_from_checkpoint(tmp_path / "ckpt", opt=functools.partial(torch.optim.Adam))
    assert loaded.hparams.hidden == 3 and loaded.hparams.opt.func is torch.optim.Adam


def test_load_from_checkpoint_bad_arguments_are_refused(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.fit(Net(), _loader())
    trainer.save_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        Net.load_from_checkpoint(tmp_path / "nothing")
    with pytest.raises(ConfigurationError, match="give the path"):
        Net.load_from_checkpoint(3.5)
    with pytest.raises(ConfigurationError, match=r"weights_only=False\): trainforge reads checkpoints without"):
        Net.load_from_checkpoint(path, weights_only=False)
    with pytest.raises(ConfigurationError, match="strict='yes'"):
        Net.load_from_checkpoint(path, strict="yes")
    with pytest.raises(ConfigurationError, match="map_location=3.5"):
        Net.load_from_checkpoint(path, map_location=3.5)
    with pytest.raises(ConfigurationError, match="read with safetensors, onto one device"):
        Net.load_from_checkpoint(path, map_location={"cuda:0": "cpu"})
    with pytest.raises(ConfigurationError, match="give a .yaml or .yml file"):
        Net.load_from_checkpoint(path, hparams_file=tmp_path / "h.csv")

    class Strict(Net):
        def __init__(self, hidden=16):
            super().__init__(hidden=hidden)

    with pytest.raises(ConfigurationError, match=r"Strict.__init__ takes no argument 'lrr' \(its arguments: hidden\)"):
        Strict.load_from_checkpoint(path, lrr=1)

    class Bigger(Net):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(2, 2)

    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['extra.weight'.*strict=False loads"):
        Bigger.load_from_checkpoint(path)
    with pytest.warns(UserWarning, match="in the module but not in the checkpoint"):
        Bigger.load_from_checkpoint(path, strict=False)
    (tmp_path / "h.yaml").write_text("hidden: 16\nnote: from-yaml\n")
    assert Net.load_from_checkpoint(path, hparams_file=tmp_path / "h.yaml").hparams.note == "from-yaml"


# ---- load_from_checkpoint: Lightning .ckpt files -------------------------------------------------------
def _lightning_ckpt(module, **extra):
    """The layout Lightning 2.x writes (trainer.save_checkpoint), as plain data."""
    return {
        "epoch": 1,
        "global_step": 8,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": module.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.state_dict": {"_batches_that_stepped": 8}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None, "dirpath": "/x"}},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.05, "params": [0, 1, 2, 3]}]}],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": dict(module.hparams),
        **extra,
    }


def test_load_from_checkpoint_of_a_lightning_ckpt(tmp_path, monkeypatch):
    torch.manual_seed(1)
    source = Net(hidden=5, lr=0.2, note="lightning")
    torch.save(_lightning_ckpt(source), tmp_path / "model.ckpt")
    loaded = Net.load_from_checkpoint(tmp_path / "model.ckpt")
    x = torch.randn(3, 8)
    assert torch.equal(loaded(x), source(x)) and loaded.hparams.note == "lightning" and loaded.hparams.hidden == 5

    # Lightning's AttributeDict and argparse.Namespace, pickled by a Lightning that this process lacks
    names = ["lightning", "lightning.fabric", "lightning.fabric.utilities", "lightning.fabric.utilities.data"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    AttributeDict = type("AttributeDict", (dict,), {"__module__": names[-1]})
    sys.modules[names[-1]].AttributeDict = AttributeDict

    class OneDict(TrainingModule):
        def __init__(self, hparams, args=None):
            super().__init__()
            self.save_hyperparameters(hparams)
            self.net = nn.Linear(2, hparams["width"])

    one = OneDict({"width": 3})
    ckpt = _lightning_ckpt(one, hparams_name="hparams")
    ckpt["hyper_parameters"] = AttributeDict(width=3, args=Namespace(seed=7))
    torch.save(ckpt, tmp_path / "attrdict.ckpt")
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    loaded = OneDict.load_from_checkpoint(tmp_path / "attrdict.ckpt")
    assert loaded.hparams.width == 3 and loaded.hparams.args.seed == 7
    assert torch.equal(loaded.net.weight, one.net.weight)


class _Hostile:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_lightning_ckpt_holding_code_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = Net()
    torch.save(_lightning_ckpt(module, hyper_parameters={"hidden": 16, "x": _Hostile()}), "hostile.ckpt")
    torch.save(_lightning_ckpt(module, hyper_parameters={"opt": functools.partial(torch.optim.SGD)}), "partial.ckpt")
    with pytest.raises(
        CheckpointError, match=r"refused to load hostile.ckpt: .*(posix|os)\.system.*Nothing in it"
    ) as e:
        Net.load_from_checkpoint("hostile.ckpt")
    assert "weights_only=False" not in str(e.value) and not os.path.exists("pwned")
    with pytest.raises(CheckpointError, match=r"functools.partial.*save_hyperparameters\(ignore=\[\.\.\.\]\)"):
        Net.load_from_checkpoint("partial.ckpt")
    torch.save({"model": module.state_dict()}, "other.pt")
    with pytest.raises(CheckpointError, match=r"not a Lightning checkpoint \(no 'state_dict' dict in it; it holds"):
        Net.load_from_checkpoint("other.pt")
    with open("garbage.ckpt", "wb") as f:
        f.write(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="cannot be read as a Lightning checkpoint: it is not the zip") as e:
        Net.load_from_checkpoint("garbage.ckpt")
    assert "weights_only" not in str(e.value)


def test_configure_model_runs_before_the_weights_are_loaded(tmp_path):
    class Lazy(TrainingModule):
        def __init__(self, width=4):
            super().__init__()
            self.save_hyperparameters()
            self.head = None

        def configure_model(self):
            if self.head is None:
                self.head = nn.Linear(self.hparams.width, 1)

    source = Lazy()
    source.configure_model()
    torch.save(_lightning_ckpt(source), tmp_path / "lazy.ckpt")
    assert torch.equal(Lazy.load_from_checkpoint(tmp_path / "lazy.ckpt").head.weight, source.head.weight)


# ---- manual optimization: toggle_optimizer, clip_gradients ---------------------------------------------
class Gan(TrainingModule):
    """Lightning's GAN pattern: two optimizers, each toggled around its step, gradients clipped."""

    def __init__(self, clip=None, algorithm=None, torch_clip=False):
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d = nn.Linear(8, 1), nn.Linear(8, 1)
        self.clip, self.algorithm, self.torch_clip = clip, algorithm, torch_clip
        self.frozen_seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        self.frozen_seen.append([p.requires_grad for p in (*self.g.parameters(), *self.d.parameters())])
        loss = nn.functional.mse_loss(self.g(x) * 3, y)
        opt_g.zero_grad()
        self.manual_backward(loss)
        if self.torch_clip:
            torch.nn.utils.clip_grad_norm_(self.g.parameters(), 0.01)
        elif self.clip is not None:
            self.clip_gradients(opt_g, gradient_clip_val=self.clip, gradient_clip_algorithm=self.algorithm)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        with self.toggled_optimizer(opt_d):
            loss_d = nn.functional.mse_loss(self.d(x), self.g(x))
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            opt_d.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)


def _fit_gan(tmp_path, **kwargs):
    torch.manual_seed(0)
    model = Gan(**kwargs)
    _trainer(tmp_path).fit(model, _loader())
    return model


def test_toggle_optimizer_and_clip_gradients_in_a_gan(tmp_path):
    clipped = _fit_gan(tmp_path, clip=0.01)
    assert clipped.frozen_seen[0] == [True, True, False, False]  # only the generator's parameters
    assert all(p.requires_grad for p in clipped.parameters())  # restored after untoggle
    by_torch = _fit_gan(tmp_path, torch_clip=True)
    plain = _fit_gan(tmp_path)
    assert torch.equal(clipped.g.weight, by_torch.g.weight) and not torch.equal(clipped.g.weight, plain.g.weight)
    assert not torch.equal(_fit_gan(tmp_path, clip=0.01, algorithm="value").g.weight, plain.g.weight)
    assert torch.equal(_fit_gan(tmp_path, clip=0).g.weight, plain.g.weight)  # 0: no clipping (Lightning)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, g, d: m.clip_gradients(g, gradient_clip_val=-1.0), "gradient_clip_val=-1.0"),
        (lambda m, g, d: m.clip_gradients(g, gradient_clip_val="1"), "gradient_clip_val='1'"),
        (lambda m, g, d: m.clip_gradients(g, 1.0, gradient_clip_algorithm="l2"), "'norm' .* or 'value'"),
        (lambda m, g, d: m.clip_gradients(torch.optim.SGD(m.g.parameters()), 1.0), "not one of the optimizers"),
        (lambda m, g, d: m.toggle_optimizer(torch.optim.SGD(m.g.parameters())), "not one of the optimizers"),
        (lambda m, g, d: (m.toggle_optimizer(g), m.untoggle_optimizer(d)), "untoggle the one you toggled"),
    ],
)
def test_toggle_and_clip_bad_input_is_refused(tmp_path, call, match):
    class Calls(Gan):
        def training_step(self, batch, batch_idx):
            call(self, *self.optimizers())

    with pytest.raises(ConfigurationError, match=match):
        _trainer(tmp_path).fit(Calls(), _loader())


# ---- steps without batch_idx; validation without validation_step; DataModule.trainer -----------------------
def test_steps_without_batch_idx_follow_lightnings_rule(tmp_path):
    class NoIdx(Net):
        def validation_step(self, batch):
            self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]))

        def test_step(self, batch):
            self.log("test_loss", nn.functional.mse_loss(self(batch[0]), batch[1]))

        def predict_step(self, batch):
            return self(batch[0])

    trainer = _trainer(tmp_path)
    model = NoIdx()
    trainer.fit(model, _loader(), _loader())
    assert "val_loss" in trainer.callback_metrics
    assert "test_loss" in trainer.test(model, _loader(), verbose=False)[0]
    assert len(trainer.predict(model, _loader())) == 2
    assert takes_batch_idx(lambda batch, i: 0) and takes_batch_idx(lambda *a: 0)
    assert not takes_batch_idx(lambda batch, **kw: 0) and not takes_batch_idx(lambda batch: 0)


def test_a_validation_loader_without_validation_step_warns_and_skips_validation(tmp_path):
    class Watch(Net):
        validated = 0

        def on_validation_epoch_start(self):
            self.validated += 1

    model = Watch()
    with pytest.warns(UserWarning, match="Watch has no validation_step: validation is skipped, as in Lightning"):
        _trainer(tmp_path).fit(model, _loader(), _loader())
    assert model.validated == 0


def test_datamodule_trainer_and_hparams_as_lightning_hydra_template(tmp_path):
    class MNISTLike(DataModule):
        def __init__(self, batch_size: int = 8, pin_memory: bool = False):
            super().__init__()
            self.save_hyperparameters(logger=False)
            self.seen_trainer = "unset"

        def setup(self, stage):
            self.seen_trainer = self.trainer
            if self.trainer is not None:
                self.batch_size_per_device = self.hparams.batch_size // self.trainer.world_size

        def train_dataloader(self):
            return _loader(batch_size=self.batch_size_per_device)

    dm = MNISTLike()
    assert dm.trainer is None and dm.hparams.batch_size == 8
    trainer = _trainer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(Net(), datamodule=dm)
    assert dm.seen_trainer is trainer and dm.trainer is trainer and "batch_size" not in trainer.hparams
    trainer.save_checkpoint(tmp_path / "ckpt")  # the datamodule's hyperparameters are stored beside the module's
    loaded = Net.load_from_checkpoint(tmp_path / "ckpt")
    assert loaded.hparams.hidden == 16
