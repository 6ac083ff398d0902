"""precision="fp8" says how many nn.Linear layers it converts to float8 and refuses a model where that is none
(it would train in bf16 while its user believes they measured fp8); a pipeline stage may hold none."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.precision import Precision


@pytest.fixture
def fp8() -> Precision:
    pytest.importorskip("torchao.float8")
    with warnings.catch_warnings():
        # "fp8 on CPU is slow": said, and beside the point here
        warnings.simplefilter("ignore")
        return Precision("fp8", torch.device("cpu"))


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 3), nn.Linear(3, 1)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.tail, self.lm_head = nn.Linear(32, 16), nn.Linear(16, 3), nn.Linear(16, 32)


def test_a_model_with_no_linear_layer_that_qualifies_is_refused_naming_its_layers(fp8):
    with pytest.raises(ConfigurationError, match=r"no layer of Odd .*2 nn.Linear layer\(s\) qualifies: a \(5->3\), b"):
        fp8.convert_module(Odd())
    with pytest.raises(ConfigurationError, match=r"no layer of Sequential .*it has no nn.Linear layer.*bf16-mixed"):
        fp8.convert_module(nn.Sequential(nn.Conv1d(2, 2, 3), nn.ReLU()))


def test_the_layers_converted_are_counted_and_the_others_named(fp8, caplog):
    with caplog.at_level(logging.INFO, logger="trainforge"):
        model = fp8.convert_module(Mixed())
    assert type(model.body).__name__ == "Float8Linear"
    assert isinstance(model.tail, nn.Linear) and type(model.tail) is nn.Linear and type(model.lm_head) is nn.Linear
    assert "converts 1 of the 3 nn.Linear layer(s) of Mixed to float8; in bf16: tail (16->3), lm_head" in caplog.text


def test_a_pipeline_stage_without_such_layers_is_not_refused(fp8, caplog):
    with caplog.at_level(logging.INFO, logger="trainforge"):
        fp8.convert_module(Odd(), whole_model=False)
    assert "converts 0 of the 2 nn.Linear layer(s) of Odd" in caplog.text
