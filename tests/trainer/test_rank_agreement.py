"""Ranks that disagree on what the training loop exchanges are named instead of waiting for each other
forever: the loss contract (``num_items`` on some ranks only: trainer/accelerator/token_loss.py), a batch
skipped on one rank (``None``; a non-finite loss under ``nonfinite_loss="skip"`` is skipped by every rank
together) and the number of batches per epoch (trainer/loop/fit_loop.py). Real gloo processes
(tests/scripts/rank_disagreement.py); each used to hang until the process group's timeout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import forklaunch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rank_disagreement.py"


def _run(mode: str):
    return forklaunch.launch(SCRIPT, mode, nproc=2, timeout=90, check=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, named",
    [
        # agreed once, at the first optimizer step: every rank names the ranks on each side
        (
            "items-first",
            "ranks [0] returned a summed loss with num_items ({'loss': ..., 'num_items': n}) and ranks [1]",
        ),
        # afterwards each rank checks its own steps against the agreement, without a collective
        ("items-later", "rank 1 of 2: this step returned a loss without num_items, but every rank returned a summed"),
        ("none", "Model.training_step (batch 1) returned None on rank 1 of 2: a skipped batch is supported on one"),
        ("batches", "different numbers of training batches per epoch (rank 0: 4, rank 1: 3)"),
    ],
)
def test_ranks_that_disagree_are_named_instead_of_waiting_forever(mode, named):
    out = _run(mode)
    assert out.returncode == 1 and "finished" not in out.stdout and named in out.stdout, out.stdout[-3000:]


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_is_skipped_by_every_rank():
    out = _run("nonfinite")
    assert out.returncode == 0, out.stdout[-3000:]
    done = sorted(re.findall(r"rank (\d) finished step (\d+) skipped (\d+) weight (\[.*\])", out.stdout))
    assert [(r, k) for r, _, k, _ in done] == [("0", "1"), ("1", "1")]  # rank 0's loss was finite: skipped too
    assert done[0][1] == done[1][1] and done[0][3] == done[1][3]  # the same steps and weights on both
