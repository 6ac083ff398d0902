"""Bad input to dispatch and loading: clear errors naming the value, the choices and the fix."""

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.inference.common import plain
from trainforge.strategies.checkpoint.io import CheckpointWriter, refused_load
from trainforge.strategies.errors import CheckpointError, ConfigurationError
from trainforge.trainer.inference import disk_offload, dispatch_model, init_empty_weights, load_checkpoint_and_dispatch


@pytest.fixture
def ckpt(tmp_path):
    save_file(plain().state_dict(), str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors"


def _meta():
    with init_empty_weights():
        return plain()


@pytest.mark.parametrize(
    "device_map, err, match",
    [
        ({"": "tpu"}, ConfigurationError, r"device_map\[''\]='tpu' is not one of"),
        ({"": 7}, ConfigurationError, r"device_map\[''\]=7: there is no GPU 7"),
        ({"": "cuda:7"}, ConfigurationError, r"there is no GPU 7"),
        ({"0": "cpu", "1": "cpu"}, ConfigurationError, r"leaves \d+ weight\(s\) unplaced, first \['2.0.weight'"),
        ({"": "cpu", "encoder": "cpu"}, ConfigurationError, r"key 'encoder' is neither a module nor a tensor"),
        ("fastest", ConfigurationError, r"device_map='fastest' is not one of: auto, balanced"),
        ([("", "cpu")], ConfigurationError, r"must be a non-empty dict"),
    ],
)
def test_bad_device_map(ckpt, device_map, err, match):
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU 7")
    with pytest.raises(err, match=match):
        load_checkpoint_and_dispatch(_meta(), ckpt, device_map=device_map)


def test_checkpoint_mismatch_names_first_differences(tmp_path):
    sd = plain().state_dict()
    sd["extra.weight"] = torch.zeros(1)
    del sd["0.0.bias"]
    sd["1.0.weight"] = torch.zeros(3, 3)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"missing \['0.0.bias'\], unexpected \['extra.weight'\], shape "
        r"mismatches \['1.0.weight: checkpoint \(3, 3\) vs model \(32, 32\)'\]",
    ):
        load_checkpoint_and_dispatch(_meta(), tmp_path / "model.safetensors", device_map={"": "cpu"})


def test_bad_checkpoint_paths(tmp_path):
    with pytest.raises(CheckpointError, match=r"a directory without model.safetensors"):
        load_checkpoint_and_dispatch(_meta(), tmp_path, device_map={"": "cpu"})
    (tmp_path / "w.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is not a .safetensors file, an \*.index.json"):
        load_checkpoint_and_dispatch(_meta(), tmp_path / "w.pt", device_map={"": "cpu"})
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file"):
        load_checkpoint_and_dispatch(_meta(), tmp_path / "bad.safetensors", device_map={"": "cpu"})


def test_offload_folder_not_writable_or_missing(tmp_path):
    (tmp_path / "file").write_text("x")
    model = plain()
    with pytest.raises(ConfigurationError, match=r"offload_folder='.*file/sub' is not writable"):
        dispatch_model(model, {"": "disk"}, offload_dir=tmp_path / "file" / "sub")
    with pytest.raises(ConfigurationError, match=r"offload_folder=None but the device map sends weights to 'disk'"):
        dispatch_model(plain(), {"": "disk"})


def test_foreign_file_in_offload_folder_is_not_overwritten(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-offload.safetensors"))
    before = (tmp_path / "model-offload.safetensors").read_bytes()
    with pytest.raises(ConfigurationError, match=r"already holds model-offload.safetensors, which trainforge did not"):
        disk_offload(plain(), tmp_path, execution_device="cpu")
    assert (tmp_path / "model-offload.safetensors").read_bytes() == before


def test_tie_group_split_across_devices_and_other_arguments(ckpt):
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(ConfigurationError, match=r"tied weights \['0.weight', '1.weight'\] are mapped to different"):
        dispatch_model(model, {"0": "cpu", "1": "disk"}, offload_dir=None)
    with pytest.raises(ConfigurationError, match=r"dtype='half' is not a torch.dtype"):
        load_checkpoint_and_dispatch(_meta(), ckpt, dtype="half")
    with pytest.raises(ConfigurationError, match=r"execution_device='gpu' is not one of"):
        dispatch_model(plain(), {"": "cpu"}, execution_device="gpu")
    with pytest.raises(ConfigurationError, match=r"prefetch=1 must be True or False"):
        dispatch_model(plain(), {"": "cpu"}, prefetch=1)
    bad_buffers = r"include_buffers='yes' must be True or False"
    with pytest.raises(ConfigurationError, match=bad_buffers), init_empty_weights(include_buffers="yes"):
        pass
    with pytest.raises(ConfigurationError, match=r"weights still on meta"):
        dispatch_model(_meta(), {"": "cpu"})


def test_a_corrupted_trainforge_checkpoint_is_refused_for_inference_too(tmp_path):
    """A flipped bit in model.safetensors must not load without complaint (a resume refuses it too)."""
    from tests.helpers.models import Regressor, make_net, regression_data
    from trainforge import Trainer
    from trainforge.callbacks import ModelCheckpoint

    Trainer(
        default_root_dir=str(tmp_path),
        max_epochs=1,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(save_top_k=-1)],
        logger=False,  # checkpoints in <root>/checkpoints
    ).fit(Regressor(make_net()), torch.utils.data.DataLoader(regression_data(16), batch_size=4))
    ck = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
    with init_empty_weights():
        intact = Regressor(make_net())
    load_checkpoint_and_dispatch(intact, str(ck), device_map={"": "cpu"})  # verifies and loads
    weights = ck / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    for path in (ck, weights):  # the directory or the weights file inside it
        with init_empty_weights():
            model = Regressor(make_net())
        with pytest.raises(CheckpointError, match=r"model\.safetensors: checksum mismatch"):
            load_checkpoint_and_dispatch(model, str(path), device_map={"": "cpu"})


def test_a_weights_file_cut_or_rewritten_under_a_mapped_model_is_an_error_not_a_bus_error(tmp_path, ckpt):
    """Issue 25: truncating a safetensors file a dispatched model uses memory-mapped ended the process
    with a bare "Bus error" (SIGBUS) at the next forward; now every forward checks the mapped files."""
    x = torch.randn(2, 32)
    model = load_checkpoint_and_dispatch(_meta(), ckpt, device_map={"": "cpu"})
    expected = model(x)
    moved = tmp_path / "new.safetensors"  # a new file renamed over the name: the mapped inode is intact
    save_file(plain().state_dict(), str(moved))
    os.replace(moved, ckpt)
    assert torch.equal(model(x), expected)
    model = load_checkpoint_and_dispatch(_meta(), ckpt, device_map={"": "cpu"})
    st = os.stat(ckpt)
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place (same size)
    with pytest.raises(CheckpointError, match=r"model.safetensors was rewritten while this model uses it memory-m"):
        model(x)
    model = load_checkpoint_and_dispatch(_meta(), ckpt, device_map={"": "cpu"})
    os.truncate(ckpt, 100)  # before the fix: SIGBUS, the test process dies
    with pytest.raises(CheckpointError, match=r"truncated to 100 of \d+ bytes .* Load the model again; save new"):
        model(x)
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: its header is \d+ bytes long, the fil"):
        load_checkpoint_and_dispatch(_meta(), ckpt, device_map={"": "cpu"})
    save_file(plain().state_dict(), str(ckpt))
    os.truncate(ckpt, os.path.getsize(ckpt) - 8)  # cut in the data: refused before anything is mapped
    with pytest.raises(CheckpointError, match=r"truncated: its header describes \d+ bytes, the file has \d+; it was"):
        load_checkpoint_and_dispatch(_meta(), ckpt, device_map={"": "cpu"})
    offloaded = disk_offload(plain(), tmp_path / "off", execution_device="cpu")
    os.truncate(tmp_path / "off" / "model-offload.safetensors", 100)
    with pytest.raises(CheckpointError, match=r"model-offload.safetensors was truncated"):
        offloaded(x)


class _Evil:
    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_with_code_in_a_bin_checkpoint_is_refused_without_unsafe_advice(tmp_path):
    """Issue 25: a hostile .bin got torch's advice to retry with weights_only=False (which runs it)."""
    evil = _Evil()
    evil.marker = str(tmp_path / "PWNED")
    sd = dict(plain().state_dict())
    torch.save({**sd, "extra": evil}, tmp_path / "pytorch_model-00001.bin")
    weight_map = dict.fromkeys(sd, "pytorch_model-00001.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_and_dispatch(_meta(), tmp_path, device_map={"": "cpu"})
    message = str(err.value)
    assert "refused to load" in message and "posix.system" in message and "Nothing in it was executed" in message
    assert "weights_only" not in message and "Re-running" not in message
    assert not (tmp_path / "PWNED").exists()
    # a refusal torch words without a GLOBAL: its reason is kept, its advice dropped
    torch_text = (
        "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will likely "
        "succeed, but it can result in arbitrary code execution.\n\nUnsupported operand 149\n\nCheck the "
        "documentation of torch.load to learn more"
    )
    message = str(refused_load("f.bin", pickle.UnpicklingError(torch_text), "a weights file holds only tensors"))
    assert "load does not accept (Unsupported operand 149); a weights file holds only tensors" in message
    assert "weights_only" not in message and "Re-running" not in message


def test_a_path_that_does_not_exist_a_sharded_checkpoint_and_a_wrong_index_say_so(tmp_path, ckpt):
    """Issue 25: a missing path was 'not a .safetensors file'; an FSDP checkpoint 'a directory without
    model.safetensors'; an index naming tensors its shards lack, or files elsewhere, gave no cause."""
    with pytest.raises(CheckpointError, match=r"checkpoint='.*/nope/model.safetensors' does not exist \(.* holds \["):
        load_checkpoint_and_dispatch(_meta(), tmp_path / "nope" / "model.safetensors", device_map={"": "cpu"})
    writer = CheckpointWriter(tmp_path / "fsdp")
    writer.save_object("trainer_state", {"progress": {}})
    sharded = writer.finalize({"strategy": "fsdp"})
    with pytest.raises(CheckpointError, match=r"sharded checkpoint written by strategy='fsdp' .* `trainforge merge-w"):
        load_checkpoint_and_dispatch(_meta(), sharded, device_map={"": "cpu"})
    index = tmp_path / "model.safetensors.index.json"
    weight_map = dict.fromkeys(plain().state_dict(), "model.safetensors")
    index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": "model.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"puts 'lm_head.weight' in shard 'model.safetensors', but no shard h"):
        load_checkpoint_and_dispatch(_meta(), index, device_map={"": "cpu"})
    index.write_text(json.dumps({"weight_map": {**weight_map, "0.0.weight": "../model.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names the shard '../model.safetensors'; an index names files next"):
        load_checkpoint_and_dispatch(_meta(), index, device_map={"": "cpu"})
    index.write_text(json.dumps({"weight_map": {**weight_map, "0.0.weight": "model-2.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"shard 'model-2.safetensors' is missing from .* \(weight files the"):
        load_checkpoint_and_dispatch(_meta(), index, device_map={"": "cpu"})
