"""CUDA paths of offloading (pinned reused buffers, side-stream prefetch), run in a child process
that sees the GPUs (tests/conftest.py may hide CUDA from the test process itself)."""
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import procs

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inference_gpu.py"
_conftest_skips = hasattr(procs, "gpu_unavailable_reason")  # then tests/conftest.py skips gpu tests itself
pytestmark = [pytest.mark.gpu] + ([] if _conftest_skips else [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])


def _env():
    if hasattr(procs, "gpu_env"):
        return procs.gpu_env()
    env = procs.test_env()
    visible = getattr(procs, "ORIGINAL_CUDA_VISIBLE", os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "mixed_map", "no_prefetch"])
def test_offloaded_generate_matches_gpu_model(tmp_path, how):
    out = procs.run([sys.executable, SCRIPT, how, tmp_path], timeout=240, env=_env()).stdout
    assert f"OK {how}" in out, out
