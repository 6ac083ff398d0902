"""Loading and dispatching: outputs bit-identical to the eager model for cpu, disk and mixed maps,
for every checkpoint source; ties kept (one storage per tie group); nothing written for safetensors."""

import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.inference.common import gpt2_config, greedy, llama_config, plain, quiet_transformers, storages
from trainforge.strategies.checkpoint.io import CheckpointWriter
from trainforge.trainer.inference import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    materialize,
    remove_dispatch,
)

MAPS = {
    "cpu": {"": "cpu"},
    "disk": {"": "disk"},
    "mixed": {"0": "cpu", "1": "disk", "2": "cpu", "3": "disk", "4.0": "cpu", "4.1": "disk", "5": "disk", "6": "cpu"},
}
X = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))


def _trained_plain():
    torch.manual_seed(0)
    model = plain()
    for m in model.modules():  # non-trivial running stats, so buffers matter
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return model


def _listing(path):
    return sorted(p for p in os.listdir(path)) if os.path.isdir(path) else []


@pytest.mark.parametrize("name", list(MAPS))
def test_plain_model_from_safetensors_is_bit_identical_and_writes_nothing(tmp_path, name):
    ref_model = _trained_plain()
    ref = ref_model(X)
    save_file(ref_model.state_dict(), str(tmp_path / "model.safetensors"))
    with init_empty_weights():
        model = plain()
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    model = load_checkpoint_and_dispatch(
        model, tmp_path / "model.safetensors", device_map=MAPS[name], offload_folder=tmp_path / "offload"
    )
    assert torch.equal(model(X), ref)
    assert model.hf_device_map == MAPS[name]
    assert _listing(tmp_path / "offload") == []  # the source is safetensors: mapped, never re-written
    assert _listing(tmp_path) == ["model.safetensors"]


@pytest.mark.parametrize("name", list(MAPS))
def test_dispatch_model_in_memory(tmp_path, name):
    model = _trained_plain()
    ref = model(X)
    dispatch_model(model, MAPS[name], offload_dir=tmp_path / "off")
    assert torch.equal(model(X), ref)
    written = _listing(tmp_path / "off")
    assert written == (["model-offload.safetensors"] if name != "cpu" else [])
    with pytest.raises(Exception, match="dispatched with a device map"):
        model.to("cpu")
    remove_dispatch(model)
    model.to("cpu")  # allowed again


def test_cpu_and_disk_offload(tmp_path):
    model = _trained_plain()
    ref = model(X)
    cpu_offload(model, execution_device="cpu")
    assert torch.equal(model(X), ref)
    remove_dispatch(model)
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    with init_empty_weights():
        empty = plain()
    disk_offload(empty, tmp_path, execution_device="cpu")  # from the checkpoint already there: no state dict
    assert torch.equal(empty(X), ref)
    assert _listing(tmp_path) == ["model.safetensors"]


def test_sources_sharded_index_trainforge_and_bin(tmp_path):
    quiet_transformers()
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1)
    ref_model = GPT2LMHeadModel(gpt2_config()).eval()
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    ref = ref_model(ids).logits
    ref_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    writer = CheckpointWriter(tmp_path / "tf")
    writer.save_tensors("model", ref_model.state_dict(), max_shard_size="30KB")
    writer.finalize()
    sd = {k: v.clone() for k, v in ref_model.state_dict().items() if k != "lm_head.weight"}
    (tmp_path / "bin").mkdir()
    files = {}
    for i, (k, v) in enumerate(sd.items()):
        files.setdefault(f"pytorch_model-{i % 2}.bin", {})[k] = v
    for f, part in files.items():
        torch.save(part, tmp_path / "bin" / f)
    import json

    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, part in files.items() for k in part}})
    )
    for src in ("hf", "tf", "bin"):
        with init_empty_weights():
            model = GPT2LMHeadModel(gpt2_config()).eval()
        off = tmp_path / f"off-{src}"
        model = load_checkpoint_and_dispatch(model, tmp_path / src, device_map={"": "disk"}, offload_folder=off)
        assert torch.equal(model(ids).logits, ref), src
        assert model.lm_head.weight is model.transformer.wte.weight
        # .bin shards are converted once to safetensors in the offload folder; safetensors are not
        assert (_listing(off) == ["offload-00000.safetensors", "offload-00001.safetensors"]) == (src == "bin"), src


@pytest.mark.parametrize("name", ["cpu", "disk", "mixed"])
def test_gpt2_generate_and_ties(tmp_path, name):
    quiet_transformers()
    from transformers import GPT2LMHeadModel

    torch.manual_seed(2)
    ref_model = GPT2LMHeadModel(gpt2_config()).eval()
    ids = torch.tensor([[3, 5, 7, 9]])
    ref_tokens, ref_logits = greedy(ref_model, ids), ref_model(ids).logits
    ref_model.save_pretrained(tmp_path / "ckpt")
    device_map = {
        "mixed": {
            "transformer.wte": "disk",
            "transformer.wpe": "cpu",
            "transformer.h.0": "disk",
            "transformer.h.1": "cpu",
            "transformer.h.2": "disk",
            "transformer.ln_f": "cpu",
            "lm_head": "disk",
        }
    }.get(name, {"": name})
    with init_empty_weights():
        model = GPT2LMHeadModel(gpt2_config()).eval()
    model = load_checkpoint_and_dispatch(
        model, tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "off"
    )
    assert torch.equal(model(ids).logits, ref_logits)
    assert torch.equal(greedy(model, ids), ref_tokens)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert storages(model.lm_head.weight, model.transformer.wte.weight) == 1
    assert _listing(tmp_path / "off") == []


def test_llama_generate_from_auto_map(tmp_path):
    quiet_transformers()
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    ref_model = LlamaForCausalLM(llama_config()).eval()
    ids = torch.tensor([[4, 8, 15, 16]])
    ref_tokens, ref_logits = greedy(ref_model, ids), ref_model(ids).logits
    ref_model.save_pretrained(tmp_path / "ckpt")
    with init_empty_weights():
        model = LlamaForCausalLM(llama_config()).eval()
    # non-persistent rotary buffers stay real: no checkpoint holds them
    assert not model.model.rotary_emb.inv_freq.is_meta and model.model.layers[0].mlp.up_proj.weight.is_meta
    model = load_checkpoint_and_dispatch(
        model, tmp_path / "ckpt", device_map="auto", max_memory={"cpu": "40KB"}, offload_folder=tmp_path / "off"
    )
    assert set(map(str, model.hf_device_map.values())) == {"cpu", "disk"}
    assert torch.equal(model(ids).logits, ref_logits)
    assert torch.equal(greedy(model, ids), ref_tokens)


def test_materialize_restores_ties():
    quiet_transformers()
    from transformers import GPT2LMHeadModel

    with init_empty_weights():
        model = GPT2LMHeadModel(gpt2_config())
    model.to_empty(device="cpu")  # torch alone breaks the tie here
    assert model.lm_head.weight is not model.transformer.wte.weight
    with init_empty_weights():
        model = GPT2LMHeadModel(gpt2_config())
    materialize(model, "cpu")
    assert model.lm_head.weight is model.transformer.wte.weight and not model.lm_head.weight.is_meta


def test_accelerator_exposes_big_model_inference(tmp_path):
    from trainforge.trainer.accelerator.accelerator import Accelerator

    ref_model = _trained_plain()
    ref = ref_model(X)
    save_file(ref_model.state_dict(), str(tmp_path / "model.safetensors"))
    with Accelerator.init_empty_weights():
        model = plain()
    dm = Accelerator.infer_auto_device_map(model, max_memory={"cpu": 10_000})
    model = Accelerator.load_checkpoint_and_dispatch(model, tmp_path / "model.safetensors", device_map=dm)
    assert set(dm.values()) == {"cpu", "disk"} and torch.equal(model(X), ref)
