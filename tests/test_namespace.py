"""One top-level package: a user's own trainer.py / callbacks.py / strategies.py never shadow ours,
and the install puts nothing but ``trainforge`` into site-packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import procs

USER_FILE = 'raise ImportError("the user\'s own {name}.py was imported by trainforge")\n'
TRAIN = """
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainforge import Trainer, TrainingModule
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies import DDPStrategy, SingleDeviceStrategy


class Net(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
trainer = Trainer(max_steps=3, enable_progress_bar=False, default_root_dir="run",
                  callbacks=[ModelCheckpoint(every_n_steps=3)])
trainer.fit(Net(), DataLoader(data, batch_size=4))
assert isinstance(trainer.strategy, (DDPStrategy, SingleDeviceStrategy))
sys.stdout.write(f"TRAINED {trainer.global_step} {type(trainer.strategy).__name__}\\n")  # one write: ranks interleave
"""


def user_folder(tmp_path: Path) -> Path:
    for name in ("trainer", "callbacks", "strategies"):
        (tmp_path / f"{name}.py").write_text(USER_FILE.format(name=name))
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


def installed_env() -> dict:
    """The test environment without the repository on PYTHONPATH: trainforge comes from the install."""
    env = procs.test_env()
    env.pop("PYTHONPATH")
    return env


@pytest.mark.slow
def test_users_own_trainer_callbacks_strategies_files_do_not_shadow_trainforge(tmp_path):
    folder = user_folder(tmp_path)
    one = procs.run([sys.executable, "train.py"], cwd=folder, env=installed_env(), timeout=120)
    assert "TRAINED 3 SingleDeviceStrategy" in one.stdout
    two = procs.run(
        [sys.executable, "-m", "trainforge", "launch", "--nproc-per-node", "2", "train.py"],
        cwd=folder,
        env=installed_env(),
        timeout=180,
    )
    assert two.stdout.count("TRAINED 3 DDPStrategy") == 2, two.stdout[-3000:]
    assert (folder / "run").is_dir()


def test_the_public_names_live_under_trainforge():
    import trainforge
    from trainforge.callbacks import Callback, ModelCheckpoint
    from trainforge.strategies import FSDPStrategy, Strategy

    assert trainforge.Trainer.__module__ == "trainforge.trainer.loop.trainer"
    assert ModelCheckpoint.__module__ == "trainforge.callbacks.checkpoint"
    assert issubclass(ModelCheckpoint, Callback) and issubclass(FSDPStrategy, Strategy)
    loaded = [name for name in sys.modules if name.split(".")[0] in ("trainer", "callbacks", "strategies")]
    assert loaded == [], f"modules under a generic top-level name were imported: {loaded}"


@pytest.mark.slow
def test_pip_install_target_holds_only_trainforge(tmp_path):
    target, source = tmp_path / "site", tmp_path / "source"
    # from a copy without build outputs: a stale build/ would hide a package the build no longer finds
    shutil.copytree(
        procs.REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", "build", "*.egg-info", "__pycache__", ".mypy_cache", ".pytest_cache", "*.so"
        ),
    )
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_ROOT_USER_ACTION="ignore"),
    )
    assert build.returncode == 0, build.stderr[-3000:]
    top = sorted(p.name for p in target.iterdir())
    assert [n for n in top if not n.endswith(".dist-info")] in (["trainforge"], ["bin", "trainforge"]), top
    pkg = target / "trainforge"
    # every folder of the repository's packages that holds modules is a package of the wheel (a folder
    # without __init__.py would be left out by find_packages and work only from the repository)
    folders = sorted(
        {
            str(f.parent.relative_to(procs.REPO))
            for top in ("trainer", "callbacks", "strategies")
            for f in (procs.REPO / top).rglob("*.py")
            if "__pycache__" not in f.parts
        }
    )
    assert len(folders) >= 8, folders
    for sub in folders:
        assert (pkg / sub / "__init__.py").is_file(), sub
    assert not (pkg / "tests").exists() and not (pkg / "benchmarks").exists()
    # the installed copy imports on its own (the repository kept off the path)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import trainforge, trainforge.strategies.fsdp, "
            "trainforge.strategies.checkpoint.io as io, trainforge.strategies.data.loader as dl; "
            "print(trainforge.__file__, io.__file__, dl.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(target)),
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert all(path.startswith(str(pkg)) for path in probe.stdout.split()), probe.stdout
