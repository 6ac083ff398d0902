"""The suite means the same on a laptop and on a GPU workstation.

CPU tests (all but those marked ``gpu``) must not see a GPU: bit-for-bit parity with a CPU raw
loop, gloo process groups and CPU error messages are what they check. So CUDA is hidden from this
process, before anything initialises it, and from every child it starts (tests/helpers/procs.py
copies this environment). Tests marked ``xla`` are skipped where torch_xla is not installed
(scripts/xla-env.sh runs them). Tests marked ``gpu`` run their work in child processes given
``procs.gpu_env()`` (the GPUs this session was started with) and are skipped where no CUDA device
is there: ``pytest -m gpu`` runs just them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.helpers import procs

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # see the docstring; procs.ORIGINAL_CUDA_VISIBLE keeps the old value


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    _skip_xla_without_torch_xla(items)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = procs.gpu_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)


def _skip_xla_without_torch_xla(items: list) -> None:
    """Tests marked ``xla`` need torch_xla (only scripts/xla-env.sh's environment has it); found
    without importing it."""
    if importlib.util.find_spec("torch_xla") is not None:
        return
    skip = pytest.mark.skip(reason="torch_xla is not installed (scripts/xla-env.sh builds an environment with it)")
    for item in items:
        if item.get_closest_marker("xla") is not None:
            item.add_marker(skip)
