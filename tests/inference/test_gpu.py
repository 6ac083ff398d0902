"""CUDA paths of offloading (pinned reused buffers, side-stream prefetch), run in a child process
that sees the GPUs (tests/conftest.py may hide CUDA from the test process itself)."""

import sys
from pathlib import Path

import pytest

from tests.helpers import procs

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inference_gpu.py"
pytestmark = pytest.mark.gpu  # tests/conftest.py skips these without a usable GPU


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "mixed_map", "no_prefetch"])
def test_offloaded_generate_matches_gpu_model(tmp_path, how):
    out = procs.run([sys.executable, SCRIPT, how, tmp_path], timeout=240, env=procs.gpu_env()).stdout
    assert f"OK {how}" in out, out
