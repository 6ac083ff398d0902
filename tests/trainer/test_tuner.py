"""Tuner.scale_batch_size / lr_find and find_executable_batch_size: the sizes found with an injected
out-of-memory limit, a plausible learning rate, no trace of the trials, agreement between two processes,
and bad input refused with the value, the choices and the fix."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import forklaunch, procs
from trainforge import ConfigurationError, DataModule, Trainer, TrainingModule, Tuner, seed_everything
from trainforge.utils import find_executable_batch_size

SCRIPT = Path(__file__).parent.parent / "scripts" / "tuner_ddp_run.py"


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1)


class Regression(TrainingModule):
    """``training_step`` "runs out of memory" on batches larger than ``limit``, as a GPU would."""

    def __init__(self, batch_size: int = 2, limit: int = 10**9, lr: float = 0.05) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.batch_size, self.limit, self.lr = batch_size, limit, lr
        self.data = _data()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: {x.shape[0]} > {self.limit})")
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


def _trainer(tmp_path, max_steps: int = 4, **kwargs) -> Trainer:
    return Trainer(
        default_root_dir=str(tmp_path),
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **kwargs,
    )


@pytest.mark.parametrize("mode, expected", [("power", 32), ("binsearch", 40)])
def test_scale_batch_size_finds_the_largest_size_that_runs(tmp_path, mode, expected):
    model = Regression(limit=40)
    assert Tuner(_trainer(tmp_path)).scale_batch_size(model, mode=mode, steps_per_trial=2) == expected
    assert model.batch_size == expected


def test_scale_batch_size_refuses_a_loader_that_ignores_the_size(tmp_path):
    class Fixed(Regression):
        def train_dataloader(self):
            return DataLoader(self.data, batch_size=4)  # not self.batch_size

    class Sampled(Regression):  # no batch_size attribute on the loader: measured from the batches
        def train_dataloader(self):
            return DataLoader(self.data, batch_sampler=[list(range(i, i + 4)) for i in range(0, 64, 4)])

    # every trial "succeeded" at 4 and the tuner reported 32
    with pytest.raises(
        ConfigurationError,
        match=r"set batch_size=2, but train_dataloader\(\) built a loader of "
        r"batch size 4: it does not read `batch_size`",
    ):
        Tuner(_trainer(tmp_path)).scale_batch_size(Fixed(), max_trials=5)
    model = Sampled()
    with pytest.raises(ConfigurationError, match=r"ran batches of 4 in every trial \(sizes \[2, 4, 8, 16, 32\]\)"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, max_trials=5)
    assert model.batch_size == 2  # put back


def test_scale_batch_size_on_hparams_and_datamodule(tmp_path):
    class Plain(Regression):
        def __init__(self, batch_size: int = 2) -> None:
            super().__init__(limit=24)
            del self.batch_size
            self.save_hyperparameters()

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=self.hparams.batch_size)

    model = Plain()
    assert Tuner(_trainer(tmp_path)).scale_batch_size(model, mode="binsearch") == 24
    assert model.hparams.batch_size == 24

    class Data(DataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.setups = 4, 0

        def setup(self, stage: str) -> None:
            self.setups += 1

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=self.batch_size)

    class NoSize(Regression):
        def __init__(self) -> None:
            super().__init__(limit=16)
            del self.batch_size

    data = Data()
    assert Tuner(_trainer(tmp_path)).scale_batch_size(NoSize(), datamodule=data, init_val=4) == 16
    assert data.batch_size == 16 and data.setups == 1  # the datasets are built once, the loader per trial


def test_scale_batch_size_halves_below_init_val_and_fails_clearly(tmp_path):
    assert Tuner(_trainer(tmp_path)).scale_batch_size(Regression(limit=5), init_val=64) == 4
    model = Regression(batch_size=7, limit=0)
    with pytest.raises(RuntimeError, match="no batch size from 4 down to 1"):
        Tuner(_trainer(tmp_path)).scale_batch_size(model, init_val=4)
    assert model.batch_size == 7  # put back


def test_lr_find_suggests_a_plausible_rate_and_sets_it(tmp_path):
    seed_everything(0)
    model = Regression(batch_size=64)
    finder = Tuner(_trainer(tmp_path)).lr_find(model, min_lr=1e-6, max_lr=10.0, num_training=100)
    lrs, losses = finder.results["lr"], finder.results["loss"]
    assert len(lrs) == len(losses) and 50 <= len(lrs) <= 100 and lrs == sorted(lrs) and lrs[0] == 1e-6
    assert losses[-1] > min(losses)  # stopped early once the loss diverged (above 4x its best)
    suggestion = finder.suggestion()
    assert suggestion is not None and 1e-3 <= suggestion <= 0.5  # SGD on this regression diverges above ~0.5
    assert model.lr == suggestion

    class ByHparams(Regression):
        def __init__(self, learning_rate: float = 0.1) -> None:
            super().__init__(batch_size=16)
            del self.lr
            self.save_hyperparameters()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)

    other = ByHparams()
    Tuner(_trainer(tmp_path)).lr_find(other, num_training=40)
    assert other.hparams.learning_rate == pytest.approx(other.hparams.learning_rate) != 0.1


def test_tuning_leaves_no_trace(tmp_path):
    """A fit after tuning is bit for bit the fit with the found values set by hand; no checkpoint is written."""

    def fit(model: Regression, root: Path, tune: bool) -> Regression:
        trainer = _trainer(root, max_steps=6)
        if tune:
            before = {k: v.clone() for k, v in model.state_dict().items()}
            rng = torch.get_rng_state()
            Tuner(trainer).scale_batch_size(model, mode="binsearch")
            Tuner(trainer).lr_find(model, num_training=30)
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            assert torch.equal(rng, torch.get_rng_state())
            assert all(p.grad is None for p in model.parameters())
            assert not root.exists() or not any(root.iterdir()), list(root.rglob("*"))
        trainer.fit(model)
        return model

    seed_everything(3)
    tuned = fit(Regression(limit=12), tmp_path / "tuned", tune=True)
    seed_everything(3)
    by_hand = fit(Regression(batch_size=tuned.batch_size, limit=12, lr=tuned.lr), tmp_path / "by_hand", tune=False)
    assert tuned.batch_size == 12
    for (name, a), b in zip(tuned.state_dict().items(), by_hand.state_dict().values()):
        assert torch.equal(a, b), name


def test_bad_input_is_refused_with_the_value_and_the_fix(tmp_path):
    tuner = Tuner(_trainer(tmp_path))

    class NoSize(Regression):
        def __init__(self) -> None:
            super().__init__()
            del self.batch_size, self.lr

    with pytest.raises(ConfigurationError, match=r"model\.batch_size, model\.hparams\.batch_size.*batch_arg_name"):
        tuner.scale_batch_size(NoSize())
    with pytest.raises(ConfigurationError, match=r"mode='linear'.*power, binsearch"):
        tuner.scale_batch_size(Regression(), mode="linear")
    with pytest.raises(ConfigurationError, match=r"max_trials=0\) must be an int >= 1: how many"):
        tuner.scale_batch_size(Regression(), max_trials=0)
    with pytest.raises(ConfigurationError, match=r"init_val=0\) must be an int >= 1: the first batch size"):
        tuner.scale_batch_size(Regression(), init_val=0)
    with pytest.raises(ConfigurationError, match=r"train_dataloaders.*self\.batch_size"):
        tuner.scale_batch_size(Regression(), train_dataloaders=DataLoader(_data()))
    with pytest.raises(ConfigurationError, match=r"min_lr=1\.0, max_lr=0\.001.*below"):
        tuner.lr_find(Regression(), min_lr=1.0, max_lr=1e-3)
    with pytest.raises(ConfigurationError, match=r"mode='power'.*exponential, linear"):
        tuner.lr_find(Regression(), mode="power")
    with pytest.raises(ConfigurationError, match=r"model\.lr.*model\.learning_rate.*update_attr=False"):
        tuner.lr_find(NoSize())


def test_find_executable_batch_size_takes_nine_tenths_on_oom_and_reraises_other_errors():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return batch_size

    # Accelerate 1.15's int(batch_size * 0.9)
    assert train() == 19 and tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19]

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()


@pytest.mark.slow
def test_two_processes_agree_on_the_batch_size(tmp_path):
    """Rank 1 runs out of memory above 8, rank 0 above 32: both settle on 8, for the decorator and the tuner."""
    forklaunch.launch(SCRIPT, timeout=60, env=procs.test_env(TUNER_OUT=str(tmp_path)))
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text().split() == ["decorator=8", "power=8", "binsearch=8"]
