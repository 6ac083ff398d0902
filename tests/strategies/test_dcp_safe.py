"""Hostile torch.distributed.checkpoint files: nothing in them is executed, on every path that reads DCP.

Each test builds a real DCP checkpoint (``dcp.save`` on this process, no process group), plants a
payload that would create a marker file when unpickled, and asserts the load is refused and the
marker does not exist. The payload is planted inside a trainforge checkpoint whose manifest
verifies (the attacker recomputes the crc32s: here the writer computes them for the planted file).
"""

from __future__ import annotations

import os
import pickle
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from tests.helpers.procs import run
from tests.helpers.procs import test_env as child_env
from trainforge.strategies import FSDPStrategy
from trainforge.strategies.checkpoint.dcp_safe import load_metadata
from trainforge.strategies.checkpoint.io import CheckpointWriter, verify_checkpoint
from trainforge.strategies.errors import CheckpointError
from trainforge.trainer.cli.main import main as cli_main


class Payload:
    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _payload(marker: Path) -> Payload:
    p = Payload()
    p.marker = str(marker)
    return p


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optimizers": {"0": get_optimizer_state_dict(model, opt)}}


def _save_dcp(folder: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _verified_checkpoint(root: Path, plant) -> Path:
    """A trainforge checkpoint ``root/step-1`` holding ``dcp/``; ``plant(dcp_dir)`` runs before the
    manifest is written, so the hostile file is covered by valid crc32s."""
    model, opt = _model_and_opt()
    writer = CheckpointWriter(root / "step-1")
    _save_dcp(writer.tmp_dir / "dcp", _state(model, opt))
    plant(writer.tmp_dir / "dcp")
    writer.save_object(
        "trainer_state",
        {
            "progress": {"global_step": 1, "epoch": 0, "batch_idx": 1},
            "schedulers": [],
            "custom": [],
            "callbacks": {},
            "loaders": 0,
        },
    )  # the parts a real one has
    path = writer.finalize({"step": 1, "strategy": "fsdp"})
    verify_checkpoint(path)  # the manifest verifies: checksums cannot stop this attack
    return path


def _hostile_metadata(marker: Path):
    def plant(dcp_dir: Path) -> None:
        (dcp_dir / ".metadata").write_bytes(pickle.dumps(_payload(marker)))

    return plant


def _hostile_bytes_entry(marker: Path):
    """A non-tensor entry (an optimizer's lr) whose bytes torch's planner would torch.load(weights_only=False)."""

    def plant(dcp_dir: Path) -> None:
        model, opt = _model_and_opt()
        state = _state(model, opt)
        state["optimizers"]["0"]["param_groups"][0]["lr"] = _payload(marker)
        for f in dcp_dir.iterdir():
            f.unlink()
        _save_dcp(dcp_dir, state)

    return plant


def test_real_dcp_metadata_loads_through_the_allowlist(tmp_path):
    model, opt = _model_and_opt()
    _save_dcp(tmp_path / "dcp", _state(model, opt))
    meta = load_metadata(tmp_path / "dcp" / ".metadata")
    assert "model.weight" in meta.state_dict_metadata
    # and a full round trip through FSDPStrategy.load_checkpoint (the resume path), no process group
    path = _verified_checkpoint(tmp_path / "ok", lambda d: None)
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    FSDPStrategy().load_checkpoint(path, fresh, [fresh_opt])
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("plant", [_hostile_metadata, _hostile_bytes_entry], ids=["metadata", "bytes-entry"])
def test_fsdp_resume_refuses_hostile_dcp(tmp_path, plant):
    marker = tmp_path / "PWNED"
    path = _verified_checkpoint(tmp_path / "ckpt", plant(marker))
    model, opt = _model_and_opt()
    with pytest.raises(CheckpointError, match="Nothing in it was executed"):
        FSDPStrategy().load_checkpoint(path, model, [opt])
    assert not marker.exists()


def test_merge_weights_refuses_hostile_metadata(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    path = _verified_checkpoint(tmp_path / "ckpt", _hostile_metadata(marker))
    for source in (path, path / "dcp", tmp_path / "ckpt"):  # checkpoint, bare DCP dir, root via 'latest'
        assert cli_main(["merge-weights", str(source), str(tmp_path / "out")]) == 2
        assert "Nothing in it was executed" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_truncated_metadata_is_a_checkpoint_error(tmp_path):
    model, opt = _model_and_opt()
    _save_dcp(tmp_path / "dcp", _state(model, opt))
    data = (tmp_path / "dcp" / ".metadata").read_bytes()
    (tmp_path / "dcp" / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_metadata(tmp_path / "dcp" / ".metadata")


ACCELERATOR_SCRIPT = textwrap.dedent("""
    import sys, torch
    from trainforge.strategies import FSDPStrategy
    from trainforge.strategies.errors import CheckpointError
    from trainforge import Accelerator
    acc = Accelerator(strategy=FSDPStrategy())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    try:
        acc.load_state(sys.argv[1])
    except CheckpointError as e:
        print("refused:", e, flush=True)
    acc.end_training()
""")


@pytest.mark.slow
def test_accelerator_load_state_refuses_hostile_metadata(tmp_path):
    marker = tmp_path / "PWNED"
    path = _verified_checkpoint(tmp_path / "ckpt", _hostile_metadata(marker))
    script = tmp_path / "acc.py"
    script.write_text(ACCELERATOR_SCRIPT)
    out = run([sys.executable, str(script), str(path)], timeout=180, env=child_env()).stdout
    assert "refused:" in out and "Nothing in it was executed" in out, out[-2000:]
    assert not marker.exists()


def test_sharded_resume_into_another_shape_names_the_parameter_and_both_shapes(tmp_path):
    """Issue 25: DCP's own error was every rank's traceback inside one CheckpointException."""
    path = _verified_checkpoint(tmp_path / "ckpt", lambda d: None)  # a Linear(3, 2)
    wider = torch.nn.Linear(5, 2)
    with pytest.raises(
        CheckpointError,
        match=r"step-1 does not fit this model \(different shapes: \['weight: checkpoint \(2, 3\) vs model \(2, 5\)'\]\)"
        r"; resume with the model it was saved from",
    ):
        FSDPStrategy().load_checkpoint(path, wider, [torch.optim.AdamW(wider.parameters())])
    more = torch.nn.Sequential(torch.nn.Linear(3, 2))  # other names: '0.weight' is not in the checkpoint
    with pytest.raises(CheckpointError, match=r"does not fit this model \(missing from the checkpoint: \['0.weight'"):
        FSDPStrategy().load_checkpoint(path, more, [])
