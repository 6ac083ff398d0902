"""activation_checkpointing: one value grammar for every strategy (strategies/activation_memory.py).

Numbers: every mode gives bit-identical losses and gradients on CPU in fp32. Non-reentrant
``torch.utils.checkpoint`` recomputes a block with the same kernels on the same inputs and restores
the RNG state first (dropout draws the same mask), the op-level mode keeps some of those outputs
instead of recomputing them, and "offload" on the CPU leaves tensors where they are. Memory: the
bytes saved for backward drop for "full", "selective:2" and "op" (a property of the graph, not a
timing); "offload" moves nothing on a CPU run, so its bytes stay those of the mode off.
The 2-process runs (DDP and FSDP2 on gloo, exact resume) are tests/scripts/activation_memory_train.py.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import forklaunch
from trainforge import Trainer, TrainingModule
from trainforge.callbacks.base import Callback
from trainforge.strategies import DDPStrategy, SingleDeviceStrategy, resolve_strategy
from trainforge.strategies.activation_memory import (
    apply_activation_memory,
    measure_saved_bytes,
    parse_activation_checkpointing,
    select_blocks,
)
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.fsdp_wrap import clean_name

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
MODES = ("full", "selective:2", "op", "offload", {"mode": "op", "every": 2})


class Block(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)  # recomputation must draw the same mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.roll(-1, 1).flatten())


def _step(model: nn.Module, value, ids: torch.Tensor):
    model = copy.deepcopy(model)
    spec = parse_activation_checkpointing(value)
    names = select_blocks(model, spec)
    apply_activation_memory(model, spec, names)
    torch.manual_seed(7)
    with measure_saved_bytes() as saved:
        loss = model(ids)
    loss.backward()
    return loss.detach(), {clean_name(n): p.grad for n, p in model.named_parameters()}, saved, names


def test_every_mode_gives_bit_identical_loss_and_gradients_and_saves_less():
    torch.manual_seed(0)
    model, ids = GPT(), torch.randint(0, 32, (4, 8))
    loss, grads, off, _ = _step(model, None, ids)
    kept = {}
    for value in MODES:
        l2, g2, saved, names = _step(model, value, ids)
        kept[str(value)] = saved.device
        assert torch.equal(loss, l2), value
        assert g2.keys() == grads.keys() and all(torch.equal(grads[k], g2[k]) for k in grads), value
        if value == "offload":  # the CPU is host memory: nothing to move
            assert saved.device == off.device and saved.host == 0
        else:
            assert saved.device < off.device, (value, saved.device, off.device)
        if value == "selective:2":
            assert names == ["blocks.1", "blocks.3"]  # the 2nd and 4th (torchtitan's count)
    assert kept["full"] < kept["op"] < off.device  # op keeps the matmul outputs


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.matmul(self.lin.weight.t())
        y += self.lin.bias  # modifies a matmul output that "op" keeps: torch would recompute wrong gradients
        return torch.tanh(y)


def test_op_mode_refuses_an_in_place_change_of_a_kept_matmul_output():
    model = nn.Sequential(InPlace(), InPlace())
    spec = parse_activation_checkpointing("op")
    apply_activation_memory(model, spec, select_blocks(model, spec))
    with pytest.raises(ConfigurationError, match=r"'op': aten.add_.Tensor modifies in place.*y = y \+ b"):
        model(torch.randn(2, 8))
    spec = parse_activation_checkpointing("full")  # recomputes everything: in-place ops are fine
    model = nn.Sequential(InPlace(), InPlace())
    apply_activation_memory(model, spec, select_blocks(model, spec))
    model(torch.randn(2, 8)).sum().backward()


def test_state_dict_keys_are_those_of_the_plain_model():
    model = GPT()
    for value in MODES:
        wrapped = copy.deepcopy(model)
        spec = parse_activation_checkpointing(value)
        apply_activation_memory(wrapped, spec, select_blocks(wrapped, spec))
        assert list(wrapped.state_dict()) == list(model.state_dict())  # checkpoints load across modes


@pytest.mark.parametrize(
    "value, words",
    [
        ("fulll", ["'fulll'", "is not one of", "'full'", "'selective:<n>'", "'op'", "'offload'"]),
        ("selective", ["'selective'", "selective:2"]),
        ("selective:0", ["every=0", "int >= 1", "selective:2"]),
        ({"mode": "selective", "every": 0}, ["every=0", "int >= 1"]),
        ({"mode": "full", "every": True}, ["every=True"]),
        ("selective:x", ["'x'", "selective:2"]),
        ({"mode": "op", "blocks": [3]}, ["blocks=[3]", "module classes"]),
        ({"every": 2}, ["'mode'"]),
        (3, ["activation_checkpointing=3", "is not one of"]),
    ],
)
def test_bad_values_name_the_value_the_choices_and_the_fix(value, words):
    with pytest.raises(ConfigurationError) as err:
        resolve_strategy("single", activation_checkpointing=value)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_backward_compatible_values():
    for off in (None, False, "none"):
        assert not parse_activation_checkpointing(off).enabled
    assert parse_activation_checkpointing(True).mode == "full"
    spec = parse_activation_checkpointing({nn.Linear})
    assert spec.mode == "full" and spec.blocks == {nn.Linear}
    assert parse_activation_checkpointing("selective:op").mode == "op"
    assert parse_activation_checkpointing("selective:1").mode == "full"
    assert parse_activation_checkpointing({"mode": "selective", "every": 3}).every == 3


def test_modes_a_strategy_cannot_apply_are_refused_at_construction():
    from trainforge.strategies.megatron import MegatronStrategy
    from trainforge.strategies.xla import XLAStrategy

    with pytest.raises(ConfigurationError, match=r"'op'.*strategy='xla'.*torch_xla.utils.checkpoint"):
        XLAStrategy(activation_checkpointing="op")
    with pytest.raises(ConfigurationError, match=r"'offload'.*tensor_parallel_size=2.*DTensors.*'full'"):
        MegatronStrategy(tensor_parallel_size=2, activation_checkpointing="offload")
    MegatronStrategy(tensor_parallel_size=2, activation_checkpointing="op")  # fine
    from trainforge.strategies.deepspeed import DeepSpeedStrategy

    with pytest.raises(ConfigurationError, match=r"'op'.*ZeRO stage 3.*bias in place.*'full' or 'selective:<n>'"):
        DeepSpeedStrategy(stage=3, activation_checkpointing="op")
    DeepSpeedStrategy(stage=2, activation_checkpointing="op")  # fine


# ---- through the Trainer, one process --------------------------------------------------------------
class LitGPT(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = GPT()
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SaveAt(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(str(self.path))


def _fit(root: Path, strategy, ckpt_path=None, callbacks=()):
    module = LitGPT()
    ids = torch.randint(0, 32, (32, 8), generator=torch.Generator().manual_seed(1))
    trainer = Trainer(
        strategy=strategy,
        max_steps=4,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
        seed=0,
        callbacks=list(callbacks),
    )
    trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=4), ckpt_path=ckpt_path)
    return trainer, module


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_trainer_single_device_mode_matches_off_and_resumes_exactly(tmp_path):
    """ "op" (the mode with the most machinery); every mode, and DDP/FSDP2, in the 2-process test below."""
    _, off = _fit(tmp_path / "off", SingleDeviceStrategy())
    saver = SaveAt(2, tmp_path / "ckpt")
    trainer, module = _fit(tmp_path / "run", SingleDeviceStrategy(activation_checkpointing="op"), callbacks=[saver])
    assert module.losses == off.losses and _same(module, off)
    assert trainer.strategy.checkpointed_modules == [f"net.blocks.{i}" for i in range(4)]
    # a fresh fit resumed from step 2 finishes as the uninterrupted one
    _, resumed = _fit(tmp_path / "resumed", SingleDeviceStrategy(activation_checkpointing="op"), saver.path)
    assert resumed.losses == off.losses[2:] and _same(resumed, off)


def test_too_large_an_interval_is_refused_before_the_first_step(tmp_path):
    environ = dict(os.environ)
    try:
        with pytest.raises(ConfigurationError, match=r"every=8 but LitGPT has 4 block\(s\).*every <= 4"):
            _fit(tmp_path, DDPStrategy(activation_checkpointing="selective:8"))
    finally:  # DDPStrategy started a 1-process group here (and set RANK, MASTER_PORT...): later tests must not find them
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def test_a_model_without_blocks_is_refused_with_the_fix(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))  # not one class: no repeated blocks
    spec = parse_activation_checkpointing("full")
    with pytest.raises(ConfigurationError, match=r"finds no block in Sequential.*'blocks': \{MyBlock\}"):
        select_blocks(model, spec)
    spec = parse_activation_checkpointing({"mode": "full", "blocks": {nn.Linear}})
    assert select_blocks(model, spec) == ["0", "2"]


# ---- 2 gloo processes: DDP and FSDP2 --------------------------------------------------------------
@pytest.mark.slow
def test_every_strategy_on_two_processes_matches_off_and_resumes_exactly(tmp_path):
    output = forklaunch.launch(SCRIPTS / "activation_memory_train.py", tmp_path, nproc=2, timeout=300).stdout
    assert "rank 0 ok" in output and "rank 1 ok" in output, output[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for kind in ("ddp", "fsdp"):
        off = results[f"{kind}/None"]["losses"]
        for mode in ("full", "selective:2", "op", "offload"):
            r = results[f"{kind}/{mode}"]
            assert r["losses"] == off and r["same_weights"] and r["checkpointed"], (kind, mode)
        assert sorted(results[f"{kind}/selective:2"]["checkpointed"]) == ["net.blocks.1"]  # of 3 blocks
        resume = results[f"{kind}/resume"]
        assert resume["losses"] == resume["whole_losses"] and resume["same_weights"], kind
    for name in (
        "deepspeed3/full",
        "deepspeed3/selective:2",
        "deepspeed2/op",
        "megatron_tp2/selective:2",
        "megatron_tp2/op",
    ):
        assert results[name]["losses"] == results[name]["reference"], name
    for mode in ("selective:2", "op"):
        stages = [results[f"megatron_pp2/{mode}/rank{r}"] for r in (0, 1)]
        assert all(s["losses"] == s["reference"] for s in stages), mode
    assert [results[f"megatron_pp2/selective:2/rank{r}"]["checkpointed"] for r in (0, 1)] == [
        ["net.blocks.1"],
        ["net.blocks.3"],
    ]  # the model's 2nd and 4th blocks, one on each stage


def test_a_second_setup_leaves_the_wrapped_model_alone():
    strategy = SingleDeviceStrategy("cpu", activation_checkpointing={"mode": "full", "every": 2, "blocks": {Block}})
    model = strategy.setup_module(GPT())
    again = strategy.setup_module(model)  # e.g. Trainer.validate after fit
    assert again is model and strategy.checkpointed_modules == ["blocks.1", "blocks.3"]
    assert [type(b).__name__ for b in model.blocks] == ["Block", "CheckpointWrapper"] * 2


# ---- the launch config (trainforge config / launch --activation-checkpointing): every strategy ------------
def test_launch_config_passes_the_value_to_every_strategy(tmp_path, monkeypatch):
    from trainforge import Accelerator
    from trainforge.trainer.cli.launch_settings import LAUNCH_CONFIG_ENV, load_config, strategy_kwargs

    config = tmp_path / "launch.yaml"
    config.write_text("strategy: auto\nactivation_checkpointing: selective:2\n")
    assert load_config(config)["activation_checkpointing"] == "selective:2"
    defaults = {"activation_checkpointing": "selective:2", "megatron": {"activation_checkpointing": "op"}}
    assert strategy_kwargs("ddp", defaults) == {"activation_checkpointing": "selective:2"}
    assert strategy_kwargs("megatron", defaults) == {"activation_checkpointing": "op"}  # its section wins
    monkeypatch.setenv(LAUNCH_CONFIG_ENV, str(config))
    assert Accelerator(cpu=True).strategy.activation_memory.mode == "selective"
    config.write_text("activation_checkpointing: selective:0\n")
    with pytest.raises(ConfigurationError, match=r"activation_checkpointing \(in .*launch.yaml\).*every=0"):
        load_config(config)
