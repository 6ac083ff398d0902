"""Issue 20.10: HF transformers' run_clm_no_trainer.py resume pattern (``load_state``, then
``skip_first_batches(step * gradient_accumulation_steps - epochs * len(loader))``) with
gradient_accumulation_steps=2 resumes bit for bit in a fresh process, mid-epoch and from a checkpoint
saved on an epoch's last batch (upstream then starts the next epoch and asks to skip 0), and says that it
did not skip again. One process, CPU, fp32, shuffle on, dropout on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import forklaunch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "clm_resume.py"
pytestmark = pytest.mark.slow


def run_clm(out: Path, *args: str) -> str:
    # 48 samples, batch 4: 12 batches and 6 optimizer steps an epoch, 18 in 3 epochs
    proc = forklaunch.run_script(SCRIPT, "--output_dir", out, "--checkpointing_steps", "4", *args, timeout=120)
    assert "FINAL completed_steps=18" in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clm") / "full"
    run_clm(out)
    return out


@pytest.mark.parametrize(
    "checkpoint, said",
    [
        ("step_8", "restored this loader to batch 4 of epoch 1"),  # mid-epoch: upstream skips 16 - 12 = 4
        ("step_12", "to the end of epoch 1 (batch 12 of 12); the next pass starts epoch 2"),  # skip_first_batches(0)
    ],
)
def test_run_clm_resume_with_gradient_accumulation_is_bit_identical(uninterrupted, tmp_path, checkpoint, said):
    output = run_clm(tmp_path, "--resume_from_checkpoint", str(uninterrupted / checkpoint))
    assert "not skipping again" in output and said in output, output[-3000:]
    full, resumed = torch.load(uninterrupted / "final.pt"), torch.load(tmp_path / "final.pt")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), f"final weights differ at {key} after resuming from {checkpoint}"
