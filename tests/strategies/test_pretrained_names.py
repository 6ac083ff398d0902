"""``load_pretrained`` never loads less than asked without a word: a prefix that matches nothing is an error
with or without ``init_module(empty_init=True)``, tensors of the file the model has no use for are named in a
warning (as transformers does), and tensors a deferred load leaves to ``reset_parameters()`` are named too."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import trainforge
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.materialize import materialize
from trainforge.strategies.meta import init_empty_weights


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)


def write(tmp_path, tensors) -> str:
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    return path


def values(prefix: str = "") -> dict:
    return {prefix + k: torch.full_like(v, 0.5) for k, v in Net().state_dict().items()}


def empty_net() -> Net:
    # what init_module(empty_init=True) does: parameters on the meta device
    with init_empty_weights(include_buffers=False):
        return Net()


@pytest.mark.parametrize("empty", [False, True])
def test_a_prefix_matching_nothing_is_an_error_with_or_without_empty_init(tmp_path, empty):
    path = write(tmp_path, values("model."))
    net = empty_net() if empty else Net()
    with pytest.raises(
        ConfigurationError, match=r"4 tensor\(s\) of the model are not in .* under prefix 'encoder.': none of Net's"
    ):
        trainforge.load_pretrained(net, path, prefix="encoder.")
    with pytest.raises(ConfigurationError, match=r"prefix 'enc.': none of Linear's.*\['model.body.bias'"):
        trainforge.load_pretrained(net.body, path, prefix="enc.")
    # the right prefix loads
    trainforge.load_pretrained(net, path, prefix="model.")
    materialize(net, torch.device("cpu"))
    assert bool((net.head.weight == 0.5).all())


@pytest.mark.parametrize("empty", [False, True])
def test_tensors_of_the_file_the_model_does_not_use_are_named(tmp_path, empty):
    extra = {"encoder.extra.weight": torch.ones(8, 8), "pooler.bias": torch.ones(2)}
    path = write(tmp_path, {**values(), **extra})
    net = empty_net() if empty else Net()
    with pytest.warns(
        UserWarning, match=r"2 tensor\(s\) of .* were not used.*\['encoder.extra.weight', 'pooler.bias'\]"
    ):
        trainforge.load_pretrained(net, path)


def test_a_file_the_model_uses_whole_or_other_prefixes_are_not_warned_about(tmp_path):
    path = write(tmp_path, {**values("backbone."), "lm_head.weight": torch.ones(3, 4)})
    net = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # lm_head.weight is outside the prefix: it belongs to another part of a bigger model
        trainforge.load_pretrained(net, path, prefix="backbone.")


def test_tensors_a_deferred_load_leaves_to_reset_parameters_are_named(tmp_path):
    path = write(tmp_path, {k: v for k, v in values().items() if k.startswith("body.")})
    net = empty_net()
    trainforge.load_pretrained(net, path)
    with pytest.warns(UserWarning, match=r"2 tensor\(s\) are not in .*reset_parameters\(\) instead: \['head.bias'"):
        materialize(net, torch.device("cpu"))
    assert bool((net.body.weight == 0.5).all()) and not bool((net.head.weight == 0.5).all())
