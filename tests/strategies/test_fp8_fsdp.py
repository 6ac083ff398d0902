"""precision="fp8" under FSDP2: torchao's Float8Linear weights all-gathered in float8 (issue 22 item 5).

On 2 gloo ranks on CPU (torch has float8 matmuls on CPU): gathering in fp8 trains to exactly the
weights of gathering in fp32 and casting after (the scale comes from the same global amax), with fewer
bytes on the wire. The GPU run of the same script is tests/test_gpu.py's."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import forklaunch, procs
from trainforge import ConfigurationError
from trainforge.strategies import FSDPStrategy
from trainforge.strategies.base import RunSettings
from trainforge.strategies.precision import Precision

SCRIPT = procs.REPO / "tests" / "scripts" / "fp8_fsdp.py"


@pytest.mark.slow
def test_fp8_all_gather_equals_gathering_fp32_and_sends_fewer_bytes(tmp_path):
    pytest.importorskip("torchao.float8")
    forklaunch.launch(SCRIPT, tmp_path, timeout=300)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["fp8_gather"]["shard"] == "WeightWithDynamicFloat8CastTensor"  # gathered through torchao's hook
        assert r["param_gather"]["shard"] == r["fp32_gather"]["shard"] == "Tensor"  # fp8_all_gather=False
        assert {v["layer"] for v in r.values()} == {"Float8Linear"}
        exact, reference = r["fp8_gather_fp32_params"], r["fp32_gather"]
        assert exact["losses"] == reference["losses"] and exact["checksum"] == reference["checksum"]
        assert len(set(reference["losses"])) > 1  # it trained
        # bf16 parameters: the float8 weights travel at half the bytes, the rest (embedding, norms) as before
        assert r["fp8_gather"]["gathered_bytes"] < 0.7 * r["param_gather"]["gathered_bytes"]
        assert exact["gathered_bytes"] < 0.5 * reference["gathered_bytes"]
        assert all(v["cpu_warning"] for v in r.values())  # fp8 on CPU says it is slow


def test_fp8_all_gather_bad_values_are_refused():
    with pytest.raises(ConfigurationError, match=r"fp8_all_gather='yes' must be None \(on under precision='fp8'\)"):
        FSDPStrategy(fp8_all_gather="yes")
    strategy = FSDPStrategy(fp8_all_gather=True)
    strategy.configure(RunSettings(precision=Precision("bf16-mixed", torch.device("cpu"))))
    with pytest.raises(
        ConfigurationError, match=r"fp8_all_gather=True\) with precision='bf16-mixed'.*set precision='fp8'"
    ):
        strategy._gathers_fp8()
    strategy = FSDPStrategy()  # None: on under fp8 only
    strategy.configure(RunSettings(precision=Precision("32", torch.device("cpu"))))
    assert strategy._gathers_fp8() is False


def test_fp8_runs_on_cpu_with_a_warning_and_is_refused_on_other_devices():
    pytest.importorskip("torchao.float8")
    with pytest.warns(UserWarning, match=r"precision='fp8' on CPU: .*slower than bf16"):
        Precision("fp8", torch.device("cpu"))
    with pytest.raises(ConfigurationError, match=r"needs an NVIDIA GPU .* or the CPU; this process runs on meta"):
        Precision("fp8", torch.device("meta"))
