"""Accelerator.save_state/load_state and consolidated weights (safetensors, transformers)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import make_net, regression_data
from trainforge import Accelerator, CheckpointError, seed_everything


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def train(acc, model, opt, sched, loader, counter, steps, start=0):
    for it, (x, y) in enumerate(loader, 1):
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        counter.n += 1
        if it == steps:
            break


def build(initial):
    acc = Accelerator(gradient_accumulation_steps=2)
    model = copy.deepcopy(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    loader = DataLoader(regression_data(), batch_size=4, shuffle=True, num_workers=2)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, loader, counter


def test_save_state_mid_epoch_then_load_state_continues_exactly(tmp_path):
    initial = make_net(dropout=0.2)
    seed_everything(0)  # both runs start from the same random state (dropout draws from it)
    acc, model, opt, sched, loader, counter = build(initial)
    train(acc, model, opt, sched, loader, counter, steps=16)  # the whole epoch, uninterrupted
    reference = copy.deepcopy(acc.unwrap_model(model).state_dict())

    seed_everything(0)
    acc, model, opt, sched, loader, counter = build(initial)
    train(acc, model, opt, sched, loader, counter, steps=6)
    acc.save_state(str(tmp_path / "state"))

    seed_everything(123)  # a fresh process would start elsewhere; load_state must restore it all
    acc, model, opt, sched, loader, counter = build(initial)
    acc.load_state(str(tmp_path / "state"))
    assert counter.n == 6
    train(acc, model, opt, sched, loader, counter, steps=10)
    for key, value in reference.items():
        assert torch.equal(acc.unwrap_model(model).state_dict()[key], value), key


def test_register_for_checkpointing_refuses_objects_without_state():
    with pytest.raises(Exception, match="has no state_dict"):
        Accelerator().register_for_checkpointing(object())


def test_save_model_loads_with_safetensors(tmp_path):
    acc = Accelerator()
    model = acc.prepare(make_net())
    path = acc.save_model(model, str(tmp_path / "weights"))
    loaded = load_file(path / "model.safetensors")
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_save_model_loads_with_transformers_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64)
    acc = Accelerator()
    model = acc.prepare(transformers.GPT2LMHeadModel(config))
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)  # not the init: a real change must survive the round trip
    path = acc.save_model(model, str(tmp_path / "gpt2"))
    again = transformers.GPT2LMHeadModel.from_pretrained(str(path))
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()  # tie kept


def test_load_state_of_a_corrupted_file_names_it(tmp_path):
    acc = Accelerator()
    acc.prepare(make_net())
    acc.save_state(str(tmp_path / "s"))
    target = tmp_path / "s" / "trainer_state.pt"
    target.write_bytes(target.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        acc.load_state(str(tmp_path / "s"))
