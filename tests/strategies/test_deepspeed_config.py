"""The generated DeepSpeed config, user overrides, "auto" values and conflicts (no deepspeed import)."""

import json

import pytest
from torch import nn

from trainforge.strategies.base import RunSettings
from trainforge.strategies.deepspeed import DeepSpeedStrategy
from trainforge.strategies.deepspeed_config import (
    QUIET_STEPS,
    TrainingSettings,
    ZeroSettings,
    explicit_settings,
    generate_config,
    load_user_config,
    merge_config,
)
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.precision import Precision

SETTINGS = TrainingSettings(
    micro_batch_size=8, accumulation_steps=4, world_size=2, gradient_clip_val=1.0, precision="bf16-mixed"
)
ZERO = ZeroSettings(stage=3, offload_optimizer_device="cpu", offload_param_device="nvme", nvme_path="/scratch")


def test_generated_config_for_trainer_settings():
    assert generate_config(SETTINGS, ZERO) == {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "train_batch_size": 64,  # 8 per rank x 4 accumulation x 2 ranks
        "gradient_clipping": 1.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "nvme", "pin_memory": True, "nvme_path": "/scratch"},
        },
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": QUIET_STEPS,
        "wall_clock_breakdown": False,
    }


def test_reduce_bucket_is_capped_at_the_model_size():
    assert generate_config(SETTINGS, ZERO, param_count=1000)["zero_optimization"]["reduce_bucket_size"] == 1000
    assert generate_config(SETTINGS, ZERO, param_count=10**10)["zero_optimization"]["reduce_bucket_size"] == 5 * 10**8
    assert "reduce_bucket_size" not in generate_config(SETTINGS, ZeroSettings(stage=0), 1000)["zero_optimization"]


def test_fp32_and_fp16_sections_and_no_clipping():
    fp32 = generate_config(TrainingSettings(), ZeroSettings(stage=1))
    assert (fp32["fp16"], fp32["bf16"], fp32["gradient_clipping"]) == ({"enabled": False}, {"enabled": False}, 0.0)
    assert fp32["zero_optimization"] == {"stage": 1} and fp32["train_batch_size"] == 1
    fp16 = generate_config(TrainingSettings(precision="16-mixed"), ZeroSettings())["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0  # dynamic loss scaling
    with pytest.raises(ConfigurationError, match="precision.*'fp8'.*bf16-mixed"):
        generate_config(TrainingSettings(precision="fp8"), ZeroSettings())


def _merge(user, settings=SETTINGS, zero=ZERO, given=(), hidden=None):
    return merge_config(generate_config(settings, zero), user, explicit_settings(settings, zero, given), hidden)


def test_auto_values_are_filled_from_the_trainer_settings():
    user = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": "auto",
            "overlap_comm": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
        },
    }
    merged = _merge(user, hidden=64)
    assert (merged["train_batch_size"], merged["train_micro_batch_size_per_gpu"]) == (64, 8)
    assert (merged["gradient_accumulation_steps"], merged["gradient_clipping"]) == (4, 1.0)
    assert merged["bf16"] == {"enabled": True} and merged["fp16"] == {"enabled": False}
    zero = merged["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is True  # a key trainforge does not set is kept
    assert zero["reduce_bucket_size"] == 64 * 64 and zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["offload_optimizer"]["device"] == "cpu"  # generated keys the user did not mention stay
    assert "reduce_bucket_size" not in _merge(user)["zero_optimization"]  # hidden size unknown: DeepSpeed default


@pytest.mark.parametrize(
    "user, words",
    [
        ({"gradient_accumulation_steps": 8}, ["gradient_accumulation_steps=8", "accumulate_grad_batches", "=4"]),
        ({"train_micro_batch_size_per_gpu": 16}, ["train_micro_batch_size_per_gpu=16", "batch_size=8", "DataLoader"]),
        ({"train_batch_size": 32}, ["train_batch_size=32", "8 x 4 x 2", "=64"]),
        ({"gradient_clipping": 0.5}, ["gradient_clipping=0.5", "gradient_clip_val=1.0"]),
        ({"fp16": {"enabled": True}}, ["fp16.enabled=True", "precision='bf16-mixed'", "fp16.enabled=False"]),
    ],
)
def test_conflicting_user_value_names_both_values_and_the_fix(user, words):
    with pytest.raises(ConfigurationError) as e:
        _merge(user)
    for word in words:
        assert word in str(e.value)
    assert "auto" in str(e.value)  # the fix


def test_user_overrides_defaults_but_not_explicit_strategy_arguments():
    assert _merge({"zero_optimization": {"stage": 2}})["zero_optimization"]["stage"] == 2  # stage was a default
    with pytest.raises(ConfigurationError, match=r"zero_optimization.stage=2.*DeepSpeedStrategy\(stage=...\)=3"):
        _merge({"zero_optimization": {"stage": 2}}, given=("stage",))
    same = _merge({"gradient_accumulation_steps": 4.0, "zero_optimization": {}})  # equal values are no conflict
    assert same["gradient_accumulation_steps"] == 4.0 and same["zero_optimization"]["stage"] == 3
    no_clip = TrainingSettings(micro_batch_size=8, world_size=2)  # gradient_clip_val unset: the config decides
    assert _merge({"gradient_clipping": 2.0}, settings=no_clip)["gradient_clipping"] == 2.0


@pytest.mark.parametrize(
    "user, match",
    [
        ({"optimizer": {"type": "Adam"}}, "'optimizer' section.*configure_optimizers"),
        ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' section"),
        ({"zero_optimization": {"sub_group_size": "auto"}}, 'sub_group_size="auto".*cannot fill'),
        ({"checkpoint": {"load_universal": True}}, "weights_only=False"),
    ],
)
def test_unsupported_user_keys(user, match):
    with pytest.raises(ConfigurationError, match=match):
        _merge(user)


def test_user_config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1}}))
    assert load_user_config(path) == {"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1}}
    assert load_user_config(str(path))["zero_optimization"]["stage"] == 1
    path.write_text("{not json")
    with pytest.raises(ConfigurationError, match="ds.json.*not valid JSON"):
        load_user_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match="holds a list"):
        load_user_config(path)
    original = {"zero_optimization": {"stage": 1}}
    load_user_config(original)["zero_optimization"]["stage"] = 3
    assert original["zero_optimization"]["stage"] == 1  # the user's dict is never modified


def test_strategy_reads_the_run_settings_it_is_configured_with(tmp_path):
    """The RunSettings the Accelerator/Trainer hand over (accumulation_steps, micro_batch_size,
    gradient_clip_val, precision) end up in the config handed to deepspeed.initialize."""
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"train_batch_size": "auto", "zero_optimization": {"stage": "auto", "overlap_comm": True}})
    )
    strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, config=path)
    strategy.configure(
        RunSettings(precision=Precision("bf16-mixed"), accumulation_steps=2, micro_batch_size=4, gradient_clip_val=0.5)
    )
    config = strategy.build_config(nn.Linear(2, 2))
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (8, 2)  # world size 1
    assert (config["gradient_clipping"], config["bf16"]["enabled"]) == (0.5, True)
    assert config["zero_optimization"] == {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": 6,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches"):
        DeepSpeedStrategy(config={"gradient_accumulation_steps": 2}).build_config(nn.Linear(2, 2))
