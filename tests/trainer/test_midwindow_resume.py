"""A checkpoint written inside an accumulation window (trainer/checkpoint/partial_grads.py) resumes bit for bit:
Accelerator on one process and on 2 DDP processes, Trainer with a mid-window validation save, in both
loss modes (mean of means; summed with num_items); bad grads files and another world size are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers import forklaunch
from trainforge import Trainer
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies.checkpoint.verify import file_crc32, metadata_checksum
from trainforge.strategies.errors import CheckpointError, ConfigurationError

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import midwindow_run as run  # noqa: E402
import token_loss_run as lm  # noqa: E402


def assert_same(full, resumed) -> None:
    for name, ref in full.items():
        assert torch.equal(resumed[name], ref), f"weights differ at {name}: {(resumed[name] - ref).abs().max()}"


@pytest.mark.parametrize("summed", [False, True], ids=["mean", "summed"])
def test_accelerator_save_after_micro_batch_2_of_4_resumes_bit_identical(tmp_path, summed):
    result = run.compare(tmp_path, summed)
    assert_same(result["full"], result["resumed"])
    assert (tmp_path / "ckpt" / "grads_rank0.pt").is_file()  # saved inside the window


def test_a_checkpoint_at_a_window_boundary_writes_no_gradients(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "CUT", 4)
    result = run.compare(tmp_path, summed=True)
    assert_same(result["full"], result["resumed"])
    assert not list((tmp_path / "ckpt").glob("grads_rank*"))


class ValidatedLM(lm.TokenLM):
    """Logs a score that grows with every validation, so ModelCheckpoint(monitor, mode='max') saves at each."""

    def validation_step(self, batch, batch_idx):
        self.log("val_mark", torch.tensor(float(self.trainer.global_step)))


def _fit(root: Path, summed: bool, max_steps: int, ckpt_path=None):
    module = ValidatedLM(summed=summed, lr=0.5)
    # 8 batches an epoch, 4 per window: validation (and the monitor's save) after batch 6, inside window 2
    checkpoint = ModelCheckpoint(monitor="val_mark", mode="max", save_top_k=1, filename="{val_mark}")
    trainer = Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=4,
        val_check_interval=6,
        default_root_dir=str(root),
        enable_progress_bar=False,
        logger=False,
        callbacks=[checkpoint],
    )
    val = DataLoader(lm.sequences(), batch_size=8)
    trainer.fit(module, DataLoader(lm.sequences(), batch_size=2, shuffle=True), val, ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, checkpoint.best_model_path


@pytest.mark.parametrize("summed", [False, True], ids=["mean", "summed"])
def test_trainer_resume_from_a_mid_window_validation_save_is_bit_identical(tmp_path, summed):
    torch.manual_seed(3)
    full, _ = _fit(tmp_path / "full", summed, max_steps=6)
    torch.manual_seed(3)
    _, mid_window = _fit(tmp_path / "cut", summed, max_steps=2)  # its one save: after batch 6 of epoch 0
    state = torch.load(Path(mid_window) / "trainer_state.pt", weights_only=True)
    has_grads = (Path(mid_window) / "grads_rank0.pt").is_file()
    torch.manual_seed(99)
    resumed, _ = _fit(tmp_path / "cut", summed, max_steps=6, ckpt_path=mid_window)
    assert_same(full, resumed)
    assert state["accumulation_step"] == 2 and has_grads


# ---- bad input ------------------------------------------------------------------------------------
def _resign(ckpt: Path, rel: str) -> None:
    """The manifest made to agree with ``rel`` as it is now (or without it when deleted)."""
    meta_path = ckpt / "metadata.json"
    meta = json.loads(meta_path.read_text())
    if (ckpt / rel).exists():
        size, crc = file_crc32(ckpt / rel)
        meta["files"][rel] = {"size": size, "crc32": crc}
    else:
        meta["files"].pop(rel)
    meta["checksum"] = metadata_checksum(meta)
    meta_path.write_text(json.dumps(meta))


@pytest.fixture
def mid_window_ckpt(tmp_path) -> Path:
    run.train(tmp_path / "ckpt", "cut", summed=False)
    return tmp_path / "ckpt"


def test_a_missing_grads_file_is_named(mid_window_ckpt):
    (mid_window_ckpt / "grads_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match="grads_rank0.pt"):
        run.train(mid_window_ckpt, "resume", summed=False)
    _resign(mid_window_ckpt, "grads_rank0.pt")  # gone from the manifest too: still named
    with pytest.raises(CheckpointError, match="grads_rank0.pt: missing file"):
        run.train(mid_window_ckpt, "resume", summed=False)


def test_a_gradient_of_another_shape_is_named(mid_window_ckpt):
    path = mid_window_ckpt / "grads_rank0.pt"
    saved = torch.load(path, weights_only=True)
    saved["grads"]["head.weight"] = torch.zeros(2, 2)
    torch.save(saved, path)
    _resign(mid_window_ckpt, "grads_rank0.pt")
    with pytest.raises(CheckpointError, match=r"grads_rank0.pt: the gradient of 'head.weight' has shape \(2, 2\)"):
        run.train(mid_window_ckpt, "resume", summed=False)


def test_a_mid_window_save_where_the_strategy_keeps_the_gradients_is_refused(tmp_path, monkeypatch):
    """FSDP2 (unsharded accumulated gradients in its private per-parameter state), DeepSpeed and
    pipeline strategies declare window_grads_in_params False: a save inside a window names the fix,
    before anything is written; one at a window boundary is unaffected."""
    from trainforge import Accelerator

    original_init = Accelerator.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        monkeypatch.setattr(self.strategy, "window_grads_in_params", False)

    monkeypatch.setattr(Accelerator, "__init__", init)
    with pytest.raises(ConfigurationError, match="inside an accumulation window.*optimizer-step boundary"):
        run.train(tmp_path / "ckpt", "cut", summed=False)
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.setattr(run, "CUT", 4)
    run.train(tmp_path / "ckpt", "cut", summed=False)
    assert (tmp_path / "ckpt" / "metadata.json").is_file()


# ---- two DDP processes ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("midwindow_ddp")
    forklaunch.launch(SCRIPTS / "midwindow_run.py", out, nproc=2, timeout=120)
    return out


def test_ddp_two_processes_resume_bit_identical(ddp_run):
    results = torch.load(ddp_run / "weights.pt", weights_only=True)
    for mode in ("mean", "summed"):
        assert_same(results[mode]["full"], results[mode]["resumed"])
    ckpt = ddp_run / "mean" / "ckpt"
    g0, g1 = (torch.load(ckpt / f"grads_rank{r}.pt", weights_only=True)["grads"] for r in (0, 1))
    assert not torch.equal(g0["head.weight"], g1["head.weight"])  # each rank's own partial sum


def test_another_world_size_is_refused_with_the_fix(ddp_run):
    with pytest.raises(CheckpointError, match=r"on 2 process\(es\).*window boundary"):
        run.train(ddp_run / "mean" / "ckpt", "resume", summed=False)
