"""Real Lightning programs, imports changed only (``tests/scripts/lightning_ported/``), run in-process on
one CPU process; their numbers are checked against a hand-written loop here (Lightning is not a
dependency). Lightning 2.6 gave the same numbers for the same files with Lightning's imports
(torch.manual_seed(0) first; the values below): BoringModel test_loss 2.1341631412506104 (global_step 1),
the autoencoder train_loss 0.0897202 after 100 steps, the GAN d_loss 0.6909499 and g_loss 0.6416866 after
2 epochs (global_step 16: both optimizers' steps)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PORTED = Path(__file__).resolve().parents[1] / "scripts" / "lightning_ported"


def run_program(name: str, root: Path):
    torch.manual_seed(0)  # before the file runs: the autoencoder builds its layers at import
    program = runpy.run_path(str(PORTED / f"{name}.py"), run_name="ported")
    return program["run"](str(root))


def test_boring_model_bug_report_template(tmp_path):
    trainer, model, results = run_program("boring", tmp_path)
    torch.manual_seed(0)
    train, val, test = torch.randn(64, 32), torch.randn(64, 32), torch.randn(64, 32)
    layer = nn.Linear(32, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    train_loss = layer(train[:2]).sum()
    train_loss.backward()
    opt.step()
    with torch.no_grad():
        valid_loss, test_loss = layer(val[:2]).sum(), layer(test[:2]).sum()
    assert (trainer.current_epoch, trainer.global_step) == (1, 1)
    assert results == [{"test_loss": pytest.approx(float(test_loss), abs=1e-6)}]
    assert float(test_loss) == pytest.approx(2.1341631412506104, abs=1e-6)  # Lightning 2.6
    assert float(trainer.callback_metrics["valid_loss"]) == pytest.approx(float(valid_loss), abs=1e-6)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(float(train_loss.detach()), abs=1e-6)
    assert torch.equal(model.layer.weight, layer.weight)


def test_readme_autoencoder(tmp_path):
    trainer, autoencoder, embeddings = run_program("autoencoder", tmp_path)
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))
    decoder = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 64))
    dataset = TensorDataset(torch.rand(120, 1, 8, 8), torch.zeros(120))
    opt = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=1e-3)
    for i, (x, _) in enumerate(DataLoader(dataset)):
        if i == 100:  # limit_train_batches=100
            break
        x = x.view(x.size(0), -1)
        loss = F.mse_loss(decoder(encoder(x)), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    expected = encoder.eval()(torch.rand(4, 64))
    assert (trainer.current_epoch, trainer.global_step) == (1, 100)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(float(loss), abs=1e-6)
    assert float(loss) == pytest.approx(0.0897202, abs=1e-6)  # Lightning 2.6
    for ours, theirs in zip(autoencoder.parameters(), [*encoder.parameters(), *decoder.parameters()]):
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(embeddings, expected)


def test_gan_with_manual_optimization_and_logger_experiment(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, model = run_program("gan", tmp_path)
    program = runpy.run_path(str(PORTED / "gan.py"), run_name="ported")  # its classes, for the hand loop
    torch.manual_seed(0)
    data = TensorDataset(torch.rand(16, 1, 4, 4) * 2 - 1, torch.zeros(16))
    gen, disc = program["Generator"](4, (1, 4, 4)), program["Discriminator"]((1, 4, 4))
    validation_z = torch.randn(8, 4)
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.0002, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.0002, betas=(0.5, 0.999))
    bce = F.binary_cross_entropy_with_logits
    for _ in range(2):
        for imgs, _ in DataLoader(data, batch_size=4):
            z = torch.randn(4, 4)
            valid, fake = torch.ones(4, 1), torch.zeros(4, 1)
            g_loss = bce(disc(gen(z)), valid)
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            d_loss = (bce(disc(imgs), valid) + bce(disc(gen(z).detach()), fake)) / 2
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
        gen(validation_z)  # on_train_epoch_end samples in train mode: batch-norm statistics move
    assert (trainer.current_epoch, trainer.global_step) == (2, 16)  # Lightning: every optimizer step
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert logged == pytest.approx({"d_loss": float(d_loss), "g_loss": float(g_loss)}, abs=1e-6)
    assert logged == pytest.approx({"d_loss": 0.6909499, "g_loss": 0.6416866}, abs=1e-6)  # Lightning 2.6
    torch.testing.assert_close(dict(model.generator.state_dict()), dict(gen.state_dict()))
    torch.testing.assert_close(dict(model.discriminator.state_dict()), dict(disc.state_dict()))
    events = EventAccumulator(str(trainer.logger.directory), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("generated_images")] == [0, 1]
