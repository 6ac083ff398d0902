"""WeightAveraging / EMAWeightAveraging: the average equals a hand-written EMA of the same weights,
validation and the saved model see it, a resumed run is bit-identical to one never stopped, FSDP2
averages each rank's shard (2 real gloo processes), bad arguments are refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers import forklaunch
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer
from trainforge.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging
from trainforge.strategies.errors import ConfigurationError

DECAY = 0.9
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


class Recorder(Regressor):
    """Records the weights after every optimizer step (its hook runs before the callbacks') and the
    weights its first validation batch of each validation sees."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(make_net(), lr=5e-2)
        self.after_step: list = []
        self.seen_by_validation: list = []

    def weights(self) -> list:
        return [t.detach().clone() for t in [*self.parameters(), *self.buffers()]]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after_step.append(self.weights())

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.seen_by_validation.append((len(self.after_step), self.weights()))
        return super().validation_step(batch, batch_idx)


def _ema_by_hand(history: list, textbook: bool = False) -> list:
    """The average after each step: the first copies; then lerp (torch's get_ema_multi_avg_fn), or
    ``decay * a + (1 - decay) * w`` (get_ema_avg_fn, Lightning's EMAWeightAveraging)."""
    out, avg = [], None
    for weights in history:
        if avg is None:
            avg = [w.clone() for w in weights]
        elif textbook:
            avg = [DECAY * a + (1 - DECAY) * w for a, w in zip(avg, weights)]
        else:
            avg = [a.lerp(w, 1 - DECAY) for a, w in zip(avg, weights)]
        out.append(avg)
    return out


def _fit(root: Path, max_steps: int, callbacks: list, ckpt_path=None, **kwargs):
    module = Recorder()
    trainer = Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=3,
        seed=0,
        logger=False,  # checkpoints in <root>/checkpoints (a logger's would be in its version folder)
        **kwargs,
    )
    data = regression_data(n=64)
    trainer.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=32), ckpt_path=ckpt_path)
    return trainer, module


def _same(a, b) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else _same(x, y) for x, y in zip(a, b))


def test_ema_matches_a_hand_loop_validation_and_saved_weights_see_it(tmp_path):
    ema = EMAWeightAveraging(decay=DECAY)
    trainer, module = _fit(tmp_path, 12, [ema], enable_checkpointing=False)
    by_hand = _ema_by_hand(module.after_step)
    assert len(by_hand) == 12 and ema.local_numel == sum(p.numel() for p in module.parameters())
    # after fit the module holds the average (Lightning): bit-identical to torch.lerp by hand
    assert _same(module.weights(), by_hand[-1])
    textbook = _ema_by_hand(module.after_step, textbook=True)[-1]  # Lightning's formula: same up to rounding
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(module.weights(), textbook))
    assert not _same(module.weights(), module.after_step[-1])  # and the average is not the last weights
    # every validation ran on the average of the steps before it, and training went on with the current weights
    # (validation runs before BATCH_END, where the recorder counts the step: n steps recorded, n + 1 taken)
    assert [n for n, _ in module.seen_by_validation] == [2, 5, 10]
    for n, seen in module.seen_by_validation:
        assert _same(seen, by_hand[n])
        assert not _same(module.after_step[n], by_hand[n])  # and BATCH_END after it has the current weights back
    # the weights saved after fit are the average
    trainer.save_weights(str(tmp_path / "weights"))
    saved = load_file(str(tmp_path / "weights" / "model.safetensors"))
    names = [n for n, _ in module.named_parameters()]
    assert all(torch.equal(saved[n], w) for n, w in zip(names, by_hand[-1]))


def test_resume_mid_run_is_bit_identical(tmp_path):
    whole, whole_mod = _fit(tmp_path / "whole", 14, [EMAWeightAveraging(decay=DECAY)], enable_checkpointing=False)
    cut = tmp_path / "cut"
    # every_n_steps=4 saves at step 4 (BATCH_END) and, stopped at step 6, at fit end (after the average is swapped in)
    first_ema = EMAWeightAveraging(decay=DECAY)
    _fit(cut, 6, [first_ema, ModelCheckpoint(every_n_steps=4, save_last=True)])
    ckpts = sorted(p for p in (cut / "checkpoints").iterdir() if (p / "model.safetensors").exists())
    assert len(ckpts) == 2, ckpts
    by_hand = _ema_by_hand(whole_mod.after_step)
    for path, step in zip(ckpts, (4, 6)):  # the checkpoint's model is the average (Lightning)
        saved = load_file(str(path / "model.safetensors"))
        names = [n for n, _ in whole_mod.named_parameters()]
        assert all(torch.equal(saved[n], w) for n, w in zip(names, by_hand[step - 1])), path
    resumed_ema = EMAWeightAveraging(decay=DECAY)
    _, resumed_mod = _fit(cut, 14, [resumed_ema, ModelCheckpoint(every_n_steps=4)], ckpt_path="last")
    assert _same(resumed_mod.after_step, whole_mod.after_step[6:])  # the current weights of every step
    assert _same(resumed_mod.weights(), whole_mod.weights())  # the average, in the module after fit
    # the current weights at the end are exactly the uninterrupted run's
    assert _same(resumed_ema.state_dict()["current_model_state"].values(), whole_mod.after_step[-1])
    assert resumed_ema.state_dict()["n_averaged"] == 14


def test_update_schedule_and_swa_default(tmp_path):
    ema = EMAWeightAveraging(decay=DECAY, update_every_n_steps=3, update_starting_at_step=2)
    _, module = _fit(tmp_path / "ema", 12, [ema], enable_checkpointing=False)
    picked = [w for i, w in enumerate(module.after_step) if i >= 2 and i % 3 == 0]  # step_idx 3, 6, 9
    assert ema.state_dict()["n_averaged"] == 3 and _same(module.weights(), _ema_by_hand(picked)[-1])
    swa = WeightAveraging()
    _, module = _fit(tmp_path / "swa", 6, [swa], enable_checkpointing=False)
    mean = [torch.stack(ws).mean(0) for ws in zip(*module.after_step)]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(module.weights(), mean))


@pytest.mark.parametrize("decay", [0, 1, -0.1, 1.5, "x", True, float("nan")])
def test_bad_decay_is_refused(decay):
    with pytest.raises(ConfigurationError, match=r"decay=.*strictly between 0 and 1"):
        EMAWeightAveraging(decay=decay)


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigurationError, match=r"update_every_n_steps=0.*integer >= 1"):
        EMAWeightAveraging(update_every_n_steps=0)
    with pytest.raises(ConfigurationError, match=r"update_starting_at_step=-1"):
        EMAWeightAveraging(update_starting_at_step=-1)
    with pytest.raises(ConfigurationError, match="not both"):
        WeightAveraging(avg_fn=lambda a, w, n: a, multi_avg_fn=lambda a, w, n: None)
    with pytest.raises(ConfigurationError, match="unknown argument.*decay"):
        WeightAveraging(decay=0.9)


@pytest.mark.slow
def test_fsdp2_averages_each_shard(tmp_path):
    out = forklaunch.launch(SCRIPTS / "ema_fsdp.py", tmp_path, timeout=120).stdout
    assert "rank 0 ok" in out and "rank 1 ok" in out, out[-3000:]


def test_module_weights_are_never_replaced():
    """The swap copies values in place: the optimizer keeps training the same parameter objects."""
    ema = EMAWeightAveraging(decay=DECAY)
    net, trainer = nn.Linear(2, 2), SimpleNamespace(stage="fit", global_step=0, callbacks=[ema])
    ids = [id(p) for p in net.parameters()]
    ema.on_setup(trainer, net, "fit")  # type: ignore[arg-type]
    ema.on_fit_start(trainer, net)  # type: ignore[arg-type]
    ema.on_validation_epoch_start(trainer, net)  # type: ignore[arg-type]
    ema.on_validation_epoch_end(trainer, net)  # type: ignore[arg-type]
    assert ids == [id(p) for p in net.parameters()]


def test_a_run_saved_with_an_average_is_not_resumed_without_its_callback(tmp_path):
    from trainforge import Accelerator
    from trainforge.strategies.errors import CheckpointError

    _fit(tmp_path, 4, [EMAWeightAveraging(decay=DECAY), ModelCheckpoint(every_n_steps=4)])
    # the checkpoint's model is the average: training on from it would not be the run that was saved
    with pytest.raises(CheckpointError, match=r"without the callback EMAWeightAveraging: .*Pass EMAWeightAveraging"):
        _fit(tmp_path, 8, [ModelCheckpoint(every_n_steps=4)], ckpt_path="last")
    checkpoint = next((tmp_path / "checkpoints").glob("epoch=*"))
    acc = Accelerator()
    model = acc.prepare(Recorder())
    acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="without the callback EMAWeightAveraging"):
        acc.load_state(str(checkpoint))
    # the averaged weights themselves stay readable as a model
    Recorder.load_from_checkpoint(str(checkpoint))
    # and with the callback the run goes on
    _fit(tmp_path, 8, [EMAWeightAveraging(decay=DECAY), ModelCheckpoint(every_n_steps=4)], ckpt_path="last")


@pytest.mark.parametrize(
    "callbacks",
    [
        lambda: [EMAWeightAveraging(decay=0.9), EMAWeightAveraging(decay=0.99)],
        lambda: [WeightAveraging(), EMAWeightAveraging(decay=0.9)],
    ],
    ids=["two-ema", "swa-and-ema"],
)
def test_two_averaging_callbacks_are_refused_naming_them(tmp_path, callbacks):
    with pytest.raises(ConfigurationError, match=r"holds 2 weight-averaging callbacks \((\w*WeightAveraging, ?){1}"):
        _fit(tmp_path, 2, callbacks(), enable_checkpointing=False)
