"""``trainforge env``: versions, hardware and the config file, as text to paste into a bug report."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata
from typing import List, Optional

from trainforge.trainer.cli.launch_settings import default_config_path

HELP = "print versions, hardware and the config file for bug reports"
# Distribution names; read from package metadata so that reporting never imports them (importing
# deepspeed or transformers takes seconds and can print warnings).
PACKAGES = (
    "trainforge",
    "torch",
    "torchdata",
    "deepspeed",
    "mlflow",
    "comet_ml",
    "safetensors",
    "transformers",
    "numpy",
)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(config_file: Optional[str] = None) -> str:
    """The report as text."""
    import psutil
    import torch

    lines: List[str] = [
        f"- Python version: {platform.python_version()} ({sys.executable})",
        f"- Platform: {platform.platform()}",
    ]
    # torch's own __version__ carries the build (+cpu, +cu130), which its distribution metadata may lack
    lines += [f"- {name} version: {torch.__version__ if name == 'torch' else _version(name)}" for name in PACKAGES]
    lines.append(
        f"- torch CUDA build: {torch.version.cuda or 'none (CPU build)'}; CUDA available: {torch.cuda.is_available()}"
    )
    lines.append(f"- CPU count: {os.cpu_count()}")
    lines.append(f"- RAM: {psutil.virtual_memory().total / 2**30:.1f} GiB")
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    lines.append(
        "- GPUs: " + (", ".join(f"{g.name} ({g.total_memory / 2**30:.1f} GiB)" for g in gpus) if gpus else "none")
    )
    path = config_file or str(default_config_path())
    if os.path.isfile(path):
        with open(path) as handle:
            body = "".join("    " + line for line in handle)
        lines.append(f"- Config file {path}:\n{body.rstrip()}")
    else:
        lines.append(f"- Config file {path}: not found")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-file", default=None, help="config file to show (default: the default one)")


def run(args: argparse.Namespace) -> int:
    print("Copy and paste the text below into your bug report.\n")
    print(report(args.config_file))
    return 0
