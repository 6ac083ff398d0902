"""strategy='xla' where torch_xla is absent (default CI): torch_xla is imported only when the strategy is
chosen, and every way it cannot work is a clear error before anything starts. The runs on an XLA:CPU
device are in test_xla_device.py (``pytest -m xla``, scripts/xla-env.sh)."""

import importlib.util
import json
import sys

import pytest
import torch

from tests.helpers import procs
from trainforge import Accelerator, ConfigurationError
from trainforge.strategies import STRATEGY_NAMES, XLAStrategy, resolve_strategy
from trainforge.strategies.xla import check_torch_xla_versions, check_xla_cpu_devices
from trainforge.trainer.cli.main import main as cli_main

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
TORCH_IS_29 = torch.__version__.startswith("2.9.")

LAZY = """
import json, sys
import trainforge, trainforge.trainer, trainforge.strategies, trainforge.callbacks
from trainforge.strategies import XLAStrategy, resolve_strategy, strategy_class
from trainforge import Accelerator, Trainer
from trainforge.trainer.cli.main import build_parser
import trainforge.strategies.xla
build_parser()
picked = [type(resolve_strategy(n)).__name__ for n in ("auto", "single", "ddp")]
XLAStrategy()
strategy_class("xla")
Accelerator(strategy="single", accelerator="cpu")
Trainer(accelerator="cpu", max_steps=1, enable_progress_bar=False)
print(json.dumps({"picked": picked, "imported": sorted(m for m in sys.modules if m.split(".")[0] == "torch_xla")}))
"""


def test_torch_xla_is_never_imported_unless_xla_is_chosen():
    """In a fresh process (this one may have imported anything): importing trainforge, its CLI, the
    xla module itself, and choosing or auto-resolving other strategies imports no torch_xla module,
    and 'auto' never picks XLA (even where torch_xla is installed)."""
    out = procs.run([sys.executable, "-c", LAZY], timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["imported"] == []
    assert result["picked"] == ["SingleDeviceStrategy", "SingleDeviceStrategy", "DDPStrategy"]
    assert "xla" in STRATEGY_NAMES


@pytest.mark.skipif(HAS_TORCH_XLA, reason="torch_xla is installed here")
def test_xla_without_torch_xla_names_torch_version_and_the_matching_pair():
    with pytest.raises(ConfigurationError) as info:
        Accelerator(strategy="xla")
    message = str(info.value)
    assert f"torch {torch.__version__}" in message and "not installed" in message
    assert "pip install torch==2.9.0 torch_xla==2.9.0" in message and "scripts/xla-env.sh" in message
    assert "torch-tpu" in message  # the way to TPUs on newer torch


def test_mismatched_torch_and_torch_xla_versions_are_refused():
    with pytest.raises(
        ConfigurationError,
        match=r"torch_xla 2\.9\.0 is built for torch 2\.9\.x but this process "
        r"has torch 2\.13\.0\+cpu.*pip install torch==2\.9\.\* torch_xla==2\.9\.0",
    ):
        check_torch_xla_versions("2.13.0+cpu", "2.9.0")
    check_torch_xla_versions("2.9.0+cu128", "2.9.0")  # a matching pair passes (local build tags ignored)
    check_torch_xla_versions("2.9.1", "2.9.0+git1234")


@pytest.mark.skipif(HAS_TORCH_XLA or TORCH_IS_29, reason="needs a torch other than 2.9 and no torch_xla")
def test_installed_torch_xla_of_another_torch_is_refused_before_its_import(tmp_path):
    """A real installed distribution's metadata (torch_xla 2.9.0 next to this torch) is read with
    importlib.metadata; the error comes before torch_xla's C extension would be loaded."""
    info = tmp_path / "torch_xla-2.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_xla\nVersion: 2.9.0\n")
    (tmp_path / "torch_xla").mkdir()
    (tmp_path / "torch_xla" / "__init__.py").write_text("raise SystemExit('torch_xla must not be imported')\n")
    code = (
        "from trainforge import Accelerator, ConfigurationError\n"
        "try:\n    Accelerator(strategy='xla')\nexcept ConfigurationError as e:\n    print('ERROR', e)\n"
    )
    out = procs.run(
        [sys.executable, "-c", code], timeout=120, env=procs.test_env(PYTHONPATH=f"{procs.REPO}:{tmp_path}")
    )
    assert f"torch_xla 2.9.0 is built for torch 2.9.x but this process has torch {torch.__version__}" in out.stdout


def test_several_xla_cpu_devices_name_the_upstream_limitation():
    with pytest.raises(ConfigurationError, match=r"2 XLA:CPU devices.*hang.*pytorch/xla#5005, pytorch/xla#9089"):
        check_xla_cpu_devices("CPU", 2)
    check_xla_cpu_devices("CPU", 1)
    check_xla_cpu_devices("TPU", 8)


def test_bad_xla_strategy_arguments_fail_before_any_import():
    with pytest.raises(ConfigurationError, match=r"XLAStrategy\(sync_module_states='yes'\) must be True or False"):
        XLAStrategy(sync_module_states="yes")
    with pytest.raises(ConfigurationError, match=r"PJRT_DEVICE.*accelerator='cpu' conflicts.*accelerator='auto'"):
        Accelerator(strategy="xla", accelerator="cpu")
    assert isinstance(resolve_strategy("XLA"), XLAStrategy)


@pytest.fixture
def launch(capsys, monkeypatch):
    """`trainforge launch ARGS` in this process (the CLI's own main; these are refusals before any
    process starts): (exit code, everything it printed)."""

    def run(*args, **env):
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            try:
                code = cli_main(["launch", *args])
            except SystemExit as exc:  # argparse's own refusals
                code = exc.code
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    return run


def test_launch_xla_refuses_what_cannot_apply(tmp_path, launch):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    code, out = launch("--xla", "--nproc-per-node", "2", str(script))
    assert code == 2 and "--nproc-per-node" in out and "one process per local XLA device" in out
    code, out = launch("--xla", "--strategy", "ddp", str(script))
    assert code == 2 and "--strategy ddp" in out and "drop --xla" in out
    code, out = launch("--strategy", "xla", str(script))
    assert code == 2 and "use `trainforge launch --xla script.py`" in out
    code, out = launch("--xla", str(script), PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    assert code == 2 and "4 XLA:CPU devices" in out and "pytorch/xla#5005" in out
    code, out = launch("--xla", str(script), PJRT_DEVICE="CPU", CPU_NUM_DEVICES="many")
    assert code == 2 and "CPU_NUM_DEVICES='many' must be a positive integer" in out
    assert "must not run" not in out


@pytest.mark.skipif(HAS_TORCH_XLA, reason="torch_xla is installed here")
def test_launch_xla_without_torch_xla_is_a_clear_error(tmp_path, launch):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    code, out = launch("--xla", str(script), PJRT_DEVICE="CPU")
    assert code == 2 and "needs torch_xla, which is not installed" in out
    assert "must not run" not in out
