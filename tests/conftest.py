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


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test():
    """A test that starts a torch.distributed group (or sets the launch variables) in the test process
    and leaves it makes later tests of the same worker fail far from the cause (notebook_launcher refuses,
    children inherit MASTER_PORT): it fails itself instead, and the group and variables are cleaned up."""
    before = {k: os.environ.get(k) for k in LAUNCH_VARS}
    yield
    import torch.distributed as dist

    left = [k for k in LAUNCH_VARS if os.environ.get(k) != before[k]]
    for key in left:
        if before[key] is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before[key]
    group = dist.is_available() and dist.is_initialized()
    if group:
        dist.destroy_process_group()
    if group or left:
        pytest.fail(
            f"the test left {'a process group and ' if group else ''}launch variables {left} in the test process"
        )


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
