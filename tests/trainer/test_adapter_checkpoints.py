"""Adapter-only checkpoints (trainer/checkpoint/adapters.py, strategies/checkpoint/frozen.py) of a LoRA tiny Llama
(transformers + peft, ~107K parameters, 1.8K trainable).

The 2-rank runs happen once per module (``runs``: tests/scripts/adapter_run.py under DDP and FSDP2);
each test checks one property of what they wrote. The bad-input tests train one process in this one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.helpers import forklaunch, procs
from trainforge import Accelerator, Trainer
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies.checkpoint.dcp_safe import load_metadata
from trainforge.strategies.checkpoint.io import load_object, load_tensors, read_metadata
from trainforge.strategies.errors import CheckpointError, ConfigurationError

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from adapter_common import LitLora, loader, lora_model, tiny_base, tokens  # noqa: E402

STRATEGIES = ("ddp", "fsdp", "fsdp_full")  # FSDP2 with sharded (dcp/) and full state dicts


@pytest.fixture(scope="module", autouse=True)
def needs_peft():
    """Imported here (and by adapter_common where a model is built), not at the top: collection would
    import peft and transformers in every worker."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    forklaunch.launch(SCRIPTS / "adapter_run.py", out, timeout=240, env=procs.test_env(PYTHONWARNINGS="ignore"))
    return out, json.loads((out / "results.json").read_text())


def _lora_names() -> list:
    return [n for n, p in LitLora(lora_model()).named_parameters() if p.requires_grad]


def _size(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


# ---- 2 ranks --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ddp_checkpoint_holds_only_the_adapter_and_names_the_base(runs):
    out, _ = runs
    adapter, full = out / "ddp" / "adapter_ckpt" / "epoch=0-step=4", out / "ddp" / "full_ckpt" / "epoch=0-step=4"
    lora = _lora_names()
    assert sorted(load_tensors(adapter, "model")) == sorted(lora) and len(lora) == 8
    assert read_metadata(adapter)["trainable_only"] is True and read_metadata(full)["trainable_only"] is False
    record = load_object(adapter, "frozen_base")
    base = [n for n, p in LitLora(lora_model()).named_parameters() if not p.requires_grad]
    assert list(record["frozen"]) == base and record["trainable"] == lora and record["adapter"] == "PEFT"
    assert list(record["checksums"]) == base and not (adapter / "model.safetensors.index.json").exists()
    small, big = _size(adapter, "model.safetensors"), _size(full, "model.safetensors")
    assert small < big / 40, (small, big)  # 8,288 vs 438,176 bytes: 1.8K of 108.6K parameters
    optimizer = load_object(adapter, "optimizers")[0]
    assert len(optimizer["state"]) == 8  # AdamW over all parameters keeps state for the trained ones only


@pytest.mark.slow
def test_fsdp_sharded_checkpoint_holds_only_the_adapter(runs):
    out, _ = runs
    adapter, full = out / "fsdp" / "adapter_ckpt" / "epoch=0-step=4", out / "fsdp" / "full_ckpt" / "epoch=0-step=4"
    keys = load_metadata(adapter / "dcp" / ".metadata").state_dict_metadata
    assert sorted(k[len("model.") :] for k in keys if k.startswith("model.")) == sorted(_lora_names())
    assert (adapter / "frozen_base.pt").is_file() and not (full / "frozen_base.pt").exists()
    assert _size(adapter / "dcp", "*.distcp") < _size(full / "dcp", "*.distcp") / 4
    consolidated = out / "fsdp_full" / "adapter_ckpt" / "epoch=0-step=4"  # state_dict_type="full": rank 0's file
    assert sorted(load_tensors(consolidated, "model")) == sorted(_lora_names())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trainer_resume_is_bit_identical(runs, strategy):
    out, results = runs
    losses = results[strategy]["trainer"]
    assert losses["resumed_losses"] == losses["losses"][4:]
    saved = load_file(str(out / strategy / "trainer.safetensors"))
    whole = {k[len("whole/") :]: v for k, v in saved.items() if k.startswith("whole/")}
    assert len(whole) == 8
    for k, v in whole.items():
        assert torch.equal(v, saved[f"resumed/{k}"]), k
    first = load_tensors(out / strategy / "adapter_ckpt" / "epoch=0-step=4", "model") if strategy == "ddp" else None
    if first is not None:  # the adapter moved between the checkpoint and the end: resume did continue it
        assert not all(torch.equal(first[k], whole[k]) for k in whole)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accelerator_save_state_resumes_exactly(runs, strategy):
    out, results = runs
    acc = results[strategy]["accelerator"]
    assert acc["resumed"] == acc["after"]
    saved = load_file(str(out / strategy / "accelerator.safetensors"))
    whole = [k for k in saved if k.startswith("whole/")]
    assert len(whole) == 8 and all(torch.equal(saved[k], saved["resumed/" + k[6:]]) for k in whole)
    assert read_metadata(out / strategy / "acc_state")["trainable_only"] is True


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_save_model_writes_peft_format_loadable_by_peft(runs, strategy):
    from peft import PeftModel

    folder = out_folder = runs[0] / strategy / "peft"
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    config = json.loads((out_folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert all("lora_" in k and ".default." not in k for k in load_file(str(folder / "adapter_model.safetensors")))
    model = PeftModel.from_pretrained(tiny_base(0), str(folder)).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens(4)).logits
    torch.testing.assert_close(logits, load_file(str(runs[0] / strategy / "logits.safetensors"))["logits"])


# ---- one process: defaults and bad input ------------------------------------------------------------
def _fit(root: Path, net: nn.Module, steps: int = 2, ckpt_path=None, **checkpoint) -> Trainer:
    trainer = Trainer(
        max_steps=steps,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_steps=steps, **checkpoint)],
    )
    trainer.fit(LitLora(net), loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    _fit(root, lora_model())
    return root / "ckpt" / "epoch=0-step=2"


def test_resume_onto_other_base_weights_is_refused_by_name(lora_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match=r"checksum of frozen parameter.*embed_tokens.*same pretrained weights"):
        _fit(tmp_path, lora_model(seed=1), steps=4, ckpt_path=str(lora_ckpt))


def test_resume_onto_base_of_other_shape_is_refused_by_name(lora_ckpt, tmp_path):
    with pytest.raises(
        CheckpointError, match=r"different shape or dtype: .*mlp\.gate_proj\.weight.*\(128, 64\).*\(96, 64\)"
    ):
        _fit(tmp_path, lora_model(intermediate_size=96), steps=4, ckpt_path=str(lora_ckpt))


def test_adapter_checkpoint_into_model_without_adapter_names_the_fix(lora_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match=r"has no parameter .*lora_A.*peft\.get_peft_model\(base"):
        _fit(tmp_path, tiny_base(0), steps=4, ckpt_path=str(lora_ckpt))
    acc = Accelerator()
    net = tiny_base(0)
    acc.prepare(net, torch.optim.AdamW(net.parameters()))
    with pytest.raises(CheckpointError, match="has no parameter"):
        acc.load_state(str(lora_ckpt))


def test_load_from_checkpoint_builds_the_module_onto_its_own_base(lora_ckpt):
    trained = load_tensors(lora_ckpt, "model")
    module = LitLora.load_from_checkpoint(str(lora_ckpt), net=lora_model())  # net is no plain data: passed
    state = module.state_dict()
    assert all(torch.equal(state[k], v) for k, v in trained.items()) and len(trained) == 8
    with pytest.raises(CheckpointError, match="checksum of frozen parameter"):
        LitLora.load_from_checkpoint(str(lora_ckpt), net=lora_model(seed=1))


def test_asynchronous_adapter_checkpoint_resumes(tmp_path):
    _fit(tmp_path, lora_model(), async_save=True)
    path = tmp_path / "ckpt" / "epoch=0-step=2"
    assert sorted(load_tensors(path, "model")) == sorted(_lora_names()) and (path / "frozen_base.pt").is_file()
    assert _fit(tmp_path / "resumed", lora_model(), steps=4, ckpt_path=str(path)).global_step == 4


def test_frozen_layers_of_a_plain_model_are_kept_unless_asked(tmp_path):
    net = tiny_base(0)
    net.model.embed_tokens.weight.requires_grad_(False)
    _fit(tmp_path / "auto", net)
    auto = tmp_path / "auto" / "ckpt" / "epoch=0-step=2"
    assert not read_metadata(auto)["trainable_only"] and "net.model.embed_tokens.weight" in load_tensors(auto, "model")
    net = tiny_base(0)
    net.model.embed_tokens.weight.requires_grad_(False)
    _fit(tmp_path / "asked", net, trainable_only=True)
    asked = tmp_path / "asked" / "ckpt" / "epoch=0-step=2"
    assert read_metadata(asked)["trainable_only"] and "net.model.embed_tokens.weight" not in load_tensors(
        asked, "model"
    )
    net = tiny_base(0)
    net.model.embed_tokens.weight.requires_grad_(False)
    _fit(tmp_path / "asked", net, steps=4, ckpt_path=str(asked))  # resumes onto the same frozen embedding


def test_bad_arguments_name_the_value(tmp_path):
    with pytest.raises(ConfigurationError, match=r"trainable_only='yes' must be None"):
        ModelCheckpoint(trainable_only="yes")
    acc = Accelerator()
    model = acc.prepare(tiny_base(0))
    with pytest.raises(ConfigurationError, match=r"adapter_only=True: LlamaForCausalLM holds no peft\.PeftModel"):
        acc.save_model(model, str(tmp_path / "adapter"), adapter_only=True)
    with pytest.raises(ConfigurationError, match=r"adapter_only=1 must be None"):
        acc.save_model(model, str(tmp_path / "adapter"), adapter_only=1)


def test_strategies_that_write_the_whole_model_say_so(lora_ckpt):
    from trainforge.strategies.base import Strategy  # declares no trainable-only checkpoints, as DeepSpeed, XLA
    from trainforge.trainer.checkpoint.adapters import load_model_state, trainable_only_for

    model = lora_model()
    with pytest.raises(ConfigurationError, match=r"trainable_only=True: strategy 'base' writes the whole model"):
        trainable_only_for(Strategy(), model, True)
    assert trainable_only_for(Strategy(), model, None) is False  # the default falls back to the whole model
    with pytest.raises(CheckpointError, match=r"holds only the trainable parameters .* strategy 'base' cannot load"):
        load_model_state(Strategy(), lora_ckpt, read_metadata(lora_ckpt), LitLora(model), [])


def test_peft_is_not_imported_by_trainforge():
    code = (
        "import sys, trainforge, trainforge.trainer.checkpoint.contents, trainforge.strategies.fsdp; "
        "assert 'peft' not in sys.modules, 'peft imported'; print('lazy ok')"
    )
    assert "lazy ok" in procs.run([sys.executable, "-c", code], timeout=120).stdout
