"""The checkpoint directory format on real files: round trips, corruption, unsafe pickles, pointers."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from trainforge.strategies.checkpoint.io import (
    CheckpointWriter,
    delete_checkpoint,
    find_latest_valid,
    from_plain,
    list_checkpoints,
    load_object,
    load_tensors,
    metadata_checksum,
    parse_size,
    read_latest_pointer,
    read_metadata,
    resolve_checkpoint,
    to_plain,
    verify_checkpoint,
    write_latest_pointer,
)
from trainforge.strategies.errors import CheckpointError, ConfigurationError


class TiedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # tied, as in language models


def _state() -> dict:
    torch.manual_seed(0)
    base = torch.randn(8, 8)
    return {
        "mat_t": torch.randn(5, 7).t(),  # non-contiguous
        "bf16": torch.randn(4, 3).to(torch.bfloat16),
        "int64": torch.arange(-3, 9, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "row0": base[0],
        "row1": base[1],  # two different views of one storage
    }


def _save(root: Path, name: str, step: int, state=None, **kw) -> Path:
    w = CheckpointWriter(root / name)
    w.save_tensors("model", _state() if state is None else state, **kw)
    w.save_object("optimizer", {"step": step, "exp_avg": torch.full((300,), float(step)), "lrs": [0.1, 0.01]})
    return w.finalize({"step": step, "epoch": 0, "strategy": "single", "precision": "32", "run": "test"})


def test_round_trip_tensors_objects_and_tied_weights(tmp_path):
    net = TiedNet()
    state = {**_state(), **net.state_dict(keep_vars=True)}
    path = _save(tmp_path, "step-1", 1, state=state)
    assert path == tmp_path / "step-1" and not (tmp_path / ".step-1.partial").exists()
    out = load_tensors(path, "model")
    assert set(out) == set(state)
    for key, value in state.items():
        assert out[key].dtype == value.dtype and torch.equal(out[key], value.detach()), key
    assert out["head.weight"] is out["emb.weight"]  # the tie is restored, not two copies
    restored = TiedNet()
    restored.load_state_dict({k: out[k] for k in net.state_dict()})
    assert torch.equal(restored.head.weight, net.emb.weight) and restored.head.weight is restored.emb.weight
    obj = load_object(path, "optimizer")
    assert obj["step"] == 1 and obj["lrs"] == [0.1, 0.01] and torch.equal(obj["exp_avg"], torch.full((300,), 1.0))
    meta = verify_checkpoint(path)
    assert (meta["step"], meta["epoch"], meta["world_size"], meta["strategy"], meta["precision"], meta["run"]) == (
        1,
        0,
        1,
        "single",
        "32",
        "test",
    )
    assert set(meta["versions"]) == {"trainforge", "torch", "safetensors", "python"}
    assert set(meta["files"]) == {"model.safetensors", "optimizer.pt"}
    assert meta["files"]["optimizer.pt"]["size"] == (path / "optimizer.pt").stat().st_size
    assert read_latest_pointer(tmp_path) == "step-1"


def test_single_file_is_plain_safetensors(tmp_path):
    path = _save(tmp_path, "step-1", 1)
    plain = safetensors.torch.load_file(str(path / "model.safetensors"))
    for key, value in _state().items():
        assert torch.equal(plain[key], value)
    with safetensors.safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"


def test_sharded_save_writes_hf_index_and_loads_back(tmp_path):
    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(5)}  # 16 KiB each
    state["tied"] = state["layer0.weight"]
    w = CheckpointWriter(tmp_path / "step-1")
    files = w.save_tensors("model", state, max_shard_size="40KB")
    w.finalize({"step": 1})
    index = json.loads((tmp_path / "step-1" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3 and shards[0] == "model-00001-of-00003.safetensors"
    assert files == shards + ["model.safetensors.index.json"]
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 4
    assert set(index["weight_map"]) == {f"layer{i}.weight" for i in range(5)}
    for shard in shards:  # each shard is an ordinary safetensors file
        part = safetensors.torch.load_file(str(tmp_path / "step-1" / shard))
        assert all(torch.equal(part[k], state[k]) for k in part)
    out = load_tensors(tmp_path / "step-1")
    assert set(out) == set(state) and all(torch.equal(out[k], state[k]) for k in state)
    assert out["tied"] is out["layer0.weight"]


@pytest.mark.slow
@pytest.mark.parametrize("max_shard_size", ["5GB", "20KB"])
def test_transformers_reads_our_weights(tmp_path, max_shard_size):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    w = CheckpointWriter(tmp_path / "hf")
    w.save_tensors("model", model.state_dict(), max_shard_size=max_shard_size)
    config.save_pretrained(w.tmp_dir)  # written by another library: covered by the manifest anyway
    path = w.finalize({"step": 0})
    assert "config.json" in verify_checkpoint(path)["files"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))


def _future_version(p: Path) -> None:
    meta = json.loads(p.read_text())
    meta["format_version"] = 99
    meta["checksum"] = metadata_checksum(meta)
    p.write_text(json.dumps(meta))


CORRUPTIONS = {
    "truncated": ("model.safetensors", _truncate, "size mismatch"),
    "flipped": ("model.safetensors", _flip, "checksum mismatch"),
    "missing": ("optimizer.pt", Path.unlink, "missing file"),
    "bad_metadata": ("metadata.json", lambda p: p.write_text('{"format_version": 1, "step": '), "unparsable metadata"),
    "no_metadata": ("metadata.json", Path.unlink, "missing file"),
    "future_version": ("metadata.json", _future_version, "unknown format_version=99"),
    "edited_metadata": (
        "metadata.json",
        lambda p: p.write_text(p.read_text().replace('"step": 2', '"step": 7')),
        "checksum mismatch",
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_named_and_skipped(tmp_path, kind):
    file, damage, problem = CORRUPTIONS[kind]
    good = _save(tmp_path, "step-1", 1)
    bad = _save(tmp_path, "step-2", 2)
    damage(bad / file)
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(bad)
    assert str(bad / file) in str(err.value) and problem in str(err.value)
    found, skipped = find_latest_valid(tmp_path)
    assert found == good
    assert [p for p, _ in skipped] == [bad] and problem in skipped[0][1]
    with pytest.warns(UserWarning, match="skipped") as record:
        assert resolve_checkpoint(tmp_path, "last") == good  # latest names step-2, which is bad
    assert str(bad / file) in str(record[0].message)
    assert str(record[0].message).count(f"{bad}:") == 1  # reported once, though `latest` named it
    with pytest.raises(CheckpointError):  # an explicit path is never silently replaced
        resolve_checkpoint(tmp_path, bad)


def test_unreadable_files_raise_checkpoint_error_naming_them(tmp_path):
    path = _save(tmp_path, "step-1", 1)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot be read as safetensors"):
        load_tensors(path)
    _truncate(path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="optimizer.pt: cannot be read"):
        load_object(path, "optimizer")
    with pytest.raises(CheckpointError, match="missing file"):
        load_object(path, "scheduler")


class _Evil:
    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "PWNED"
    evil = _Evil()
    evil.marker = str(marker)
    path = _save(tmp_path, "step-1", 1)
    torch.save({"state": evil}, path / "optimizer.pt")  # an attacker swaps the file
    with pytest.raises(CheckpointError) as err:
        load_object(path, "optimizer")
    message = str(err.value)
    assert f"refused to load {path / 'optimizer.pt'}" in message
    assert "system" in message and "untrusted sources" in message
    assert not marker.exists()
    w = CheckpointWriter(tmp_path / "step-2")  # and we never write such a file ourselves
    with pytest.raises(ConfigurationError, match="weights_only"):
        w.save_object("evil", {"x": evil})
    assert not (w.tmp_dir / "evil.pt").exists() and not marker.exists()


def test_numpy_state_needs_to_plain_and_round_trips(tmp_path):
    rng = np.random.RandomState(7)
    rng.rand(3)
    w = CheckpointWriter(tmp_path / "step-1")
    with pytest.raises(ConfigurationError, match="to_plain"):
        w.save_object("rng", {"numpy": rng.get_state()})
    w.save_object("rng", {"numpy": to_plain(rng.get_state()), "scalar": to_plain(np.float64(2.5))})
    w.finalize({"step": 1})
    back = load_object(tmp_path / "step-1", "rng")
    assert back["scalar"] == 2.5 and type(back["scalar"]) is float
    other = np.random.RandomState(0)
    other.set_state(from_plain(back["numpy"]))
    assert np.array_equal(other.rand(5), rng.rand(5))


def test_overwrite_keeps_a_complete_copy_at_every_moment(tmp_path):
    _save(tmp_path, "last", 1)
    _save(tmp_path, "last", 2)
    assert read_metadata(tmp_path / "last")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]
    # The state a crash between the two renames leaves: old copy aside, new one still partial.
    os.rename(tmp_path / "last", tmp_path / ".last.old")
    (tmp_path / ".last.partial").mkdir()
    (tmp_path / ".last.partial" / "model.safetensors").write_bytes(b"half")
    assert resolve_checkpoint(tmp_path, "last") == tmp_path / ".last.old"
    assert load_object(resolve_checkpoint(tmp_path, "last"), "optimizer")["step"] == 2
    _save(tmp_path, "last", 3)
    assert read_metadata(tmp_path / "last")["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]


def test_leftover_partials_are_ignored_then_cleaned(tmp_path):
    _save(tmp_path, "step-1", 1)
    (tmp_path / ".step-2.partial").mkdir()
    (tmp_path / ".step-2.partial" / "model.safetensors").write_bytes(b"junk")
    assert list_checkpoints(tmp_path) == [tmp_path / "step-1"]
    assert find_latest_valid(tmp_path) == (tmp_path / "step-1", [])
    _save(tmp_path, "step-3", 3)
    assert not (tmp_path / ".step-2.partial").exists()


def test_list_orders_by_metadata_step_and_delete_protects_latest(tmp_path):
    export = CheckpointWriter(tmp_path / "export, no step")
    export.save_object("weights", {"w": torch.ones(1)})
    export.finalize({}, update_latest=False)
    _save(tmp_path, "zz-first", 1)
    _save(tmp_path, "aa-second", 2)
    _save(tmp_path, "mm-third", 3)
    write_latest_pointer(tmp_path, "aa-second")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["export, no step", "zz-first", "aa-second", "mm-third"]
    assert resolve_checkpoint(tmp_path, "last") == tmp_path / "aa-second"  # the pointer wins when valid
    with pytest.warns(UserWarning, match="resume point"):
        assert delete_checkpoint(tmp_path / "aa-second") is False
    assert (tmp_path / "aa-second").is_dir()
    assert delete_checkpoint(tmp_path / "zz-first") is True
    assert [p.name for p in list_checkpoints(tmp_path)] == ["export, no step", "aa-second", "mm-third"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("a directory of the user's, not a checkpoint")
    assert find_latest_valid(tmp_path) == (tmp_path / "mm-third", [])  # "notes" is not reported as broken
    with pytest.raises(CheckpointError, match="not a trainforge checkpoint"):
        delete_checkpoint(tmp_path / "notes")
    assert (tmp_path / "notes").is_dir()


def test_resolve_when_empty_or_pointer_dangling(tmp_path):
    assert resolve_checkpoint(tmp_path / "none", "last", missing_ok=True) is None
    with pytest.raises(CheckpointError, match="missing_ok"):
        resolve_checkpoint(tmp_path, "last")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_checkpoint(tmp_path, "step-9")
    _save(tmp_path, "step-1", 1)
    assert resolve_checkpoint(tmp_path, "step-1") == tmp_path / "step-1"  # relative to the root
    write_latest_pointer(tmp_path, "step-5")
    with pytest.warns(UserWarning, match="does not exist"):
        assert resolve_checkpoint(tmp_path, "last") == tmp_path / "step-1"
    _truncate(tmp_path / "step-1" / "optimizer.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="none verifies|no checkpoint under .* verifies"):
            resolve_checkpoint(tmp_path, "last", missing_ok=True)  # corrupt is not "missing"


def test_bad_input_is_refused_before_writing(tmp_path):
    with pytest.raises(ConfigurationError, match="barrier"):
        CheckpointWriter(tmp_path / "a", rank=0, world_size=2)
    for name in ("latest", ".hidden", " lead", ""):
        with pytest.raises(ConfigurationError, match="not valid"):
            CheckpointWriter(tmp_path / "x" / name if name else tmp_path / "x" / "..")
    w = CheckpointWriter(tmp_path / "ok")
    with pytest.raises(ConfigurationError, match="'5 gigs' is not a size"):
        w.save_tensors("model", {"a": torch.ones(1)}, max_shard_size="5 gigs")
    with pytest.raises(ConfigurationError, match="'lr' is a float"):
        w.save_tensors("model", {"a": torch.ones(1), "lr": 0.1})
    with pytest.raises(ConfigurationError, match="not valid inside a checkpoint"):
        w.save_object("../escape", 1)
    with pytest.raises(ConfigurationError, match="step='7'"):
        w.finalize({"step": "7"})
    with pytest.raises(ConfigurationError, match="format_version"):
        w.finalize({"step": 1, "format_version": 3})
    with pytest.raises(ConfigurationError, match="JSON"):
        w.finalize({"step": 1, "obj": object()})
    assert not (tmp_path / "ok").exists()
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 5 * 10**8 and parse_size(123) == 123


@pytest.mark.parametrize(
    "strategy,reader",
    [
        ("fsdp", "FSDPStrategy or MegatronStrategy"),
        ("megatron", "MegatronStrategy or FSDPStrategy"),
        ("deepspeed", "DeepSpeedStrategy"),
    ],
)
def test_a_sharded_checkpoint_given_to_a_whole_model_reader_says_what_it_is(tmp_path, strategy, reader):
    """DDP or single device resuming an FSDP/DeepSpeed checkpoint must not say only 'model.safetensors missing'."""
    writer = CheckpointWriter(tmp_path / "ckpt")
    writer.save_object("trainer_state", {"progress": {}})
    path = writer.finalize({"strategy": strategy})
    with pytest.raises(
        CheckpointError,
        match=rf"sharded checkpoint written by strategy='{strategy}' "
        rf"\(no model.safetensors\); load it with {reader}",
    ):
        load_tensors(path)
    plain = CheckpointWriter(tmp_path / "plain")  # written by a whole-model strategy: the missing file is named
    plain.save_object("trainer_state", {"progress": {}})
    with pytest.raises(CheckpointError, match=r"model.safetensors: missing file"):
        load_tensors(plain.finalize({"strategy": "ddp"}))
