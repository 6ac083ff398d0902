"""detect_environment() on prepared environments (plain dicts, nothing mocked)."""

import socket

import pytest
import torch

from trainforge.strategies.environment import (
    ClusterEnvironment,
    default_backend,
    detect_environment,
    port_is_free,
    slurm_first_host,
    slurm_tasks_on_node,
)
from trainforge.strategies.errors import ConfigurationError

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job",
}
SLURM = {
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_NODELIST": "node[007-008]",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NAME": "train",
}


def test_torchrun_reads_every_variable():
    env = detect_environment(TORCHRUN)
    assert env == ClusterEnvironment("torchrun", 5, 8, 1, 4, 1, "10.0.0.1", 29400)
    assert env.is_distributed
    assert env.as_env() == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }


def test_plain_env_launcher_counts_as_torchrun_and_node_rank_is_derived():
    environ = {k: v for k, v in TORCHRUN.items() if k not in ("GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env = detect_environment(environ)
    assert (env.kind, env.rank, env.node_rank) == ("torchrun", 5, 1)


def test_slurm_first_host_and_port_from_job_id():
    env = detect_environment(SLURM)
    assert env == ClusterEnvironment("slurm", 6, 8, 2, 4, 1, "node007", 15000 + 123456 % 5000)
    assert 15000 <= env.master_port <= 19999


def test_slurm_explicit_master_and_tasks_per_node():
    env = detect_environment(
        {
            **SLURM,
            "MASTER_ADDR": "head",
            "MASTER_PORT": "1234",
            "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_TASKS_PER_NODE": "garbage",
        }
    )
    assert (env.master_addr, env.master_port, env.local_world_size) == ("head", 1234, 4)


def test_slurm_uneven_tasks_per_node():
    env = detect_environment(
        {
            **SLURM,
            "SLURM_NTASKS": "7",
            "SLURM_TASKS_PER_NODE": "2(x3),1",
            "SLURM_NODEID": "3",
            "SLURM_PROCID": "6",
            "SLURM_LOCALID": "0",
        }
    )
    assert (env.local_world_size, env.node_rank) == (1, 3)
    assert slurm_tasks_on_node("2(x3),1", 0) == 2


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node[001-004,007]", "node001"),
        ("a1,b2", "a1"),
        ("gpu-[1-3]-x", "gpu-1-x"),
        ("rack[1-2]-n[09-12],other", "rack1-n09"),
        ("n[3,5],g[1-2]", "n3"),
        ("solo", "solo"),
    ],
)
def test_slurm_nodelist_forms(nodelist, first):
    assert slurm_first_host(nodelist) == first
    assert detect_environment({**SLURM, "SLURM_NODELIST": nodelist}).master_addr == first


def test_slurm_job_nodelist_is_used_when_nodelist_is_absent():
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    assert detect_environment({**environ, "SLURM_JOB_NODELIST": "x[10-11]"}).master_addr == "x10"


def test_openmpi_and_mpich():
    ompi = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "2000",
    }
    assert detect_environment(ompi) == ClusterEnvironment("mpi", 3, 4, 1, 2, 1, "h0", 2000)
    mpich = {
        "PMI_RANK": "2",
        "PMI_SIZE": "3",
        "MPI_LOCALRANKID": "2",
        "MPI_LOCALNRANKS": "3",
        "MASTER_ADDR": "h1",
        "MASTER_PORT": "2001",
    }
    assert detect_environment(mpich) == ClusterEnvironment("mpi", 2, 3, 2, 3, 0, "h1", 2001)


def test_mpi_without_master_addr_says_what_to_set():
    with pytest.raises(ConfigurationError, match=r"MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        detect_environment(
            {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "1"}
        )


def test_kubeflow_rank_is_the_pod_and_world_counts_processes():
    pod = {
        "KUBERNETES_PORT": "tcp://10.96.0.1:443",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "3",
        "RANK": "2",
    }
    assert detect_environment(pod) == ClusterEnvironment("kubeflow", 2, 3, 0, 1, 2, "job-master-0", 23456)
    with pytest.raises(ConfigurationError, match="PET_NPROC_PER_NODE=4.*trainforge launch"):
        detect_environment({**pod, "WORLD_SIZE": "12", "PET_NPROC_PER_NODE": "4"})


def test_single_process_defaults():
    env = detect_environment({})
    assert (env.kind, env.rank, env.world_size, env.master_addr) == ("single", 0, 1, "127.0.0.1")
    assert not env.is_distributed and 0 < env.master_port < 65536
    assert detect_environment({"MASTER_PORT": "4321"}).master_port == 4321


def test_precedence_torchrun_over_slurm_over_mpi_over_kubeflow():
    mpi = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "m",
        "MASTER_PORT": "1",
    }
    kube = {"KUBERNETES_PORT": "x", "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "m", "MASTER_PORT": "1"}
    assert detect_environment({**SLURM, **TORCHRUN}).kind == "torchrun"
    assert detect_environment({**mpi, **SLURM}).kind == "slurm"
    assert detect_environment({**kube, **mpi}).kind == "mpi"
    assert detect_environment(kube).kind == "kubeflow"


@pytest.mark.parametrize("override", [{"SLURM_NTASKS": "1"}, {"SLURM_JOB_NAME": "bash"}])
def test_slurm_single_task_or_interactive_shell_is_not_distributed(override):
    assert detect_environment({**SLURM, **override}).kind == "single"


@pytest.mark.parametrize(
    "override, message",
    [
        ({"RANK": "8"}, "RANK=8 must be < WORLD_SIZE=8"),
        ({"RANK": "-1"}, "RANK='-1' must be >= 0"),
        ({"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
        ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 must be < LOCAL_WORLD_SIZE=4"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set or empty"),
    ],
)
def test_bad_torchrun_values_name_the_variable(override, message):
    with pytest.raises(ConfigurationError, match=message):
        detect_environment({**TORCHRUN, **override})


def test_bad_slurm_values_name_the_variable():
    with pytest.raises(ConfigurationError, match="SLURM_PROCID=8 must be < SLURM_NTASKS=8"):
        detect_environment({**SLURM, "SLURM_PROCID": "8"})
    with pytest.raises(ConfigurationError, match="SLURM_TASKS_PER_NODE='4x2'"):
        detect_environment({**SLURM, "SLURM_TASKS_PER_NODE": "4x2"})
    with pytest.raises(ConfigurationError, match="not a valid hostlist"):
        detect_environment({**SLURM, "SLURM_NODELIST": "node[1-2"})


def test_default_backend():
    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend("cuda:1") == "nccl"


def test_port_is_free_sees_a_listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not port_is_free(port)
    assert port_is_free(port)
