"""The frozen base of a trainable-only checkpoint (strategies/checkpoint/frozen.py) is checked by a checksum of
every frozen tensor: a base that differs in any one of them is refused by name; the checksum of a sharded DTensor
is the plain tensor's whatever the layout (2 real gloo processes), and a record that is not one is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import forklaunch
from trainforge.strategies.checkpoint.frozen import base_record, check_base
from trainforge.strategies.errors import CheckpointError


def frozen_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)], nn.Linear(4, 1))
    for p in model[:6].parameters():
        p.requires_grad_(False)
    return model


def test_every_frozen_tensor_is_checked():
    record = base_record(frozen_model())
    assert sorted(record["checksums"]) == sorted(record["frozen"]) and len(record["frozen"]) == 12
    for name in record["frozen"]:
        model = frozen_model()
        with torch.no_grad():
            model.get_parameter(name).view(-1)[-1] += 1.0
        with pytest.raises(CheckpointError, match=rf"checksum of frozen parameter\(s\) '{name}' differs"):
            check_base("ckpt", record, model)
    check_base("ckpt", record, frozen_model())


def test_a_frozen_tensor_written_in_place_after_a_save_is_hashed_again():
    model = frozen_model()
    first = base_record(model)
    with torch.no_grad():
        model[2].weight[1, 1] += 5.0
    assert base_record(model)["checksums"]["2.weight"] != first["checksums"]["2.weight"]
    with pytest.raises(CheckpointError, match="'2.weight' differs"):
        check_base("ckpt", first, model)


@pytest.mark.parametrize(
    "checksums", [[1, 2], {"0.weight": "crc"}, {"no.such.tensor": 5}], ids=["list", "not-int", "unknown-name"]
)
def test_a_damaged_record_is_refused(checksums):
    record = {**base_record(frozen_model()), "checksums": checksums}
    with pytest.raises(CheckpointError, match=r"ckpt: frozen_base.pt holds no valid checksums .* damaged"):
        check_base("ckpt", record, frozen_model())


@pytest.mark.slow
def test_a_sharded_tensor_has_the_plain_tensors_checksum_whatever_the_layout():
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "tests" / "scripts" / "frozen_dtensor.py"
    out = forklaunch.launch(script, nproc=2, timeout=180).stdout
    assert out.count("same") == 6, out
