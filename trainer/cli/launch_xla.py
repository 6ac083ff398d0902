"""``trainforge launch --xla``: the script on every local XLA device, started by torch_xla's own
launcher (``torch_xla.launch``, PJRT: one process per device; on a multi-host TPU slice the same
command runs on every host and PJRT finds the others). The workers get the launch settings with
``strategy: xla`` (what ``Accelerator()``/``Trainer()`` pick up when not told otherwise).

Checked before torch_xla is imported or anything starts: torchrun-only flags (torch_xla starts the
processes itself), a conflicting ``--strategy``/``--accelerator``, several XLA:CPU devices (their
collectives hang upstream), and torch_xla missing or built for another torch.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any, Dict, List, Mapping, Sequence

from trainforge.strategies.errors import ConfigurationError, LaunchError

# Settings torchrun uses to place processes; torch_xla's launcher decides those itself.
_TORCHRUN_ONLY = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "rdzv_backend",
    "rdzv_endpoint",
    "max_restarts",
    "monitor_interval",
)


def xla_settings(settings: Mapping[str, Any], flags: Mapping[str, Any]) -> Dict[str, Any]:
    """The workers' settings: ``strategy: xla``; flags that cannot apply are refused with the fix."""
    given = [key for key in _TORCHRUN_ONLY if key in flags]
    if given:
        names = ", ".join("--" + key.replace("_", "-") for key in given)
        raise ConfigurationError(
            f"launch --xla got {names}: torch_xla's launcher starts one process per local XLA "
            "device itself (PJRT). Drop those flags; on a multi-host TPU slice run the same "
            "command on every host"
        )
    strategy = flags.get("strategy", "xla")
    if strategy != "xla":
        raise ConfigurationError(
            f"launch --xla with --strategy {strategy}: XLA devices run strategy 'xla'; drop "
            "--strategy, or drop --xla to launch that strategy with torchrun"
        )
    accelerator = flags.get("accelerator", "auto")
    if accelerator != "auto":
        raise ConfigurationError(
            f"launch --xla with --accelerator {accelerator}: the XLA device is chosen by "
            "PJRT_DEVICE (TPU, or CPU for tests); drop --accelerator"
        )
    out = {k: v for k, v in settings.items() if k not in _TORCHRUN_ONLY and k != "accelerator"}
    out["strategy"] = "xla"
    return out


def check_xla_environment(environ: Mapping[str, str] = os.environ) -> None:
    """Several XLA:CPU devices are refused before anything starts (see strategies.xla)."""
    from trainforge.strategies.xla import check_xla_cpu_devices

    if environ.get("PJRT_DEVICE", "").upper() == "CPU":
        count = environ.get("CPU_NUM_DEVICES", "1")
        if not count.isdigit() or int(count) < 1:
            raise ConfigurationError(f"CPU_NUM_DEVICES={count!r} must be a positive integer (1 for XLA:CPU)")
        check_xla_cpu_devices("CPU", int(count))


def run_xla(settings: Mapping[str, Any], flags: Mapping[str, Any], script: str, script_args: Sequence[str]) -> int:
    from trainforge.strategies.xla import import_torch_xla
    from trainforge.trainer.cli.launch_settings import settings_for_workers

    worker_settings = xla_settings(settings, flags)
    check_xla_environment()
    torch_xla = import_torch_xla()
    with settings_for_workers(worker_settings):  # read by every process torch_xla starts
        try:
            torch_xla.launch(run_script, args=(os.path.abspath(script), list(script_args)))
        except Exception as error:  # a worker failed; torch_xla stopped the others
            print(f"trainforge launch --xla: a worker failed: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    return 0


def run_script(index: int, script: str, script_args: List[str]) -> None:
    """One worker: ``python script.py args`` in this process (``index`` is its local device)."""
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:  # sys.exit() in the script: 0/None is success
        if stop.code not in (0, None):
            raise LaunchError(f"{script} exited with {stop.code!r} on local device {index}") from None
