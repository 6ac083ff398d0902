"""Accelerate's ``is_*_available`` helpers (``accelerate.utils``; exported by ``trainforge.utils``), which
Accelerate's examples and transformers' ``*_no_trainer.py`` scripts import to pick a device or an optional
feature. Each checks what Accelerate 1.15 checks (``accelerate/utils/imports.py``): a package is available when
it can be imported and is installed as a distribution (``find_spec`` plus its metadata, so a folder of the same
name in the working directory does not count); a device when its torch backend is there and reports one."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
import os
import sys
from typing import Any, Callable, Optional

import torch


def _is_package_available(package: str, distribution: Optional[str] = None) -> bool:
    """``package`` importable and ``distribution`` (default: the same name) installed, as Accelerate checks."""
    try:
        if importlib.util.find_spec(package) is None:
            return False
    except (ImportError, ValueError):  # a parent package missing, or a broken module entry
        return False
    try:
        importlib.metadata.metadata(distribution or package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _version_at_least(distribution: str, minimum: str) -> bool:
    from packaging.version import Version

    return Version(importlib.metadata.version(distribution)) >= Version(minimum)


def _package_check(name: str, package: str, distribution: Optional[str] = None) -> Callable[[], bool]:
    def check() -> bool:
        return _is_package_available(package, distribution)

    check.__name__ = check.__qualname__ = name
    check.__doc__ = f"Whether the package {package!r} is installed (Accelerate's ``{name}``)."
    return check


is_schedulefree_available = _package_check("is_schedulefree_available", "schedulefree")
is_deepspeed_available = _package_check("is_deepspeed_available", "deepspeed")
is_transformers_available = _package_check("is_transformers_available", "transformers")
is_datasets_available = _package_check("is_datasets_available", "datasets")
is_peft_available = _package_check("is_peft_available", "peft")
is_timm_available = _package_check("is_timm_available", "timm")
is_torchvision_available = _package_check("is_torchvision_available", "torchvision")
is_wandb_available = _package_check("is_wandb_available", "wandb")
is_comet_ml_available = _package_check("is_comet_ml_available", "comet_ml")
is_swanlab_available = _package_check("is_swanlab_available", "swanlab")
is_boto3_available = _package_check("is_boto3_available", "boto3")
is_sagemaker_available = _package_check("is_sagemaker_available", "sagemaker")
is_tqdm_available = _package_check("is_tqdm_available", "tqdm")
is_clearml_available = _package_check("is_clearml_available", "clearml")
is_pandas_available = _package_check("is_pandas_available", "pandas")
is_matplotlib_available = _package_check("is_matplotlib_available", "matplotlib")
is_dvclive_available = _package_check("is_dvclive_available", "dvclive")
is_pytest_available = _package_check("is_pytest_available", "pytest")
is_lomo_available = _package_check("is_lomo_available", "lomo_optim")
is_msamp_available = _package_check("is_msamp_available", "msamp", "ms-amp")
is_import_timer_available = _package_check("is_import_timer_available", "import_timer")
is_torchdata_available = _package_check("is_torchdata_available", "torchdata")
is_numpy_available = _package_check("is_numpy_available", "numpy")
is_amdsmi_available = _package_check("is_amdsmi_available", "amdsmi")


def is_tensorboard_available() -> bool:
    """TensorBoard or tensorboardX installed."""
    return _is_package_available("tensorboard") or _is_package_available("tensorboardX")


def is_mlflow_available() -> bool:
    """MLflow (or mlflow-skinny) installed."""
    return _is_package_available("mlflow") or _is_package_available("mlflow", "mlflow-skinny")


def is_trackio_available() -> bool:
    return sys.version_info >= (3, 10) and _is_package_available("trackio")


def is_aim_available() -> bool:
    """Aim below 4.0 installed (what Accelerate's tracker works with)."""
    return _is_package_available("aim") and not _version_at_least("aim", "4.0.0")


def is_pynvml_available() -> bool:
    return _is_package_available("pynvml") or _is_package_available("pynvml", "nvidia-ml-py")


def is_torchao_available() -> bool:
    """torchao 0.6.1 or later installed (what fp8 training needs)."""
    return _is_package_available("torchao") and _version_at_least("torchao", "0.6.1")


def is_transformer_engine_available() -> bool:
    return _is_package_available("transformer_engine", "transformer-engine")


def is_fp8_available() -> bool:
    """A package that trains in fp8 installed (MS-AMP, Transformer Engine or torchao), as Accelerate checks."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def is_bnb_available(min_version: Optional[str] = None) -> bool:
    """bitsandbytes installed (at least ``min_version`` if given)."""
    if not _is_package_available("bitsandbytes"):
        return False
    return min_version is None or _version_at_least("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    return is_bnb_available("0.37.2")


def is_torchdata_stateful_dataloader_available() -> bool:
    """torchdata with ``StatefulDataLoader`` (0.8.0 or later) installed."""
    return _is_package_available("torchdata") and _version_at_least("torchdata", "0.8.0")


def is_rich_available() -> bool:
    """rich installed and ``ACCELERATE_ENABLE_RICH`` set true, as in Accelerate."""
    flag = os.environ.get("ACCELERATE_ENABLE_RICH", "false").strip().lower()
    return _is_package_available("rich") and flag in ("1", "true", "yes", "y", "on", "t")


def is_triton_available() -> bool:
    return _is_package_available("triton", "triton-xpu" if is_xpu_available() else None)


def is_pippy_available() -> bool:
    """Pipeline parallelism in torch (``torch.distributed.pipelining``, torch 2.4 and later)."""
    return importlib.util.find_spec("torch.distributed.pipelining") is not None


_COMPARE = {
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    ">": operator.gt,
}


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch's version with ``version`` (``is_torch_version(">=", "2.4")``), as Accelerate."""
    from packaging.version import Version, parse

    if operation not in _COMPARE:
        raise ValueError(f"is_torch_version(operation={operation!r}) must be one of {', '.join(_COMPARE)}")
    return _COMPARE[operation](Version(parse(torch.__version__).base_version), parse(version))


def is_weights_only_available() -> bool:
    """Whether ``torch.load`` has safe loading (``weights_only``, torch 2.4 and later), as Accelerate checks."""
    return is_torch_version(">=", "2.4.0")


# ---- devices -----------------------------------------------------------------------------------
def is_torch_distributed_available() -> bool:
    return torch.distributed.is_available()


def is_cuda_available() -> bool:
    """A CUDA (or ROCm) device, checked through NVML without initialising CUDA, as Accelerate."""
    previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if previous is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous


def is_xccl_available() -> bool:
    """The XCCL collective backend (Intel GPUs) built into torch."""
    check = getattr(torch.distributed.distributed_c10d, "is_xccl_available", None)
    return bool(check and check())


def is_rocm_available() -> bool:
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """An Apple GPU through torch's MPS backend (``min_version``: Accelerate's torch version floor, 1.12 or
    later; every torch trainforge runs on is newer)."""
    return torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_xpu_available(check_device: bool = False) -> bool:
    """An Intel GPU through torch's XPU backend (torch 2.7 and later, as Accelerate)."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return False
    try:
        return (xpu.device_count() > 0 and xpu.is_available()) if check_device else xpu.is_available()
    except RuntimeError:
        return False


def _plugin_device(package: str, attribute: str, check_device: bool) -> bool:
    """A device of a torch plug-in package (``torch_npu``, ``torch_mlu``, ...): the package imports and
    ``torch.<attribute>`` reports a device."""
    if not _is_package_available(package):
        return False
    try:
        importlib.import_module(package)
        backend = getattr(torch, attribute)
        if check_device:
            backend.device_count()  # raises when there is no device
        return bool(backend.is_available())
    except Exception:
        return False


def is_npu_available(check_device: bool = False) -> bool:
    """An Ascend NPU (``torch_npu``)."""
    return _plugin_device("torch_npu", "npu", check_device)


def is_mlu_available(check_device: bool = False) -> bool:
    """A Cambricon MLU (``torch_mlu``)."""
    return _plugin_device("torch_mlu", "mlu", check_device)


def is_musa_available(check_device: bool = False) -> bool:
    """A Moore Threads GPU (``torch_musa``)."""
    return _plugin_device("torch_musa", "musa", check_device)


def is_sdaa_available(check_device: bool = False) -> bool:
    """A Tecorigin SDAA (``torch_sdaa``)."""
    return _plugin_device("torch_sdaa", "sdaa", check_device)


def is_neuron_available(check_device: bool = False) -> bool:
    """AWS Neuron (``torch_neuronx``)."""
    return _plugin_device("torch_neuronx", "neuron", check_device)


def is_hpu_available(init_hccl: bool = False) -> bool:
    """An Intel Gaudi HPU (``habana_frameworks.torch``)."""
    if not _is_package_available("habana_frameworks") or importlib.util.find_spec("habana_frameworks.torch") is None:
        return False
    try:
        importlib.import_module("habana_frameworks.torch")
        if init_hccl:
            importlib.import_module("habana_frameworks.torch.distributed.hccl")
        return bool(torch.hpu.is_available())  # type: ignore[attr-defined]  # registered by habana_frameworks
    except Exception:
        return False


@functools.lru_cache(None)
def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla importable (and, if asked, its device a TPU or a GPU); ``USE_TORCH_XLA=0`` turns it off."""
    if check_is_tpu and check_is_gpu:
        raise ValueError("is_torch_xla_available: check_is_tpu and check_is_gpu cannot both be True")
    if os.environ.get("USE_TORCH_XLA", "1").strip().lower() in ("0", "false", "no", "off", "n", "f"):
        return False
    try:
        import torch_xla.runtime as xr
    except ImportError:
        return False
    if check_is_gpu:
        return xr.device_type() in ("GPU", "CUDA")
    return xr.device_type() == "TPU" if check_is_tpu else True


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 works here: the TPU unless ignored, the CUDA/XPU device's own answer, MPS on macOS 14, else
    True (the CPU), as Accelerate."""
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_habana_gaudi1() -> bool:
    """Whether the HPU is a first-generation Gaudi (which has no fp16)."""
    if not is_hpu_available():
        return False
    htexp: Any = importlib.import_module("habana_frameworks.torch.utils.experimental")

    return htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi


def is_fp16_available() -> bool:
    """fp16 works everywhere but on a first-generation Gaudi, as Accelerate."""
    return not is_habana_gaudi1()


# every helper above (tests/trainer/test_accelerate_top_level.py checks the list is complete)
__all__ = [
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bf16_available",
    "is_bnb_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_msamp_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_numpy_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_rocm_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_distributed_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_tqdm_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_xpu_available",
]
