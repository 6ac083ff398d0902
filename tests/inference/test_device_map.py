"""infer_auto_device_map: fill order, no-split classes, buffers, tie groups, modes, budgets."""

import pytest
import torch

from tests.inference.common import gpt2_config, plain, quiet_transformers
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.inference import compute_module_sizes, infer_auto_device_map, init_empty_weights
from trainforge.trainer.inference.device_map import _balanced, get_max_memory

BLOCK = (32 * 32 + 32) * 4 + 4 * 32 * 4 + 8  # Linear + BatchNorm (weight, bias, running mean/var, count)


def _meta_plain():
    with init_empty_weights():
        return plain()


def test_sequential_fill_cpu_then_disk_counts_buffers():
    model = _meta_plain()
    sizes = compute_module_sizes(model)
    assert sizes["0"] == BLOCK  # buffers are counted
    dm = infer_auto_device_map(model, max_memory={"cpu": 2 * BLOCK + 10}, mode="sequential")
    assert dm == {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk", "4": "disk", "5": "disk", "6": "disk"}
    # room for a block and a Linear: block 1 is split, its Linear fits and its BatchNorm does not
    cap = BLOCK + (32 * 32 + 32) * 4 + 100
    dm = infer_auto_device_map(model, max_memory={"cpu": cap})
    assert dm["0"] == "cpu" and dm["1.0"] == "cpu" and dm["1.1"] == "disk"
    dm = infer_auto_device_map(model, max_memory={"cpu": cap}, no_split_module_classes=["Sequential"])
    assert dm["0"] == "cpu" and dm["1"] == "disk"  # not split when told
    assert infer_auto_device_map(model, max_memory={"cpu": "1GiB"}) == {"": "cpu"}


def test_dtype_halves_sizes():
    model = _meta_plain()
    assert compute_module_sizes(model, torch.float16)["0.0"] * 2 == compute_module_sizes(model)["0.0"]
    dm = infer_auto_device_map(model, max_memory={"cpu": 2 * BLOCK + 10}, dtype=torch.float16)
    assert list(dm.values()).count("cpu") >= 3


def test_hf_no_split_default_and_tie_group_placed_together():
    quiet_transformers()
    from transformers import GPT2LMHeadModel

    with init_empty_weights():
        model = GPT2LMHeadModel(gpt2_config())
    sizes = compute_module_sizes(model)
    # room for the embeddings and one block: wte's tie partner lm_head must come along to cpu
    cap = sizes["transformer.wte"] + sizes["transformer.wpe"] + sizes["transformer.h.0"] + 100
    dm = infer_auto_device_map(model, max_memory={"cpu": cap})
    assert dm["lm_head"] == dm["transformer.wte"] == "cpu"
    assert not any(k.startswith("transformer.h.1.") for k in dm)  # GPT2Block (_no_split_modules) is never split
    assert dm["transformer.h.1"] == "disk"


def test_modes_balance_gpus_and_equal_sequential_without_gpus():
    model = _meta_plain()
    budgets = {"cpu": 3 * BLOCK}
    assert (
        len(
            {
                str(infer_auto_device_map(model, budgets, mode=m))
                for m in ("auto", "balanced", "balanced_low_0", "sequential")
            }
        )
        == 1
    )
    got = _balanced(8000, 1000, {0: 10**6, 1: 10**6, 2: 10**6, "cpu": 10**9}, low_0=False)
    assert got[0] == got[1] == 8000 // 3 + 1000 and got[2] == 10**6
    got = _balanced(8000, 1000, {0: 10**6, 1: 10**6, 2: 10**6, "cpu": 10**9}, low_0=True)
    assert got[0] == 1000 and got[1] == 8000 // 2 + 1000


def test_cannot_fit_names_largest_unit_and_budgets():
    model = _meta_plain()
    with pytest.raises(ConfigurationError, match=r"largest module '0'.*budgets.*'cpu': 100.*'disk': 200"):
        infer_auto_device_map(model, max_memory={"cpu": 100, "disk": 200}, no_split_module_classes=["Sequential"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "fastest"}, r"mode='fastest' is not one of: auto, balanced, balanced_low_0, sequential"),
        ({"max_memory": {"cpu": "lots"}}, r"max_memory\['cpu'\]='lots' is not a size"),
        ({"max_memory": {"tpu": "1GiB"}}, r"max_memory key='tpu' is not one of"),
        ({"max_memory": {3: "1GiB"}}, r"there is no GPU 3"),
        ({"max_memory": "1GiB"}, r"max_memory='1GiB' is not a dict"),
        ({"no_split_module_classes": "Sequential"}, r"no_split_module_classes='Sequential' must be a list"),
        ({"dtype": "float16"}, r"dtype='float16' is not a torch.dtype"),
    ],
)
def test_bad_input(kwargs, match):
    if kwargs.get("max_memory") == {3: "1GiB"} and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a GPU 3")
    with pytest.raises(ConfigurationError, match=match):
        infer_auto_device_map(_meta_plain(), **kwargs)


def test_default_budgets_cover_cpu():
    assert get_max_memory()["cpu"] > 0
    assert list(get_max_memory({"disk": 10, "cpu": "1KiB"})) == ["cpu", "disk"]
