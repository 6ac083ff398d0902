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

import gc
import importlib.util
import json
import os
from pathlib import Path
from typing import Dict

import pytest

from tests.helpers import procs

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # see the docstring; procs.ORIGINAL_CUDA_VISIBLE keeps the old value


# Seconds each test file took (``pytest --update-durations`` rewrites it): pytest-xdist hands whole files
# to its two workers in collection order, so the longest go first and the short ones fill the end
# (ordered by test count, xdist's default, a 60 s file of 40 tests went last and ran alone). A stale or
# missing entry only costs balance: a file not listed counts 1 s per slow test and 0.05 s per other.
DURATIONS = Path(__file__).with_name("durations.json")
_seconds: Dict[str, float] = {}
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-durations",
        action="store_true",
        help="write the seconds of each test file that ran to tests/durations.json (the order of the files)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    _longest_files_first(items)
    _skip_xla_without_torch_xla(items)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = procs.gpu_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, mlflow, every test module: ~500k objects) is kept
    out of the garbage collector's passes from here on. A full collection walks every tracked object:
    ~0.25 s in this process, and tests call it often (``release_memory``, the batch-size finders after
    each attempt, pytest's unraisable-exception check); objects made by the tests are collected as
    before."""
    gc.collect()
    gc.freeze()


def _skip_xla_without_torch_xla(items: list) -> None:
    """Tests marked ``xla`` need torch_xla (only scripts/xla-env.sh's environment has it); found
    without importing it."""
    if importlib.util.find_spec("torch_xla") is not None:
        return
    skip = pytest.mark.skip(reason="torch_xla is not installed (scripts/xla-env.sh builds an environment with it)")
    for item in items:
        if item.get_closest_marker("xla") is not None:
            item.add_marker(skip)


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _recorded() -> Dict[str, float]:
    """DURATIONS' file -> seconds; empty when it is missing or unreadable (only the order suffers)."""
    try:
        return dict(json.loads(DURATIONS.read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _longest_files_first(items: list) -> None:
    """Files in decreasing recorded duration; the tests of a file keep their order (a stable sort)."""
    known = _recorded()
    guess: Dict[str, float] = {}
    for item in items:
        weight = 1.0 if item.get_closest_marker("slow") is not None else 0.05
        guess[_file(item.nodeid)] = guess.get(_file(item.nodeid), 0.0) + weight
    cost = {name: float(known.get(name, seconds)) for name, seconds in guess.items()}
    items.sort(key=lambda item: -cost[_file(item.nodeid)])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[_file(report.nodeid)] = _seconds.get(_file(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """``--update-durations``: the controller (or a run without xdist) merges what ran into DURATIONS."""
    if not session.config.getoption("--update-durations") or hasattr(session.config, "workerinput"):
        return
    known = _recorded()
    known.update({name: round(seconds, 1) for name, seconds in _seconds.items()})
    DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")
