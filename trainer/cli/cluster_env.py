"""What a cluster's job controller tells ``trainforge launch`` through the environment.

Two families, read as the defaults of launch's own flags (a flag still wins):

- **PET_*** (torchrun's own environment defaults, ``PET_<FLAG>``): set by Kubeflow Trainer v2's torch runtime
  (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) and by a Kubeflow PyTorchJob
  (the same, next to its MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, which torchrun replaces per worker;
  PET_RDZV_BACKEND / PET_RDZV_ENDPOINT with an elastic policy). PET_NPROC_PER_NODE may be ``auto`` (Trainer v2
  writes it when the pod asks for GPUs): one process per visible GPU, else 1 (torchrun would start one per
  CPU core on a CPU pod); ``gpu`` the same but a GPU is required, ``cpu`` one per CPU core (torchrun's).
- **SKYPILOT_*** (SkyPilot's ``run`` section, one command per node): SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK,
  SKYPILOT_NODE_IPS (one address a line; the first is the head node, the master), SKYPILOT_NUM_GPUS_PER_NODE
  (0 on CPU nodes: the launch's own default applies). SkyPilot names no port: the flag, else torchrun's 29500.

PET_* win over SKYPILOT_* when both are set. Precedence overall: built-in defaults < config file < these
variables < flags (a config file baked into an image must not outvote the scheduler about this node's rank).
Values are checked here, each error naming the variable, its value and the fix.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Tuple

from trainforge.strategies.errors import ConfigurationError

#: launch settings torchrun also reads as PET_<KEY> (trainer/cli/launch.py, _TORCHRUN_FLAGS)
PET_KEYS = (
    "nnodes",
    "nproc_per_node",
    "node_rank",
    "master_addr",
    "master_port",
    "rdzv_backend",
    "rdzv_endpoint",
    "max_restarts",
)
SKYPILOT_VARS = ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE")


def _fix(variable: str, flag: str) -> str:
    return (
        f"; {variable} comes from the job's environment (the cluster's controller or the manifest's env): "
        f"fix it there, or pass {flag}, which wins"
    )


def _parsed(variable: str, key: str, value: str) -> Any:
    from trainforge.trainer.cli.launch_settings import _BY_KEY

    setting = _BY_KEY[key]
    try:
        return setting.parse(variable, value)
    except ConfigurationError as error:
        raise ConfigurationError(f"{error}{_fix(variable, setting.flag)}") from None


def _nproc(variable: str, value: str) -> Any:
    word = value.strip().lower()
    if word not in ("auto", "gpu", "cpu"):
        return _parsed(variable, "nproc_per_node", value)
    if word == "cpu":
        return os.cpu_count() or 1
    import torch  # device_count() reads NVML; it does not initialise CUDA

    gpus = torch.cuda.device_count()
    if word == "gpu" and gpus == 0:
        raise ConfigurationError(
            f"{variable}={value!r} asks for one process per GPU, but torch sees no GPU on this node"
            f"{_fix(variable, '--nproc-per-node')}"
        )
    return max(gpus, 1)


def pet_settings(environ: Mapping[str, str]) -> Dict[str, Any]:
    """The launch settings the PET_* variables set (torchrun's environment defaults), checked."""
    settings: Dict[str, Any] = {}
    for key in PET_KEYS:
        variable = "PET_" + key.upper()
        if variable not in environ:
            continue
        value = environ[variable]
        settings[key] = _nproc(variable, value) if key == "nproc_per_node" else _parsed(variable, key, value)
    _check_rank(settings, "PET_NODE_RANK", "PET_NNODES")
    return settings


def skypilot_settings(environ: Mapping[str, str]) -> Dict[str, Any]:
    """The launch settings SkyPilot's SKYPILOT_* variables set, checked ({} outside SkyPilot)."""
    if "SKYPILOT_NUM_NODES" not in environ:
        return {}
    nnodes = _parsed("SKYPILOT_NUM_NODES", "nnodes", environ["SKYPILOT_NUM_NODES"])
    if not isinstance(nnodes, int):
        raise ConfigurationError(
            f"SKYPILOT_NUM_NODES={environ['SKYPILOT_NUM_NODES']!r} must be a node count, not a range"
            f"{_fix('SKYPILOT_NUM_NODES', '--nnodes')}"
        )
    settings: Dict[str, Any] = {"nnodes": nnodes}
    if "SKYPILOT_NODE_RANK" in environ:
        settings["node_rank"] = _parsed("SKYPILOT_NODE_RANK", "node_rank", environ["SKYPILOT_NODE_RANK"])
    _check_rank(settings, "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES")
    ips = [line.strip() for line in environ.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]
    if "SKYPILOT_NODE_IPS" in environ and len(ips) != nnodes:
        raise ConfigurationError(
            f"SKYPILOT_NODE_IPS lists {len(ips)} address(es) ({', '.join(ips) or 'none'}) but "
            f"SKYPILOT_NUM_NODES={nnodes}: one address a line, one line per node"
            f"{_fix('SKYPILOT_NODE_IPS', '--master-addr')}"
        )
    if ips:
        settings["master_addr"] = ips[0]
    gpus = environ.get("SKYPILOT_NUM_GPUS_PER_NODE")
    if gpus is not None:
        count = _parsed("SKYPILOT_NUM_GPUS_PER_NODE", "nproc_per_node", gpus) if gpus.strip() != "0" else 0
        if count:
            settings["nproc_per_node"] = count
    return settings


def _check_rank(settings: Mapping[str, Any], rank_var: str, nodes_var: str) -> None:
    nnodes, rank = settings.get("nnodes"), settings.get("node_rank")
    top = int(str(nnodes).split(":")[-1]) if nnodes is not None else None
    if rank is not None and top is not None and rank >= top:
        raise ConfigurationError(
            f"{rank_var}={rank} must be < {nodes_var}={nnodes}: nodes are numbered 0 .. {top - 1}"
            f"{_fix(rank_var, '--node-rank')}"
        )


def cluster_settings(environ: Mapping[str, str] = os.environ) -> Tuple[Dict[str, Any], str]:
    """The settings a cluster's variables set and which family set them ('' when none)."""
    pet = pet_settings(environ)
    if pet:
        return pet, "PET_* variables"
    sky = skypilot_settings(environ)
    return sky, "SKYPILOT_* variables" if sky else ""
