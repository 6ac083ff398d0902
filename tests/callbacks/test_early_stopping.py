"""EarlyStopping: patience, thresholds, resume, clear errors, and agreement across 2 real ranks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.scripts.cb_launch import multirank
from tests.scripts.cb_standin import StandInTrainer
from trainforge.callbacks.early_stopping import EarlyStopping
from trainforge.strategies.errors import ConfigurationError


def _fit(callback, values, val_every=2, max_steps=100):
    """Validate every ``val_every`` steps; the k-th validation reports ``values[k]``."""
    model = nn.Linear(3, 1)
    seen = []

    def val_metrics(trainer):
        seen.append(values[len(seen)])
        return {"val/loss": seen[-1], "val/acc": 0.5}

    trainer = StandInTrainer([callback])
    trainer.fit(
        model,
        [(torch.randn(2, 3),) for _ in range(10)],
        torch.optim.SGD(model.parameters(), lr=0.01),
        max_steps=max_steps,
        val_every_n_steps=val_every,
        val_metrics=val_metrics,
    )
    return trainer, seen


def test_stops_after_patience_non_improving_validations(capsys):
    values = [1.0, 0.8, 0.85, 0.8, 0.9] + [0.1] * 20  # best 0.8, then 3 validations without improvement
    trainer, seen = _fit(EarlyStopping("val/loss", patience=3, verbose=True), values)
    assert len(seen) == 5 and trainer.should_stop
    assert trainer.global_step == 10  # 5th validation at step 10; nothing after it
    assert "did not improve" in capsys.readouterr().out


def test_lightnings_positional_order_and_defaults():
    """EarlyStopping(monitor, min_delta, patience, verbose, mode, strict, check_finite, stopping_threshold,
    divergence_threshold, check_on_train_epoch_end, log_rank_zero_only), Lightning's defaults."""
    cb = EarlyStopping("val/acc", 0.05, 2, True, "max", False, False, 0.99, 0.1, True, True)
    assert (cb.min_delta, cb.patience, cb.verbose, cb.mode, cb.strict, cb.check_finite) == (
        0.05,
        2,
        True,
        "max",
        False,
        False,
    )
    assert (cb.stopping_threshold, cb.divergence_threshold, cb.check_on_train_epoch_end) == (0.99, 0.1, True)
    assert cb.log_rank_zero_only is True
    default = EarlyStopping("val/loss")
    assert (default.min_delta, default.patience, default.verbose, default.mode) == (0.0, 3, False, "min")
    assert default.log_rank_zero_only is False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_delta": "max"}, r"min_delta='max'\) must be a number >= 0 \(the second argument, as in Lightning"),
        ({"verbose": "yes"}, r"verbose='yes'\) must be True or False"),
        ({"log_rank_zero_only": 1}, r"log_rank_zero_only=1\) must be True \(the stop is printed by rank 0 only\)"),
        ({"check_on_train_epoch_end": "epoch"}, r"check_on_train_epoch_end='epoch'\) must be None"),
        ({"stopping_threshold": "0.1"}, r"stopping_threshold='0.1'\) must be a number or None"),
    ],
)
def test_new_and_reordered_arguments_refuse_bad_values(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        EarlyStopping("val/loss", **kwargs)


@pytest.mark.parametrize("rank_zero_only, printed", [(False, True), (True, False)])
def test_log_rank_zero_only_keeps_other_ranks_quiet(capsys, rank_zero_only, printed):
    from types import SimpleNamespace

    strategy = SimpleNamespace(all_reduce=lambda t, op: t)
    rank1 = SimpleNamespace(
        callback_metrics={"val/loss": 1.0},
        device="cpu",
        strategy=strategy,
        current_epoch=0,
        global_step=4,
        val_dataloaders=[],
        global_rank=1,
        is_global_zero=False,
        should_stop=False,
    )
    cb = EarlyStopping("val/loss", patience=0, verbose=True, log_rank_zero_only=rank_zero_only)
    cb.best_score = 0.5  # no improvement: rank 1 asks to stop
    cb.on_train_epoch_end(rank1, None)  # no validation loop: checked at the epoch end
    assert rank1.should_stop and ("[rank 1] EarlyStopping at epoch 0" in capsys.readouterr().out) == printed


def test_min_delta_and_max_mode():
    cb = EarlyStopping("val/acc", mode="max", patience=2, min_delta=0.05)
    assert cb.judge(0.5) is None and cb.best_score == 0.5
    assert cb.judge(0.53) is None and cb.wait_count == 1  # +0.03 is not more than min_delta
    assert cb.judge(0.6) is None and cb.wait_count == 0 and cb.best_score == 0.6
    assert cb.judge(0.6) is None and "did not improve" in cb.judge(0.61)


def test_thresholds_and_non_finite():
    assert "stopping_threshold" in EarlyStopping("m", stopping_threshold=0.1, patience=9).judge(0.05)
    assert "divergence_threshold" in EarlyStopping("m", divergence_threshold=5.0, patience=9).judge(7.0)
    assert "not finite" in EarlyStopping("m", patience=9).judge(math.nan)
    assert EarlyStopping("m", patience=9, check_finite=False).judge(math.inf) is None


def test_resume_continues_counting():
    first = EarlyStopping("val/loss", patience=3)
    _fit(first, [1.0, 1.0, 1.0] + [0.0] * 10, max_steps=6)  # two bad validations, then the run ends
    assert first.wait_count == 2 and first.best_score == 1.0
    resumed = EarlyStopping("val/loss", patience=3)
    resumed.load_state_dict(first.state_dict())
    trainer, seen = _fit(resumed, [1.5] + [0.0] * 10)
    assert len(seen) == 1 and trainer.should_stop  # the third bad validation overall


def test_missing_key_lists_available_keys():
    with pytest.raises(ConfigurationError, match=r"monitor='val/los'.*Available: val/acc, val/loss"):
        _fit(EarlyStopping("val/los"), [1.0])


def test_bad_mode_and_patience():
    with pytest.raises(ConfigurationError, match=r"mode\)='minimum' is not one of: min, max"):
        EarlyStopping("val/loss", mode="minimum")
    with pytest.raises(ConfigurationError, match="patience=-1"):
        EarlyStopping("val/loss", patience=-1)


def test_patience_zero_stops_at_the_first_check_without_improvement():
    """Lightning: patience=0 is accepted; the first validation that does not improve stops."""
    trainer, seen = _fit(EarlyStopping("val/loss", patience=0), [1.0, 0.9, 0.95] + [0.1] * 10)
    assert len(seen) == 3 and trainer.should_stop


def test_strict_false_only_warns_when_the_metric_is_absent():
    """Lightning: EarlyStopping(strict=False) warns (does not raise) when the monitored metric is missing."""
    with pytest.warns(UserWarning, match=r"monitor='val/los'.*strict=False"):
        trainer, seen = _fit(EarlyStopping("val/los", strict=False), [1.0] * 3, max_steps=6)
    assert not trainer.should_stop and len(seen) == 3


def test_monitors_a_training_metric_without_validation_loop(tmp_path):
    """Lightning: with no validation loop EarlyStopping checks at the train epoch end
    (check_on_train_epoch_end), so a metric logged in training_step can stop the run."""
    from torch.utils.data import DataLoader

    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge import Trainer

    class Flat(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("score", 1.0, on_step=False, on_epoch=True)  # never improves after epoch 0
            return super().training_step(batch, batch_idx)

    cb = EarlyStopping("score", patience=2, verbose=False)
    trainer = Trainer(
        max_epochs=10,
        callbacks=[cb],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(Flat(make_net()), DataLoader(regression_data(n=16), batch_size=8))
    assert trainer.current_epoch == 3 and cb.stopped_epoch == 2  # epochs 0 (best), 1, 2 (patience 2 spent)


@pytest.mark.slow
def test_two_ranks_stop_together_when_only_rank1_stalls():
    r0, r1 = multirank("early_stopping")  # real Trainer.fit, validation every epoch
    assert r0["should_stop"] and r1["should_stop"]
    # rank 1: best at the 1st validation, 2 stalls (patience) -> stop at the 3rd epoch's end, on both ranks
    assert r0["global_step"] == r1["global_step"] == 3 * r1["batches_per_epoch"]
    assert r0["stopped_epoch"] == r1["stopped_epoch"] == 2
    assert r0["wait_count"] == 0 and r1["wait_count"] == r1["patience"]  # only rank 1 saw no improvement
