"""Token-weighted loss (trainer/accelerator/token_loss.py): a loss summed over tokens with ``num_items`` gives,
over 4 accumulation steps and over 2 processes, the gradients of one step on the concatenated
batch with a token-mean loss; the default (mean of micro-batch means) does not."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers import forklaunch
from trainforge import Accelerator, ConfigurationError, Trainer
from trainforge.callbacks import ModelCheckpoint

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import token_loss_run as run  # noqa: E402

TOL = 1e-6


def max_diff(a, b) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def fit_grads(summed: bool, accumulate: int = 4, **trainer_args):
    grads = run.GradsBeforeStep()
    trainer = Trainer(
        max_steps=1,
        accumulate_grad_batches=accumulate,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[grads],
        **trainer_args,
    )
    trainer.fit(run.TokenLM(summed=summed), DataLoader(run.sequences(), batch_size=2))
    return grads.grads[0]


def test_summed_loss_over_four_micro_batches_equals_the_concatenated_batch():
    reference = run.reference_grads(range(8))  # the window: 4 micro-batches of 2 sequences
    fixed = max_diff(fit_grads(summed=True), reference)
    mean_of_means = max_diff(fit_grads(summed=False), reference)
    print(f"max |grad - reference|: num_items {fixed:.2e}, mean of means {mean_of_means:.2e}")
    assert fixed < TOL
    assert mean_of_means > 1e-3, "the default weighs a token of a short batch more: the bug this fixes"


def test_a_skipped_last_micro_batch_is_left_out_of_the_count():
    """nonfinite_loss='skip' on the window's last micro-batch: no backward syncs the window, the
    Trainer divides by the items of the 3 micro-batches trained before its optimizer step."""
    module = run.TokenLM()
    step = module.training_step

    def training_step(batch, batch_idx):
        out = step(batch, batch_idx)
        return {**out, "loss": out["loss"] * float("nan")} if batch_idx == 3 else out

    module.training_step = training_step
    grads = run.GradsBeforeStep()
    trainer = Trainer(
        max_steps=1,
        accumulate_grad_batches=4,
        nonfinite_loss="skip",
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[grads],
    )
    trainer.fit(module, DataLoader(run.sequences(), batch_size=2))
    assert max_diff(grads.grads[0], run.reference_grads(range(6))) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_times_four_micro_batches_equal_one_process_on_the_whole_batch(tmp_path, strategy):
    out = tmp_path / "grads.pt"
    forklaunch.launch(SCRIPTS / "token_loss_run.py", out, strategy, nproc=2, timeout=120)
    grads = torch.load(out, weights_only=True)
    assert max_diff(grads, run.reference_grads(range(run.N_SEQ))) < TOL  # 2 ranks x 4 x 2 = all 16


def test_accelerator_backward_with_num_items():
    acc = Accelerator(gradient_accumulation_steps=4)
    module = run.TokenLM()
    opt = torch.optim.SGD(module.parameters(), lr=0.0)
    model, opt, loader = acc.prepare(module, opt, DataLoader(run.sequences(), batch_size=2))
    seen = []
    for step, (idx, tokens, labels) in enumerate(loader):
        with acc.accumulate(model):
            seen.extend(idx.tolist())
            loss = model.token_loss(tokens, labels, "sum")
            acc.backward(loss, num_items=int((labels != run.IGNORE).sum()))
            if acc.sync_gradients:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                break
            opt.step()
            opt.zero_grad()
    assert step == 3 and acc.items_in_window is None
    assert max_diff(grads, run.reference_grads(seen)) < TOL


@pytest.mark.parametrize(
    "num_items, says",
    [
        (0, "positive item count"),
        (-3, "positive item count"),
        (2.0, "must be an int"),
        ("8", "must be an int"),
        (True, "must be an int"),
        (torch.tensor(8.0), "torch.float32 tensor"),
        (torch.tensor([2, 3]), "give one count"),
        (torch.tensor(0), "positive item count"),
    ],
)
def test_bad_num_items_is_a_clear_error(num_items, says):
    module = run.TokenLM()
    step = module.training_step

    def training_step(batch, batch_idx):
        return {"loss": step(batch, batch_idx)["loss"], "num_items": num_items}

    module.training_step = training_step
    trainer = Trainer(max_steps=1, enable_progress_bar=False, enable_checkpointing=False, logger=False)
    with pytest.raises(ConfigurationError, match=says):
        trainer.fit(module, DataLoader(run.sequences(), batch_size=2))
    assert trainer.global_step == 0


def test_num_items_under_a_strategy_that_cannot_honour_it_fails_before_the_first_step():
    from trainforge.strategies.single import SingleDeviceStrategy

    class ScalesItself(SingleDeviceStrategy):  # as DeepSpeed's engine, pipeline schedules, XLA
        name = "scales-itself"
        grad_reduction = None

    trainer = Trainer(
        max_steps=1, strategy=ScalesItself(), enable_progress_bar=False, enable_checkpointing=False, logger=False
    )
    module = run.TokenLM()
    before = copy.deepcopy(module.state_dict())
    with pytest.raises(ConfigurationError, match="not supported under strategy 'scales-itself'"):
        trainer.fit(module, DataLoader(run.sequences(), batch_size=2))
    assert trainer.global_step == 0 and all(torch.equal(before[n], t) for n, t in module.state_dict().items())


def test_mixing_summed_and_mean_losses_in_one_window_is_refused():
    module = run.TokenLM()
    step = module.training_step
    module.training_step = lambda batch, i: step(batch, i) if i == 0 else step(batch, i)["loss"] / 3
    trainer = Trainer(
        max_steps=1, accumulate_grad_batches=4, enable_progress_bar=False, enable_checkpointing=False, logger=False
    )
    with pytest.raises(ConfigurationError, match="earlier micro-batches gave num_items"):
        trainer.fit(module, DataLoader(run.sequences(), batch_size=2))


def _fit_checkpointed(root, max_steps, ckpt_path=None):
    module = run.TokenLM(lr=0.5)
    trainer = Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=4,
        default_root_dir=str(root),
        enable_progress_bar=False,
        logger=False,
        callbacks=[ModelCheckpoint(every_n_steps=1, save_last=True)],
    )
    trainer.fit(module, DataLoader(run.sequences(), batch_size=2, shuffle=True), ckpt_path=ckpt_path)
    return module


def test_resume_from_a_window_end_is_bit_identical(tmp_path):
    """Step checkpoints are written at window ends, where no count is pending: the resumed run is
    the uninterrupted one bit for bit (checkpoints inside a window save the count with the partial
    gradients: tests/trainer/test_midwindow_resume.py)."""
    torch.manual_seed(3)
    full = _fit_checkpointed(tmp_path / "full", max_steps=3)
    torch.manual_seed(3)
    _fit_checkpointed(tmp_path / "cut", max_steps=1)
    torch.manual_seed(99)
    resumed = _fit_checkpointed(tmp_path / "cut", max_steps=3, ckpt_path="last")
    for name, ref in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], ref), f"weights differ at {name}"
