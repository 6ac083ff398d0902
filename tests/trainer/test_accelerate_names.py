"""Accelerate's names and arguments on trainforge (issue 20): each one works as in Accelerate, or is
refused with a message naming the value, the choices and the trainforge way: the Accelerator's arguments
and members (one process). trainforge.utils' functions, and two processes, are in test_accelerate_utils.py."""

from __future__ import annotations

import csv
import json
import random
import runpy
import sys
import types
import weakref
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Accelerator, ConfigurationError
from trainforge.callbacks import CSVLogger
from trainforge.strategies.base import Strategy
from trainforge.strategies.precision import Precision
from trainforge.trainer.compat.accelerate.accelerator_args import AccelerateOptions
from trainforge.trainer.compat.accelerate.state import distributed_type_of, mixed_precision_name
from trainforge.trainer.compat.accelerate.trackers import parse_log_with
from trainforge.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    FP8RecipeKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    LoggerType,
    MegatronLMPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
    release_memory,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


# ---- a ported example, number for number ----------------------------------------------------------
def test_accelerates_tracking_example_matches_a_hand_written_loop(tmp_path, monkeypatch, capsys):
    """examples/by_feature/tracking.py (nlp_example + trackers), imports changed only. Under HF Accelerate
    1.15 the same script printed accuracy 0.7222/0.6111/0.6111, f1 0.7059/0.6316/0.6316, train_loss
    0.638935/0.581762/0.538929 and weights_sum 15.348758350359276 (tests/scripts/accelerate_tracking.py
    --backend accelerate); here the reference is a plain PyTorch loop, computed below."""
    monkeypatch.chdir(tmp_path)
    argv = ["accelerate_tracking.py", "--cpu", "--with_tracking", "--log_with", "csv", "--project_dir", "logs"]
    monkeypatch.setattr(sys, "argv", argv)
    script = runpy.run_path(str(SCRIPTS / "accelerate_tracking.py"), run_name="__main__")
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")][0]
    got = json.loads(line[len("RESULT ") :])

    # the same training by hand: plain DataLoaders, model, AdamW, schedule, manual accumulation of 2
    random.seed(42), np.random.seed(42), torch.manual_seed(42)
    train = DataLoader(script["Pairs"](40, 1), shuffle=True, batch_size=4, drop_last=True)
    evaluation = DataLoader(script["Pairs"](18, 2), batch_size=5)
    model = script["TinyClassifier"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    schedule = script["linear_schedule_with_warmup"](optimizer, 2, len(train) * 3 // 2)
    expected = []
    for _ in range(3):
        model.train()
        total = 0
        for step, batch in enumerate(train):
            loss = model(**batch).loss
            total += loss.detach().float()
            (loss / 2).backward()
            if step % 2 == 0:
                optimizer.step(), schedule.step(), optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            pairs = [(model(**b).logits.argmax(-1), b["labels"]) for b in evaluation]  # one pass, as the script
        accuracy, f1 = script["accuracy_f1"](torch.cat([p for p, _ in pairs]), torch.cat([r for _, r in pairs]))
        expected.append({"accuracy": accuracy, "f1": f1, "evaluated": 18, "train_loss": total.item() / len(train)})
    weights_sum = float(sum(v.double().sum() for v in model.state_dict().values()))

    assert got["epochs"] == expected
    assert got["weights_sum"] == weights_sum and got["lr"] == schedule.get_last_lr()[0]
    assert (got["distributed_type"], got["mixed_precision"]) == ("NO", "no")
    # what accelerator.log wrote: <project_dir>/<run name>/metrics.csv, config as hyperparameters
    run = tmp_path / "logs" / "accelerate_tracking"
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for row, epoch in zip(rows, expected):
        assert float(row["train_loss"]) == epoch["train_loss"] and float(row["accuracy"]) == epoch["accuracy"]
    assert yaml.safe_load(open(run / "hparams.yaml")) == {"lr": 0.02, "num_epochs": 3, "seed": 42, "batch_size": 8}
    assert (run / "status.txt").read_text() == "FINISHED\n"


# ---- Accelerator arguments ----------------------------------------------------------------------
@pytest.mark.parametrize("given,name", [("no", "32"), ("bf16", "bf16-mixed"), ("NO", "32")])
def test_mixed_precision_maps_onto_trainforges_precisions(given, name):
    acc = Accelerator(mixed_precision=given)
    assert acc.precision.name == name and acc.mixed_precision == given.lower()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mixed_precision": "fp32"}, r"mixed_precision='fp32' is not one of: no, fp16, bf16, fp8.*precision="),
        ({"mixed_precision": "bf16", "precision": "32"}, r"precision='32' and mixed_precision='bf16' both given"),
        ({"cpu": "yes"}, r"cpu='yes' must be True or False"),
        ({"cpu": True, "accelerator": "gpu"}, r"cpu=True and accelerator='gpu' disagree"),
        ({"device_placement": None}, r"device_placement=None must be True or False"),
        (
            {"log_with": "aim"},
            r"log_with='aim' is not one of: all, tensorboard, mlflow, comet_ml, wandb, csv.*TrackerCallback",
        ),
        ({"log_with": ["csv", 3], "project_dir": "p"}, r"log_with=3 is not one of"),
        ({"log_with": "csv"}, r"log_with='csv' writes csv files in the logging directory.*project_dir="),
        ({"kwargs_handlers": DistributedDataParallelKwargs()}, r"kwargs_handlers=.* must be a list"),
        (
            {"kwargs_handlers": [object()]},
            r"kwargs_handlers got object: trainforge takes DistributedDataParallelKwargs",
        ),
        ({"kwargs_handlers": [GradScalerKwargs(), GradScalerKwargs()]}, r"two GradScalerKwargs"),
        ({"rng_types": "generator"}, r"rng_types='generator' must be a list"),
        ({"rng_types": ["dice"]}, r"rng_types='dice' is not one of: torch, cuda, xla, generator"),
        ({"rng_types": ["torch", "generator"]}, r"rng_types=\['torch'\] is not supported: .*set_seed"),
        ({"deepspeed_plugin": object()}, r"deepspeed_plugin=...\) is Accelerate's; .*DeepSpeedStrategy"),
        ({"fsdp_plugin": object()}, r"FSDPStrategy"),
        ({"gradient_accumulation_plugin": object()}, r"gradient_accumulation_steps=<num_steps>"),
        ({"dynamo_backend": "inductor"}, r"torch.compile"),
        ({"step_scheduler_with_optimizer": False}, r"step_scheduler_with_optimizer=False is not supported"),
        ({"learning_rate": 1}, r"unknown argument learning_rate=1; .*mixed_precision"),
        (
            {"dataloader_config": DataLoaderConfiguration(), "project_config": types.SimpleNamespace(iteration=2)},
            r"iteration=2\) is not supported",
        ),
    ],
)
def test_bad_accelerate_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        Accelerator(**kwargs)


def test_cpu_and_the_arguments_accelerate_takes_as_is():
    acc = Accelerator(cpu=True, rng_types=["generator"], step_scheduler_with_optimizer=True, log_with=None)
    assert acc.device == torch.device("cpu") and acc.rng_types == ["generator"] and acc.trackers == []


def test_dataloader_configuration_every_field_honoured_or_refused():
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False, non_blocking=True))
    assert (acc.even_batches, acc.split_batches, acc.dispatch_batches) == (False, False, None)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2))
    assert loader.state_dict() is not None  # use_stateful_dataloader: every prepared loader is resumable
    Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    # use_seedable_sampler: epoch e is the permutation of data_seed + e (Accelerate's SeedableRandomSampler)
    seeded = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=3))
    loader = seeded.prepare(DataLoader(torch.arange(7), batch_size=7, shuffle=True))
    for epoch in (0, 1):
        expected = torch.randperm(7, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        assert [batch.tolist() for batch in loader] == [expected]
    with pytest.raises(ConfigurationError, match=r"data_seed='3'\) must be an int or None"):
        DataLoaderConfiguration(data_seed="3")
    with pytest.raises(ConfigurationError, match=r"non_blocking='x'\) must be True or False"):
        DataLoaderConfiguration(non_blocking="x")
    accelerates = types.SimpleNamespace(
        even_batches=True, split_batches=False, dispatch_batches=None, use_seedable_sampler="yes"
    )
    with pytest.raises(ConfigurationError, match="use_seedable_sampler='yes'"):  # Accelerate's own object too
        Accelerator(dataloader_config=accelerates)


def test_project_configuration_every_field_honoured_or_refused(tmp_path):
    config = ProjectConfiguration(str(tmp_path / "p"), automatic_checkpoint_naming=True, total_limit=2)
    assert config.logging_dir == str(tmp_path / "p")  # defaults to project_dir, as Accelerate
    acc = Accelerator(project_config=config)
    assert (acc.project_dir, acc.automatic_checkpoint_naming, acc.total_limit) == (str(tmp_path / "p"), True, 2)
    acc = Accelerator(
        project_config=ProjectConfiguration(str(tmp_path), logging_dir=str(tmp_path / "l")), log_with="csv"
    )
    acc.init_trackers("run")
    acc.log({"x": 1.0}, step=0)
    acc.end_training()
    assert (tmp_path / "l" / "run" / "metrics.csv").exists()
    with pytest.raises(ConfigurationError, match=r"iteration=1\) is not supported.*one past the newest"):
        ProjectConfiguration(iteration=1)
    with pytest.raises(ConfigurationError, match=r"save_on_each_node=True\) is not supported"):
        ProjectConfiguration(save_on_each_node=True)


def _options(**kwargs):
    args = dict(precision=None, mixed_precision=None, accelerator=None, cpu=False, kwargs_handlers=None,
                rng_types=None, device_placement=True, log_with=None, dataloader_config=None,
                project_config=None, others={})  # fmt: skip
    return AccelerateOptions(**{**args, **kwargs})


def test_kwargs_handlers_reach_the_strategy():
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=10, comm_hook="fp16")
    group = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=90))
    options = _options(kwargs_handlers=[ddp, group])
    assert options.strategy_arguments("ddp", {}) == (
        "ddp",
        {"find_unused_parameters": True, "bucket_cap_mb": 10, "comm_hook": "fp16",
         "process_group_backend": "gloo", "timeout": timedelta(seconds=90)},
    )  # fmt: skip
    assert options.strategy_arguments("auto", {}) == ("auto", {})  # one process: no DDP, no group (as Accelerate)
    assert _options(kwargs_handlers=[group]).strategy_arguments("fsdp", {"x": 1})[1] == {
        "x": 1, "process_group_backend": "gloo", "timeout": timedelta(seconds=90)}  # fmt: skip
    with pytest.raises(ConfigurationError, match="DistributedDataParallelKwargs applies to DDP.*'fsdp'"):
        options.strategy_arguments("fsdp", {})
    with pytest.raises(ConfigurationError, match=r"with a Strategy instance: pass those settings"):
        options.strategy_arguments(Strategy(), {})
    with pytest.raises(ConfigurationError, match="device_placement=False with strategy 'deepspeed'"):
        _options(device_placement=False).strategy_arguments("deepspeed", {})
    with pytest.raises(ConfigurationError, match=r"comm_hook='sgd'\): choose one of no, fp16, bf16, power_sgd.*DDPStr"):
        DistributedDataParallelKwargs(comm_hook="sgd")
    with pytest.raises(ConfigurationError, match=r"init_method='tcp://h:1'\) is not supported.*trainforge launch"):
        InitProcessGroupKwargs(init_method="tcp://h:1")
    with pytest.raises(ConfigurationError, match=r"timeout=30\) must be a datetime.timedelta"):
        InitProcessGroupKwargs(timeout=30)


def test_grad_scaler_kwargs_configure_the_fp16_scaler():
    assert GradScalerKwargs(init_scale=1024.0).to_kwargs() == {"init_scale": 1024.0}
    precision = types.SimpleNamespace(scaler=object(), device=torch.device("cpu"))  # fp16's scaler stands here
    _options(kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=5)]).apply_precision(precision)
    assert precision.scaler.get_scale() == 1024.0 and precision.scaler.get_growth_interval() == 5
    unscaled = Precision("32")
    with pytest.warns(UserWarning, match=r"GradScalerKwargs\(\{\}\) is ignored: precision '32' uses no grad scaler"):
        _options(kwargs_handlers=[GradScalerKwargs()]).apply_precision(unscaled)
    assert unscaled.scaler is None  # no fp16: no scaler, as Accelerate
    with pytest.warns(UserWarning, match=r"ignored: precision 'bf16-mixed' uses no grad scaler"):
        Accelerator(mixed_precision="bf16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])  # ignored silently
    with pytest.warns(UserWarning, match="GradScalerKwargs"):
        Accelerator(kwargs_handlers=[GradScalerKwargs(), DistributedDataParallelKwargs()])  # accepted on one process


@pytest.mark.parametrize(
    "cls,match",
    [
        (DeepSpeedPlugin, "DeepSpeedStrategy"),
        (FullyShardedDataParallelPlugin, "FSDPStrategy"),
        (MegatronLMPlugin, "MegatronStrategy"),
        (GradientAccumulationPlugin, "gradient_accumulation_steps"),
        (AutocastKwargs, "torch.autocast"),
        (FP8RecipeKwargs, "mixed_precision='fp8'"),
        (TorchDynamoPlugin, "torch.compile"),
    ],
)
def test_accelerate_classes_trainforge_does_differently_say_how(cls, match):
    with pytest.raises(ConfigurationError, match=rf"{cls.__name__} is Accelerate's; .*{match}"):
        cls(zero_stage=2)


def test_device_placement_false_leaves_the_model_and_batches_where_they_are():
    acc = Accelerator(device_placement=False)
    model = acc.prepare(nn.Linear(2, 2, device="meta"))  # placing it would fail: a meta tensor has no data
    assert model.weight.device.type == "meta" and acc.device_placement is False
    loader = acc.prepare(DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2))
    assert loader.device == torch.device("cpu")
    placed = Accelerator().prepare(nn.Linear(2, 2, device="meta"))  # with placement: materialised (test_empty_init)
    assert placed.weight.device.type == "cpu" and torch.isfinite(placed.weight).all()
    with pytest.raises(ConfigurationError, match=r"prepare_model\(device_placement=True\): placement is decided once"):
        acc.prepare_model(nn.Linear(2, 2), device_placement=True)


# ---- attributes -----------------------------------------------------------------------------------
def test_state_distributed_type_mixed_precision_and_last_process():
    acc = Accelerator(mixed_precision="bf16")
    assert acc.distributed_type is DistributedType.NO and acc.distributed_type == "NO"
    assert acc.is_last_process and acc.state.num_processes == 1 and acc.state.device == acc.device
    assert str(acc.state) == (
        "Distributed environment: NO\nNum processes: 1\nProcess index: 0\nLocal process index: 0\n"
        "Device: cpu\n\nMixed precision type: bf16\n"
    )
    names = {"32": "no", "16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16", "fp8": "fp8"}
    for name, accelerate in names.items():
        assert mixed_precision_name(types.SimpleNamespace(name=name)) == accelerate


@pytest.mark.parametrize(
    "name,world,device,expected",
    [
        ("single", 1, "cpu", DistributedType.NO),
        ("ddp", 1, "cpu", DistributedType.NO),
        ("ddp", 2, "cpu", DistributedType.MULTI_CPU),
        ("ddp", 2, "cuda", DistributedType.MULTI_GPU),
        ("fsdp", 2, "cuda", DistributedType.FSDP),
        ("deepspeed", 1, "cuda", DistributedType.DEEPSPEED),
        ("megatron", 4, "cuda", DistributedType.MEGATRON_LM),
        ("xla", 8, "xla", DistributedType.XLA),
    ],
)
def test_distributed_type_of_each_strategy(name, world, device, expected):
    strategy = types.SimpleNamespace(name=name, world_size=world, root_device=torch.device(device))
    assert distributed_type_of(strategy) is expected


def test_optimizer_step_was_skipped_follows_the_grad_scaler():
    acc = Accelerator()
    acc.precision.scaler = torch.amp.GradScaler("cpu")  # what mixed_precision="fp16" has on a GPU
    model = acc.prepare(nn.Linear(2, 1))
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.optimizer_step_was_skipped is False
    for value, skipped in ((float("inf"), True), (1.0, False)):
        acc.backward(model(torch.full((1, 2), value)).sum())
        opt.step()
        opt.zero_grad()
        assert acc.optimizer_step_was_skipped is skipped


# ---- methods --------------------------------------------------------------------------------------
def test_save_get_state_dict_free_memory_prepare_model(tmp_path):
    acc = Accelerator()
    original = nn.Linear(3, 2)
    ref = weakref.ref(original)
    model = acc.prepare_model(original, evaluation_mode=True)
    state = acc.get_state_dict(model)
    assert state.keys() == {"weight", "bias"} and torch.equal(state["weight"], original.weight.detach())
    acc.save(state, tmp_path / "w.pt")
    assert torch.equal(torch.load(tmp_path / "w.pt")["bias"], state["bias"])
    acc.save(state, str(tmp_path / "w.safetensors"), safe_serialization=True)
    assert torch.equal(load_file(tmp_path / "w.safetensors")["weight"], state["weight"])
    with pytest.raises(ConfigurationError, match=r"prepare_model\(int\): expected a torch.nn.Module"):
        acc.prepare_model(3)
    del original, state
    assert acc.free_memory(model) == [None]
    del model
    assert ref() is None  # the Accelerator kept no reference
    assert release_memory(1, 2) == [None, None]


def test_set_trigger_and_check_trigger():
    acc = Accelerator()
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False


def test_trackers_init_log_get_tracker_end_training(tmp_path):
    acc = Accelerator(log_with=[LoggerType.CSV], project_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match=r"log\(\) before init_trackers"):
        acc.log({"loss": 1.0})
    with pytest.raises(
        ConfigurationError, match=r"init_kwargs=\{'mlflow': ...\}\): 'mlflow' is not a tracker of .*csv"
    ):
        acc.init_trackers("proj", init_kwargs={"mlflow": {}})
    with pytest.raises(
        ConfigurationError,
        match=r"init_kwargs\['csv'\]=.*CSVLogger, which takes prefix, flush_logs_every_n_steps, failure_policy$",
    ):
        acc.init_trackers("proj", init_kwargs={"csv": {"flush_secs": 3}})
    with pytest.raises(ConfigurationError, match=r"project_name=''\) must be a non-empty string"):
        acc.init_trackers("")
    acc.init_trackers("proj", config={"lr": 0.1, "opt": {"name": "adamw"}})
    tracker = acc.get_tracker("csv")
    assert isinstance(tracker, CSVLogger) and acc.trackers == [tracker] and acc.get_tracker("CSVLogger") is tracker
    acc.log({"loss": 1.5, "acc": torch.tensor(0.5)}, step=3)
    acc.log({"loss": 1.0})  # step=None: the count of earlier log calls
    with pytest.raises(ConfigurationError, match=r"log\(step=-1\) must be an int >= 0"):
        acc.log({"loss": 1.0}, step=-1)
    with pytest.raises(ConfigurationError, match=r"log\(values=list\) must be a dict"):
        acc.log(["loss"])
    with pytest.raises(ConfigurationError, match=r"log_kwargs=...\) is not supported.*init_kwargs"):
        acc.log({"loss": 1.0}, log_kwargs={"csv": {}})
    with pytest.raises(
        ConfigurationError, match=r"get_tracker\('wandb'\): no such tracker; this Accelerator has \['csv'\]"
    ):
        acc.get_tracker("wandb")
    with pytest.raises(ConfigurationError, match=r"unwrap=True\) is not supported.*accelerator.log"):
        acc.get_tracker("csv", unwrap=True)
    acc.end_training()
    rows = list(csv.DictReader(open(tmp_path / "proj" / "metrics.csv")))
    assert [(r["step"], r["loss"], r["acc"]) for r in rows] == [("3", "1.5", "0.5"), ("1", "1.0", "")]
    assert yaml.safe_load(open(tmp_path / "proj" / "hparams.yaml")) == {"lr": 0.1, "opt": {"name": "adamw"}}


def test_log_with_a_tracker_instance_tensorboard_and_all(tmp_path):
    mine = CSVLogger(path=str(tmp_path / "mine" / "m.csv"))
    acc = Accelerator(log_with=["tensorboard", mine], project_dir=str(tmp_path))
    acc.init_trackers("proj")
    acc.log({"loss": 2.0}, step=1)
    assert acc.get_tracker("tensorboard").directory == str(tmp_path / "proj")
    acc.end_training()
    assert (tmp_path / "mine" / "m.csv").read_text().splitlines() == ["loss,step", "2.0,1"]  # sorted, as Lightning
    assert list((tmp_path / "proj").glob("events.out.tfevents.*"))
    everything = parse_log_with("all", str(tmp_path))
    assert everything[0] == "tensorboard" and "csv" in everything and set(everything) <= set(LoggerType) - {"all"}


def test_project_configuration_and_clear_are_accelerates_names(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    config = acc.project_configuration
    assert (config.project_dir, config.logging_dir, config.automatic_checkpoint_naming, config.total_limit) == (
        str(tmp_path),
        str(tmp_path),
        True,
        2,
    )
    model = acc.prepare(torch.nn.Linear(2, 1))
    assert acc.clear(model) == [None] and acc.project_configuration.total_limit == 2
