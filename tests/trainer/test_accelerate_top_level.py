"""Accelerate's top-level names importable from ``trainforge`` and its ``is_*_available`` helpers from
``trainforge.utils`` (issue 38 item 5). The lists are Accelerate 1.15's, recorded from the installed package
(``accelerate/__init__.py``; ``grep -n "^def is_.*_available" accelerate/utils/imports.py``)."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import trainforge
import trainforge.utils
from trainforge import ConfigurationError
from trainforge.trainer import inference

# accelerate/__init__.py of Accelerate 1.15 (the names, not the submodules)
ACCELERATE_TOP_LEVEL = [
    "Accelerator",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "skip_first_batches",
    "prepare_pippy",
    "debug_launcher",
    "notebook_launcher",
    "ParallelismConfig",
    "PartialState",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DDPCommunicationHookType",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "is_rich_available",
    "load_checkpoint_in_model",
    "synchronize_rng_states",
]
# what trainforge does differently: the name exists and refuses, saying what to use instead
REFUSED = {
    "cpu_offload_with_hook": "cpu_offload",
    "init_on_device": "init_empty_weights",
    "load_checkpoint_in_model": "load_checkpoint_and_dispatch",
    "synchronize_rng_states": "set_seed",
    "debug_launcher": "notebook_launcher",
    "prepare_pippy": "dispatch_model",
    "ParallelismConfig": "MegatronStrategy",
    "DeepSpeedPlugin": "DeepSpeedStrategy",
    "FullyShardedDataParallelPlugin": "FSDPStrategy",
    "AutocastKwargs": "torch.autocast",
}
# accelerate/utils/imports.py of Accelerate 1.15, less Megatron-LM's, bitsandbytes' multi-backend and
# Transformer Engine's MXFP8 checks (trainforge has no use for those backends)
ACCELERATE_AVAILABILITY = [
    "is_torch_distributed_available",
    "is_xccl_available",
    "is_import_timer_available",
    "is_pynvml_available",
    "is_amdsmi_available",
    "is_rocm_available",
    "is_pytest_available",
    "is_msamp_available",
    "is_schedulefree_available",
    "is_transformer_engine_available",
    "is_lomo_available",
    "is_cuda_available",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_deepspeed_available",
    "is_pippy_available",
    "is_bf16_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_bnb_available",
    "is_torchvision_available",
    "is_transformers_available",
    "is_datasets_available",
    "is_peft_available",
    "is_timm_available",
    "is_triton_available",
    "is_aim_available",
    "is_tensorboard_available",
    "is_wandb_available",
    "is_comet_ml_available",
    "is_swanlab_available",
    "is_trackio_available",
    "is_boto3_available",
    "is_rich_available",
    "is_sagemaker_available",
    "is_tqdm_available",
    "is_clearml_available",
    "is_pandas_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_mlu_available",
    "is_musa_available",
    "is_npu_available",
    "is_sdaa_available",
    "is_hpu_available",
    "is_xpu_available",
    "is_neuron_available",
    "is_dvclive_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_weights_only_available",
    "is_numpy_available",
]


def test_accelerates_top_level_names_are_importable_from_trainforge():
    missing = [n for n in ACCELERATE_TOP_LEVEL if n not in trainforge.__all__ or not hasattr(trainforge, n)]
    assert missing == []
    same = ("DataLoaderConfiguration", "DistributedDataParallelKwargs", "DDPCommunicationHookType", "PartialState")
    for name in same + ("find_executable_batch_size", "skip_first_batches", "DistributedType", "is_rich_available"):
        assert getattr(trainforge, name) is getattr(trainforge.utils, name), name
    for name in ("init_empty_weights", "infer_auto_device_map", "dispatch_model", "load_checkpoint_and_dispatch"):
        assert getattr(trainforge, name) is getattr(inference, name), name
    assert trainforge.DataLoaderConfiguration(even_batches=False).even_batches is False
    with trainforge.init_empty_weights():
        assert torch.nn.Linear(2, 2).weight.device.type == "meta"


@pytest.mark.parametrize("name, instead", sorted(REFUSED.items()))
def test_names_trainforge_does_differently_refuse_and_say_what_to_use(name, instead):
    with pytest.raises(ConfigurationError, match=rf"{name} is Accelerate's; trainforge does not .*{instead}"):
        getattr(trainforge, name)(torch.nn.Linear(1, 1))


def test_the_is_available_helpers_programs_import_are_there():
    from trainforge.trainer.compat.accelerate import imports

    assert sorted(n for n, f in vars(imports).items() if n.startswith("is_") and callable(f)) == imports.__all__
    missing = [n for n in ACCELERATE_AVAILABILITY if n not in trainforge.utils.__all__]
    assert missing == []
    for name in ACCELERATE_AVAILABILITY:
        assert isinstance(getattr(trainforge.utils, name)(), bool), name
    assert trainforge.utils.is_torch_distributed_available() is torch.distributed.is_available()
    assert trainforge.utils.is_cuda_available() is torch.cuda.is_available()
    assert trainforge.utils.is_torch_version(">=", "2.0") and not trainforge.utils.is_torch_version("<", "2.0")
    with pytest.raises(ValueError, match=r"operation='=>'\) must be one of <, <=, ==, !=, >=, >"):
        trainforge.utils.is_torch_version("=>", "2.0")
    with pytest.raises(ValueError, match=r"check_is_tpu and check_is_gpu cannot both be True"):
        trainforge.utils.is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)


def test_use_distributed_is_false_on_one_process():
    """Accelerate's ``Accelerator.use_distributed`` (True on two processes: test_accelerate_ddp_comm_hooks.py)."""
    assert trainforge.Accelerator(cpu=True).use_distributed is False


def _fake_distribution(root, package: str, body: str = "", metadata: bool = True):
    (root / package).mkdir()
    (root / package / "__init__.py").write_text(textwrap.dedent(body))
    if metadata:
        info = root / f"{package}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")


def test_a_package_counts_when_installed_not_when_a_folder_of_its_name_is_on_the_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    assert trainforge.utils.is_schedulefree_available() is False
    _fake_distribution(tmp_path, "schedulefree", metadata=False)  # a folder, not an installed distribution
    importlib.invalidate_caches()
    assert trainforge.utils.is_schedulefree_available() is False
    info = tmp_path / "schedulefree-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: schedulefree\nVersion: 1.0\n")
    importlib.invalidate_caches()
    assert trainforge.utils.is_schedulefree_available() is True


NPU_PLUGIN = """
import torch, types
torch.npu = types.SimpleNamespace(is_available=lambda: {available}, device_count=lambda: {count})
"""


@pytest.mark.parametrize("available, count", [(True, 1), (False, 0)])
def test_a_device_counts_when_its_torch_plugin_reports_one(tmp_path, monkeypatch, available, count):
    """``is_npu_available`` imports torch_npu and asks ``torch.npu``, as Accelerate: a stand-in plug-in here."""
    monkeypatch.syspath_prepend(str(tmp_path))
    assert trainforge.utils.is_npu_available() is False  # no torch_npu installed
    _fake_distribution(tmp_path, "torch_npu", NPU_PLUGIN.format(available=available, count=count))
    importlib.invalidate_caches()
    try:
        assert trainforge.utils.is_npu_available() is available
        assert trainforge.utils.is_npu_available(check_device=True) is available
    finally:
        sys.modules.pop("torch_npu", None)
        if hasattr(torch, "npu"):
            delattr(torch, "npu")


def test_the_helpers_answer_as_accelerates_here():
    """Where Accelerate is installed (the development machine), each helper gives Accelerate's answer."""
    utils = pytest.importorskip("accelerate.utils")
    imports = importlib.import_module("accelerate.utils.imports")
    differ = {}
    for name in ACCELERATE_AVAILABILITY:
        theirs = (getattr(utils, name, None) or getattr(imports, name))()
        if bool(getattr(trainforge.utils, name)()) != bool(theirs):
            differ[name] = theirs
    assert differ == {}
