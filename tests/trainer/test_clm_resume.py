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


# Accelerate 1.15's final weights for this script's uninterrupted run (48 samples, batch 4, 3 epochs,
# gradient_accumulation_steps=2, one CPU process, fp32), sha256 of the parameters' bytes in sorted-name order:
# `python tests/scripts/clm_resume.py --backend accelerate --output_dir <d> --checkpointing_steps 4 --save_check plain`.
# (Accelerate's own resume from step_8 ends elsewhere, c9db0537...: it draws a new order for epoch 1 and replays the
# saved window's micro-batch with the RNG of the one after it.)
ACCELERATE_UNINTERRUPTED = "dec02637d60d76b51a7259660c7181ae6f181e8128828e5034663a9b19469699"


def test_checkpoint_rewritten_inside_the_window_resumes_with_the_scripts_skip(tmp_path):
    """Issue 38.7: scripts that save on ``completed_steps % checkpointing_steps == 0`` alone (earlier
    run_clm_no_trainer.py, and its copies) write ``step_8`` again on the next micro-batch, inside an accumulation
    window: load_state restores batch 5 of epoch 1 (with that micro-batch's gradients) where the script skips
    8 * 2 - 12 = 4. The skip is the window's first batch: accepted, and the run is the uninterrupted one, whose
    weights are Accelerate's (the issue's case is the same with 60 batches an epoch: step_40, batch 21, skip 20)."""
    full = run_clm(tmp_path / "full", "--save_check", "plain")
    assert f"WEIGHTS {ACCELERATE_UNINTERRUPTED}" in full, full[-2000:]
    resumed = run_clm(
        tmp_path / "resumed", "--save_check", "plain", "--resume_from_checkpoint", str(tmp_path / "full" / "step_8")
    )
    said = "restored this loader to batch 5 of epoch 1, 1 micro-batch(es) into the accumulation window"
    assert said in resumed and "not skipping again" in resumed, resumed[-3000:]
    assert f"WEIGHTS {ACCELERATE_UNINTERRUPTED}" in resumed, resumed[-2000:]


def test_a_skip_before_the_restored_window_is_still_refused(tmp_path):
    """Only the restored window's first batch is accepted: a skip one batch earlier would repeat a batch whose
    optimizer step the checkpoint already holds."""
    run_clm(tmp_path / "full", "--save_check", "plain")
    proc = forklaunch.run_script(
        SCRIPT,
        "--output_dir",
        tmp_path / "resumed",
        "--resume_from_checkpoint",
        tmp_path / "full" / "step_8",
        "--gradient_accumulation_steps",
        "2",
        "--skip_offset",
        "-1",
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "skip_first_batches(3) does not match the checkpoint" in proc.stdout, proc.stdout[-3000:]
