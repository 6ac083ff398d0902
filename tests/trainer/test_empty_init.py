"""Models built without memory (Trainer/Accelerator.init_module(empty_init=True)) and pretrained weights
read slice by slice (trainforge.load_pretrained): strategies/materialize.py, strategies/checkpoint/pretrained.py.

The reference is what users do today: build the model whole and load_state_dict the file. Built on the
meta device and loaded by load_pretrained, training gives the same losses and weights bit for bit, under
FSDP2 and tensor parallelism (each rank reads and allocates only its shards) and DDP on 2 gloo ranks,
and on one process."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from tests.helpers import forklaunch, procs
from trainforge import Accelerator, CheckpointError, ConfigurationError, load_pretrained
from trainforge.strategies import FSDPStrategy, SingleDeviceStrategy
from trainforge.strategies.materialize import init_module_context

SCRIPT = procs.REPO / "tests" / "scripts" / "empty_init_run.py"
sys.path.insert(0, str(SCRIPT.parent))
from empty_init_run import CONFIG  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def transformers():
    """Imported here, not at the top: collection would import transformers in every worker."""
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, transformers):
    path = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(path)
    return path, model


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "tp", "deepspeed"])
def test_two_ranks_built_empty_train_like_the_model_built_whole(tmp_path, pretrained, strategy):
    """FSDP2 and TP materialise each rank's shards; DDP and DeepSpeed (ZeRO-2 here) the whole model."""
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    env = procs.test_env(DS_ACCELERATOR="cpu")
    for mode in ("eager", "empty"):
        forklaunch.launch(SCRIPT, tmp_path, pretrained[0], strategy, mode, env=env, timeout=300)
    for rank in (0, 1):
        eager, empty = (
            json.loads((tmp_path / f"{strategy}-{m}.rank{rank}.json").read_text()) for m in ("eager", "empty")
        )
        assert eager["losses"] == empty["losses"] and len(set(eager["losses"])) > 1
        assert eager["checksum"] == empty["checksum"]  # the final weights (rank 0 gathers them)
        # lm_head still is the embedding after FSDP/DDP; tensor parallelism shards the two differently in
        # both paths (loaded from the embedding's values: the file holds only that name)
        assert empty["tied"] is eager["tied"] is (strategy != "tp")


def _accelerator_model(pretrained_dir, empty: bool):
    import transformers

    acc = Accelerator()
    with acc.init_module(empty_init=empty):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    return acc, model


def test_one_process_loads_the_file_into_the_model_it_materialises(pretrained):
    path, reference = pretrained
    acc, model = _accelerator_model(path, empty=True)
    assert all(p.is_meta for p in model.parameters())
    assert not model.model.rotary_emb.inv_freq.is_meta  # computed buffers stay real
    load_pretrained(model, path)  # deferred: recorded until prepare
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built on the meta parameters (Accelerate's order)
    model, opt = acc.prepare(model, opt)
    tokens = torch.randint(0, 128, (2, 8))
    assert torch.equal(model(tokens).logits, reference(tokens).logits)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}


def test_without_weights_each_layer_initialises_itself_and_trains():
    acc = Accelerator()
    with acc.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    model = acc.prepare(model)
    assert all(not p.is_meta and torch.isfinite(p).all() for p in model.parameters())
    assert model[1].weight.eq(1).all() and model[0].weight.abs().max() <= 0.5  # LayerNorm ones, kaiming bound 1/2


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))  # no reset_parameters(): nothing can initialise it

    def forward(self, x):
        return x * self.gain


def test_a_parameter_nothing_can_initialise_is_named_before_training():
    acc = Accelerator()
    with acc.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ConfigurationError, match=r"1 parameter\(s\) .* without reset_parameters\(\): \['1.gain'\]"):
        acc.prepare(model)


def test_bad_pretrained_sources_are_refused_with_the_path(tmp_path, pretrained, transformers):
    path, _ = pretrained
    model = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"pretrained weights .*nowhere: no such file or directory"):
        load_pretrained(model, tmp_path / "nowhere")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"w.bin: not a .safetensors file"):
        load_pretrained(model, tmp_path / "w.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"holds neither model.safetensors nor model.safetensors.index.json"):
        load_pretrained(model, tmp_path / "empty")
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with pytest.raises(ConfigurationError, match=r"tensor\(s\) of the model are not in .* under prefix 'base.'"):
        load_pretrained(eager, path, prefix="base.")
    with pytest.raises(ConfigurationError, match=r"prefix=3\) must be a string"):
        load_pretrained(eager, path, prefix=3)


def test_a_mis_shaped_pretrained_tensor_names_both_shapes_at_setup(pretrained, transformers):
    path, _ = pretrained
    acc = Accelerator()
    with acc.init_module(empty_init=True):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, "intermediate_size": 48}))
    load_pretrained(model, path)
    with pytest.raises(
        CheckpointError, match=r"mlp.gate_proj.weight has shape \[64, 32\] in the file, .* has \[48, 32\]"
    ):
        acc.prepare(model)


def test_init_module_arguments():
    with pytest.raises(ConfigurationError, match=r"init_module\(empty_init='yes'\) must be None, True or False"):
        init_module_context(SingleDeviceStrategy(), "yes")
    with init_module_context(SingleDeviceStrategy(), None):  # the single device builds eagerly by default
        assert not nn.Linear(2, 2).weight.is_meta
    with init_module_context(FSDPStrategy(), None):  # FSDP: on the meta device, materialised shard by shard
        assert nn.Linear(2, 2).weight.is_meta


def test_code_that_reads_meta_values_inside_init_module_gets_the_reason_and_the_fix():
    acc = Accelerator()
    meta_read = r"read the values of a tensor on the meta device .*reset_parameters"
    with pytest.raises(ConfigurationError, match=meta_read), acc.init_module(empty_init=True):
        layer = nn.Linear(2, 2)
        # e.g. a user's init that normalises by a statistic of the weights
        layer.weight.sum().item()
    # other errors pass through as they are
    with pytest.raises(ValueError, match="unrelated"), acc.init_module(empty_init=True):
        raise ValueError("unrelated")


def test_from_pretrained_inside_init_module_reads_its_files_instead_of_training_random_weights(
    pretrained, tmp_path, transformers
):
    """Lightning users write this; the weights land on the meta device like any new parameter. A local
    origin is read back at setup (the same logits as the file); a hub name that is not a local directory
    stops the setup with the fix, where re-initialising would silently train from random weights."""
    path, reference = pretrained
    acc = Accelerator()
    with acc.init_module(empty_init=True):
        model = transformers.LlamaForCausalLM.from_pretrained(path)
    assert all(p.is_meta for p in model.parameters())
    model = acc.prepare(model)
    tokens = torch.randint(0, 128, (2, 8))
    assert torch.equal(model(tokens).logits, reference(tokens).logits)
    with acc.init_module(empty_init=True):
        moved = transformers.LlamaForCausalLM.from_pretrained(path)
    moved.config._name_or_path = "org/some-hub-model"  # what a hub download records
    with pytest.raises(
        ConfigurationError, match=r"from_pretrained\('org/some-hub-model'\) inside init_module.*from_config"
    ):
        acc.prepare(moved)
