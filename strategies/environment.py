"""Where this process sits in a distributed job, read from the variables the launcher set.

``detect_environment()`` reads (never guesses) ranks and the rendezvous address, in this order;
the first source present wins:

1. **torchrun** (also ``torch.distributed.launch``, ``trainforge launch``, ``notebook_launcher``):
   present when ``TORCHELASTIC_RUN_ID`` or ``GROUP_RANK`` is set, or ``RANK``, ``WORLD_SIZE`` and
   ``LOCAL_RANK`` all are. Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
   MASTER_PORT; node rank from GROUP_RANK (else RANK // LOCAL_WORLD_SIZE). It wins inside SLURM
   allocations too, because torchrun overwrites everything per worker.
2. **SLURM** when ``SLURM_NTASKS`` > 1 and the job is not an interactive shell
   (``SLURM_JOB_NAME`` "bash"/"interactive", i.e. ``srun --pty bash``): SLURM_PROCID, SLURM_NTASKS,
   SLURM_LOCALID, SLURM_NODEID, tasks on this node from SLURM_NTASKS_PER_NODE or
   SLURM_TASKS_PER_NODE ("4(x2),3"); MASTER_ADDR from env, else the first host of
   SLURM_NODELIST / SLURM_JOB_NODELIST; MASTER_PORT from env, else 15000 + SLURM_JOB_ID % 5000.
3. **MPI** when the world has > 1 process: Open MPI (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/
   LOCAL_SIZE) or MPICH/Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS). MPI has no
   rendezvous address, so MASTER_ADDR and MASTER_PORT must be exported (``mpirun -x``). Node rank
   is RANK // LOCAL_SIZE, which holds for MPI's default by-slot mapping on equal nodes.
4. **Kubeflow** PyTorchJob (KUBERNETES_PORT, MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, no
   LOCAL_RANK): the operator sets RANK to the *pod* (node) index and WORLD_SIZE to
   pods x nprocPerNode (older operators: pods); PET_NPROC_PER_NODE holds nprocPerNode. We read
   node_rank = RANK, local_world_size = PET_NPROC_PER_NODE (1 unless an integer),
   rank = node_rank * local_world_size + LOCAL_RANK (0). With several processes per pod, start
   them with ``trainforge launch`` (torchrun reads the PET_* variables) - then source 1 applies.
5. **single**: one process; MASTER_ADDR/MASTER_PORT from env, else 127.0.0.1 and a free port.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional

import torch

from trainforge.strategies.errors import ConfigurationError

KINDS = ("torchrun", "slurm", "mpi", "kubeflow", "single")
_INTERACTIVE_SLURM_JOB_NAMES = ("bash", "interactive")


@dataclass(frozen=True)
class ClusterEnvironment:
    """Ranks and rendezvous address of this process; ``as_env()`` feeds ``init_method="env://"``."""

    kind: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def as_env(self) -> Dict[str, str]:
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }


#: Seconds a worker has after a forwarded stop signal before its launcher kills it (``trainforge launch``
#: exports its --shutdown-timeout, else torchrun's 30): ModelCheckpoint warns when a save takes longer.
STOP_GRACE_ENV = "TRAINFORGE_STOP_GRACE_S"


@contextlib.contextmanager
def temporary_environ(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """This process's environment with ``values`` set (None: unset) inside the ``with`` block, the
    previous values restored after (what a launcher hands its children, what a test points at a server)."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def detect_environment(environ: Mapping[str, str] = os.environ) -> ClusterEnvironment:
    """The environment of this process, from ``environ`` (see the module docstring for the order)."""
    for reader in (_torchrun, _slurm, _mpi, _kubeflow):
        env = reader(environ)
        if env is not None:
            return _validated(env, environ)
    addr = environ.get("MASTER_ADDR", "127.0.0.1")
    port = _int(environ, "MASTER_PORT", minimum=1) if "MASTER_PORT" in environ else find_free_port()
    return _validated(ClusterEnvironment("single", 0, 1, 0, 1, 0, addr, port), environ)


def default_backend(device: torch.device | str) -> str:
    """The process-group backend for ``device``: nccl for CUDA, gloo for the CPU, and for any other
    device the backend registered for its type (``torch.distributed.Backend.register_backend(...,
    devices=[...])``: xccl for XPU, "tpu" for torch-tpu's PrivateUse1 device), else gloo."""
    kind = torch.device(device).type
    if kind in ("cuda", "cpu"):
        return "nccl" if kind == "cuda" else "gloo"
    import torch.distributed as dist

    registered = getattr(getattr(dist, "Backend", None), "default_device_backend_map", {}) or {}
    return registered.get(kind, "gloo")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it; it can be taken before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "") -> bool:
    """Whether a TCP server could bind ``port`` on ``host`` ("" = all interfaces) right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR as TCPStore uses it: ports in TIME_WAIT count as free, listeners do not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM hostlist: "node[001-004,007]" -> "node001", "a1,b2" -> "a1",
    "gpu-[1-3]-x" -> "gpu-1-x", "r[1-2]-n[09-12]" -> "r1-n09" (zero padding kept)."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, char in enumerate(text):  # the first entry ends at the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    first = text[:end]
    if not first or depth < 0 or first.count("[") != first.count("]"):
        raise ConfigurationError(
            f"SLURM nodelist {nodelist!r} is not a valid hostlist; set MASTER_ADDR to the host of rank 0 instead"
        )
    # in each bracket group keep the start of its first range: "[001-004,007]" -> "001"
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from SLURM_TASKS_PER_NODE, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ConfigurationError(
                f"SLURM_TASKS_PER_NODE={tasks_per_node!r} is not of the form "
                "'4(x2),3'; set SLURM_NTASKS_PER_NODE or use torchrun"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ConfigurationError(
            f"SLURM_NODEID={node_id} but SLURM_TASKS_PER_NODE={tasks_per_node!r} lists only {len(counts)} nodes"
        )
    return counts[node_id]


def slurm_job_id(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The id ``scontrol requeue`` takes for this SLURM job, or None outside SLURM and in an interactive
    allocation (``srun --pty bash``, ``salloc``: SLURM_JOB_NAME "bash"/"interactive"): a task of a job
    array is "<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>", any other job SLURM_JOB_ID."""
    if "SLURM_JOB_ID" not in environ or environ.get("SLURM_JOB_NAME") in _INTERACTIVE_SLURM_JOB_NAMES:
        return None
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        array, task = environ["SLURM_ARRAY_JOB_ID"].strip(), environ["SLURM_ARRAY_TASK_ID"].strip()
        job, names = f"{array}_{task}", f"SLURM_ARRAY_JOB_ID={array!r}, SLURM_ARRAY_TASK_ID={task!r}"
    else:
        job = environ["SLURM_JOB_ID"].strip()
        names = f"SLURM_JOB_ID={job!r}"
    if not re.fullmatch(r"\d+(_\d+)?", job):
        raise ConfigurationError(
            f"{names} is not a SLURM job id (digits, or <array job>_<task> for a job array); fix the job script "
            "that sets it, or pass Trainer(auto_requeue=False)"
        )
    return job


def slurm_restart_count(environ: Mapping[str, str] = os.environ) -> int:
    """How many times SLURM restarted this job (requeued it): SLURM_RESTART_COUNT, 0 when unset."""
    return _int(environ, "SLURM_RESTART_COUNT", 0, "SLURM") if environ.get("SLURM_RESTART_COUNT") else 0


def _int(environ: Mapping[str, str], name: str, minimum: int = 0, source: str = "") -> int:
    """``environ[name]`` as an int >= minimum; errors name the variable, its value and the fix."""
    where = f" ({source})" if source else ""
    if name not in environ:
        raise ConfigurationError(
            f"{name} is not set{where}; export {name} in the job's environment or launch with `trainforge launch`"
        )
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigurationError(
            f"{name}={raw!r} is not an integer{where}; fix the launcher or job script that sets it"
        ) from None
    if value < minimum:
        raise ConfigurationError(f"{name}={raw!r} must be >= {minimum}{where}")
    return value


def _torchrun(environ: Mapping[str, str]) -> Optional[ClusterEnvironment]:
    elastic = "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ
    if not elastic and not all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    src = "set by torchrun" if elastic else "env:// launch"
    world = _int(environ, "WORLD_SIZE", 1, src)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", 1, src)
    rank = _int(environ, "RANK", 0, src)
    node = _int(environ, "GROUP_RANK", 0, src) if "GROUP_RANK" in environ else rank // local_world
    return ClusterEnvironment(
        "torchrun",
        rank,
        world,
        _int(environ, "LOCAL_RANK", 0, src),
        local_world,
        node,
        _addr(environ, src),
        _int(environ, "MASTER_PORT", 1, src),
    )


def _slurm(environ: Mapping[str, str]) -> Optional[ClusterEnvironment]:
    if "SLURM_NTASKS" not in environ or environ.get("SLURM_JOB_NAME") in _INTERACTIVE_SLURM_JOB_NAMES:
        return None
    world = _int(environ, "SLURM_NTASKS", 1, "SLURM")
    if world == 1:
        return None
    node = _int(environ, "SLURM_NODEID", 0, "SLURM")
    if "SLURM_NTASKS_PER_NODE" in environ:
        local_world = _int(environ, "SLURM_NTASKS_PER_NODE", 1, "SLURM")
    elif "SLURM_TASKS_PER_NODE" in environ:
        local_world = slurm_tasks_on_node(environ["SLURM_TASKS_PER_NODE"], node)
    else:
        raise ConfigurationError(
            "SLURM_NTASKS > 1 but neither SLURM_NTASKS_PER_NODE nor "
            "SLURM_TASKS_PER_NODE is set; run the job step with srun"
        )
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    else:
        nodelist = environ.get("SLURM_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ConfigurationError(
                "SLURM job without SLURM_NODELIST/SLURM_JOB_NODELIST; export MASTER_ADDR=<host of rank 0>"
            )
        addr = slurm_first_host(nodelist)
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT", 1, "SLURM")
    else:
        # Lightning derives the port from the job id so every task of a job agrees without
        # talking; we keep it inside 15000-19999: 15000 + job id mod 5000.
        port = 15000 + _int(environ, "SLURM_JOB_ID", 0, "SLURM, needed for MASTER_PORT") % 5000
    return ClusterEnvironment(
        "slurm",
        _int(environ, "SLURM_PROCID", 0, "SLURM"),
        world,
        _int(environ, "SLURM_LOCALID", 0, "SLURM"),
        local_world,
        node,
        addr,
        port,
    )


def _mpi(environ: Mapping[str, str]) -> Optional[ClusterEnvironment]:
    for names in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ):
        rank_var, size_var, local_var, local_size_var = names
        if size_var not in environ:
            continue
        world = _int(environ, size_var, 1, "MPI")
        if world == 1:
            return None
        hint = (
            f"MPI launch detected ({size_var}={world}) but MASTER_ADDR/MASTER_PORT come from "
            "you: run e.g. `mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ...`"
        )
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in environ:
                raise ConfigurationError(f"{var} is not set. {hint}")
        rank, local_world = _int(environ, rank_var, 0, "MPI"), _int(environ, local_size_var, 1, "MPI")
        return ClusterEnvironment(
            "mpi",
            rank,
            world,
            _int(environ, local_var, 0, "MPI"),
            local_world,
            rank // local_world,
            environ["MASTER_ADDR"],
            _int(environ, "MASTER_PORT", 1, "MPI"),
        )
    return None


def _kubeflow(environ: Mapping[str, str]) -> Optional[ClusterEnvironment]:
    needed = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    if not all(k in environ for k in needed):
        return None
    src = "Kubeflow PyTorchJob"
    node, world = _int(environ, "RANK", 0, src), _int(environ, "WORLD_SIZE", 1, src)
    nproc_raw = environ.get("PET_NPROC_PER_NODE", "1").strip()
    nproc = int(nproc_raw) if nproc_raw.isdigit() and int(nproc_raw) > 0 else 1  # as the operator
    local_rank = _int(environ, "LOCAL_RANK", 0, src) if "LOCAL_RANK" in environ else 0
    if nproc > 1 and "LOCAL_RANK" not in environ:
        raise ConfigurationError(
            f"PET_NPROC_PER_NODE={nproc_raw} asks for {nproc} processes per pod "
            "but this one has no LOCAL_RANK; start the pod's command with "
            "`trainforge launch` (or torchrun), which starts them"
        )
    return ClusterEnvironment(
        "kubeflow",
        node * nproc + local_rank,
        world,
        local_rank,
        nproc,
        node,
        environ["MASTER_ADDR"],
        _int(environ, "MASTER_PORT", 1, src),
    )


def _addr(environ: Mapping[str, str], source: str) -> str:
    addr = environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise ConfigurationError(f"MASTER_ADDR is not set or empty ({source}); export MASTER_ADDR=<host of rank 0>")
    return addr


def _validated(env: ClusterEnvironment, environ: Mapping[str, str]) -> ClusterEnvironment:
    """Cross-checks the values read; errors name the variables to fix."""
    ompi = "OMPI_COMM_WORLD_SIZE" in environ
    names = {
        "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_(N)TASKS_PER_NODE"),
        "mpi": tuple("OMPI_COMM_WORLD_" + n for n in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"))
        if ompi
        else ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        "kubeflow": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PET_NPROC_PER_NODE"),
    }.get(env.kind, ("rank", "world size", "local rank", "local world size"))
    rank_n, world_n, local_n, local_world_n = names
    if env.rank >= env.world_size:
        raise ConfigurationError(
            f"{rank_n}={env.rank} must be < {world_n}={env.world_size} "
            f"({env.kind} environment); fix the launcher settings"
        )
    if env.local_rank >= env.local_world_size:
        raise ConfigurationError(
            f"{local_n}={env.local_rank} must be < {local_world_n}={env.local_world_size} ({env.kind} environment)"
        )
    if env.local_world_size > env.world_size:
        raise ConfigurationError(
            f"{local_world_n}={env.local_world_size} must be <= {world_n}={env.world_size} ({env.kind} environment)"
        )
    if not 0 < env.master_port < 65536:
        raise ConfigurationError(f"MASTER_PORT={env.master_port} is not a TCP port (1-65535)")
    return env
