"""The architecture's rules as checks (scripts/lint.sh): the import floors (scripts/check_imports.py) and
ruff's ban on raw deserialisation outside the safe readers (ruff.toml, TID251)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "scripts" / "check_imports.py"


def _tree(tmp_path: Path, files: dict) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), str(root)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "rel, text, line, rule, module",
    [
        (
            "strategies/ddp.py",
            "import os\nfrom trainforge.trainer.loop import Trainer\n",
            2,
            "strategies-upward",
            "trainforge.trainer.loop",
        ),
        (
            "strategies/ddp.py",
            "def f():\n    import trainforge.callbacks.checkpoint\n",
            2,
            "strategies-upward",
            "trainforge.callbacks.checkpoint",
        ),
        (
            "strategies/ddp.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainforge import Trainer\n",
            3,
            "strategies-upward",
            "trainforge",
        ),
        ("strategies/data/split.py", "from ...trainer import Trainer\n", 1, "strategies-upward", "trainforge.trainer"),
        (
            "strategies/__init__.py",
            'REG = {"x": "trainforge.trainer.loop.trainer:Trainer"}\n',
            1,
            "strategies-upward",
            "trainforge.trainer.loop.trainer",
        ),
        (
            "callbacks/timer.py",
            "from trainforge.trainer.loop.settings import RunSettings\n",
            1,
            "callbacks-runtime-trainer",
            "trainforge.trainer.loop.settings",
        ),
        (
            "callbacks/timer.py",
            "class T:\n    def on_fit_start(self):\n        from trainforge import Trainer\n",
            3,
            "callbacks-runtime-trainer",
            "trainforge",
        ),
        (
            "callbacks/timer.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n    from ..trainer import loop\n",
            5,
            "callbacks-runtime-trainer",
            "trainforge.trainer",
        ),
        (
            "callbacks/timer.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainforge.trainer.compat.lightning import trainer_args\n",
            3,
            "compat-below",
            "trainforge.trainer.compat.lightning",
        ),
    ],
)
def test_each_upward_import_fails_and_is_named(tmp_path, rel, text, line, rule, module):
    root = _tree(tmp_path, {"strategies/ok.py": "import torch\n", "callbacks/ok.py": "import torch\n", rel: text})
    result = _check(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{rel}:{line}: {rule}: " in result.stdout, result.stdout
    assert re.search(rf"imports {re.escape(module)}[; ]", result.stdout), result.stdout
    assert "ARCHITECTURE.md" in result.stdout


def test_allowed_imports_pass(tmp_path):
    allowed = {
        "strategies/data/split.py": "from ..errors import ConfigurationError\nimport trainforge.strategies.ddp\n",
        "strategies/checkpoint/io.py": 'import importlib.metadata\nV = importlib.metadata.version("trainforge")\n',
        "callbacks/timer.py": (
            "from typing import TYPE_CHECKING\n"
            "from trainforge.strategies.errors import ConfigurationError\n"
            "from trainforge.callbacks.base import Callback\n"
            "if TYPE_CHECKING:\n"
            "    from trainforge import TrainingModule\n"
            "    from trainforge.trainer.loop.trainer import Trainer\n"
        ),
    }
    result = _check(_tree(tmp_path, allowed))
    assert (result.returncode, result.stdout) == (0, ""), result.stdout + result.stderr


def test_the_repository_keeps_its_floors():
    result = _check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def _ruff(path: str, source: str) -> subprocess.CompletedProcess:
    # --stdin-filename makes ruff apply ruff.toml's per-file-ignores as if the file were at `path`
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "TID251", "--stdin-filename", path, "-"]
    return subprocess.run(cmd, input=source, capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize(
    "source, banned",
    [
        ("import torch\nstate = torch.load('x.pt', weights_only=True)\n", "torch.load"),
        ("from torch import load\nstate = load('x.pt')\n", "torch.load"),
        ("import pickle\nstate = pickle.loads(b'')\n", "pickle.loads"),
    ],
)
def test_raw_deserialisation_is_refused_outside_the_safe_readers(source, banned):
    refused = _ruff("strategies/new_module.py", source)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"`{banned}` is banned" in refused.stdout and "load_object" in refused.stdout, refused.stdout
    allowed = _ruff("strategies/checkpoint/read.py", source)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
