"""Smoke: benchmarks/inference.py runs end to end in its tiny mode (figures printed, never asserted).
Its driver is forked from the test's rank server (tests/helpers/forklaunch.py); each row it measures
still runs in a fresh child interpreter, as the benchmark starts them."""

import re
from pathlib import Path

import pytest

from tests.helpers import forklaunch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "inference.py"


@pytest.mark.slow
def test_inference_benchmark_tiny():
    out = forklaunch.run_script(BENCH, "--tiny", "--paths", "dispatch_cap", timeout=240).stdout
    row = re.search(
        r"^dispatch_cap\s+trainforge\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)", out, re.M
    )
    assert row, out
    assert float(row.group(5)) > 0 and int(row.group(6)) > 0, out  # a forward time and a throughput
    assert "peak anon / (cap + largest block)" in out, out
