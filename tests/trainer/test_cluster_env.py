"""Clusters' environment contract for `trainforge launch` (trainer/cli/cluster_env.py) and the example job
files (examples/clusters/).

Each cluster's controller tells the command it starts on every node where that node sits, through variables:
Kubeflow Trainer v2's torch runtime PET_NNODES/PET_NPROC_PER_NODE/PET_NODE_RANK/PET_MASTER_ADDR/PET_MASTER_PORT,
a Kubeflow PyTorchJob the same plus MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK (values as its operator computes
them: WORLD_SIZE = pods x nprocPerNode, RANK = PET_NODE_RANK = the pod's index), SkyPilot SKYPILOT_NUM_NODES/
SKYPILOT_NODE_RANK/SKYPILOT_NODE_IPS/SKYPILOT_NUM_GPUS_PER_NODE. Here two "nodes" of one process each run on
this machine (127.0.0.1, a free port, gloo): each gets only its node's variables and the same command with no
rank flag, and the two must form one job that trains (a short DDP fit) to the same weights on both ranks (for
PyTorchJob, whose variables include Trainer v2's, and SkyPilot: about 7 s each on an idle 2-core machine).
What only a real cluster shows (pods scheduled, DNS names, volumes, restarts) is not tested here.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import procs
from trainforge.strategies.environment import find_free_port
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.cli import main as cli
from trainforge.trainer.cli.cluster_env import cluster_settings
from trainforge.trainer.cli.launch_settings import LAUNCH_CONFIG_ENV

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "cluster_train.py"
EXAMPLES = ROOT / "examples" / "clusters"
CLUSTER_PREFIXES = ("PET_", "SKYPILOT_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK")


def trainer_v2_env(node: int, port: int) -> dict:
    """What the torch runtime's plugin sets (kubeflow/trainer pkg/runtime/framework/plugins/torch)."""
    return {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(node),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
    }


def pytorchjob_env(node: int, port: int) -> dict:
    """What the PyTorchJob operator sets in the pod of replica index ``node`` (Master 0, Worker 0 -> 1) with
    nprocPerNode "1" and no elastic policy, and what Kubernetes sets in every pod (KUBERNETES_PORT)."""
    return {
        "PYTHONUNBUFFERED": "1",
        "KUBERNETES_PORT": "tcp://10.96.0.1:443",
        "MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "RANK": str(node),
        "PET_NODE_RANK": str(node),
        "PET_NPROC_PER_NODE": "1",
        "PET_NNODES": "2",
    }


def skypilot_env(node: int, port: int) -> dict:
    """What SkyPilot sets for ``run`` on each node of a 2-node CPU cluster (no port: the command passes it)."""
    return {
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_RANK": str(node),
        "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
    }


def launch_two_nodes(tmp_path: Path, make_env, launch_args=()) -> list:
    """One `trainforge launch` per node, started together, each with only its node's variables."""
    port = find_free_port()
    base = {k: v for k, v in procs.test_env().items() if not k.startswith(CLUSTER_PREFIXES)}
    base["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    base.pop(LAUNCH_CONFIG_ENV, None)
    started = []
    for node in (0, 1):
        env = {**base, **make_env(node, port)}
        args = [a.replace("{port}", str(port)) for a in launch_args]
        command = [sys.executable, "-m", "trainforge", "launch", *args, str(SCRIPT), "--out", str(tmp_path)]
        started.append(
            subprocess.Popen(
                command,
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # the launcher and its workers: one group, killed together
            )
        )
    outputs = []
    try:
        for proc in started:
            outputs.append(proc.communicate(timeout=90)[0])
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc, output in zip(started, outputs):
        assert proc.returncode == 0, output[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "make_env, launch_args",
    [
        # Kubeflow Trainer v2's variables are a subset of these, with the same values (checked below,
        # test_trainer_v2_and_pytorchjob_variables_resolve_alike): one two-node launch covers both
        (pytorchjob_env, ()),
        # SkyPilot names no port; the head node's address comes from SKYPILOT_NODE_IPS
        (skypilot_env, ("--master-port", "{port}")),
    ],
    ids=["pytorchjob", "skypilot"],
)
def test_each_clusters_variables_alone_make_a_two_node_job_that_trains(tmp_path, make_env, launch_args):
    records = launch_two_nodes(tmp_path, make_env, launch_args)
    assert [(r["rank"], r["node_rank"], r["world_size"]) for r in records] == [(0, 0, 2), (1, 1, 2)]
    assert all(r["strategy"] == "ddp" and r["step"] == 4 and r["changed"] for r in records), records
    assert records[0]["weights"] == records[1]["weights"]


def test_trainer_v2_and_pytorchjob_variables_resolve_alike():
    for node in (0, 1):
        trainer_v2, pytorchjob = trainer_v2_env(node, 29400), pytorchjob_env(node, 29400)
        assert trainer_v2.items() <= pytorchjob.items()
        assert cluster_settings(trainer_v2) == cluster_settings(pytorchjob)
        assert cluster_settings(trainer_v2)[0]["node_rank"] == node


def test_pet_variables_are_the_defaults_of_the_flags_and_flags_win(tmp_path, monkeypatch):
    environ = {**trainer_v2_env(1, 1234), "PET_NPROC_PER_NODE": "auto"}  # what Trainer v2 writes for GPU pods
    settings, family = cluster_settings(environ)
    assert family == "PET_* variables"
    # "auto": one per GPU, else 1 (the test process sees no GPU: tests/conftest.py)
    assert settings == {
        "nnodes": 2,
        "nproc_per_node": 1,
        "node_rank": 1,
        "master_addr": "127.0.0.1",
        "master_port": 1234,
    }
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    from trainforge.trainer.cli.launch import resolve_settings

    parser = cli.build_parser()
    args = parser.parse_args(["launch", "--node-rank", "0", "--master-port", "4321", "s.py"])
    resolved = resolve_settings(args)
    assert (resolved["nnodes"], resolved["node_rank"], resolved["master_port"]) == (2, 0, 4321)


def test_skypilot_variables_give_nodes_rank_head_address_and_gpus():
    environ = {
        "SKYPILOT_NUM_NODES": "3",
        "SKYPILOT_NODE_RANK": "2",
        "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    }
    assert cluster_settings(environ) == (
        {"nnodes": 3, "node_rank": 2, "master_addr": "10.0.0.5", "nproc_per_node": 8},
        "SKYPILOT_* variables",
    )
    assert cluster_settings({}) == ({}, "")


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"PET_NNODES": "2", "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 must be < PET_NNODES=2"),
        ({"PET_NNODES": "two"}, "PET_NNODES='two' must be an integer >= 1"),
        ({"PET_NODE_RANK": "-1"}, "PET_NODE_RANK='-1' must be an integer >= 0"),
        ({"PET_MASTER_PORT": "70000"}, "PET_MASTER_PORT='70000' must be an integer >= 1 and <= 65535"),
        ({"PET_NPROC_PER_NODE": "gpu"}, "PET_NPROC_PER_NODE='gpu' asks for one process per GPU"),
        ({"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "5"}, "SKYPILOT_NODE_RANK=5 must be < SKYPILOT_NUM_NODES=2"),
        ({"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "10.0.0.1"}, "SKYPILOT_NODE_IPS lists 1 address(es)"),
        ({"SKYPILOT_NUM_NODES": "x"}, "SKYPILOT_NUM_NODES='x' must be an integer >= 1"),
    ],
)
def test_contradictory_or_malformed_variables_name_the_variable_value_and_fix(environ, message):
    with pytest.raises(ConfigurationError) as error:
        cluster_settings(environ)
    assert message in str(error.value)
    assert "fix it there, or pass --" in str(error.value)


def test_a_bad_variable_ends_launch_with_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    def started(*args, **kwargs):
        raise AssertionError("torchrun was started: the launch should have been refused before")

    monkeypatch.setattr("torch.distributed.run.run", started)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_NODE_RANK", "3")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("raise SystemExit('must not run')\n")
    assert cli.main(["launch", "s.py"]) == 2
    err = capsys.readouterr().err
    assert "PET_NODE_RANK=3 must be < PET_NNODES=2" in err and "--node-rank" in err and "Traceback" not in err
    # a flag that contradicts the variables is checked with them, and the message says where they came from
    monkeypatch.setenv("PET_NODE_RANK", "1")
    assert cli.main(["launch", "--nnodes", "1", "s.py"]) == 2
    assert "node_rank=1 must be < nnodes=1 (config file, PET_* variables and flags)" in capsys.readouterr().err


def _command(container_or_trainer: dict) -> list:
    return [str(part) for part in container_or_trainer["command"]]


def _is_trainforge_launch(command: list) -> bool:
    start = command.index("launch") if "launch" in command else -1
    return start > 0 and "trainforge" in command[start - 1] and "examples/char_gpt.py" in command[start:]


def test_trainjob_manifest_has_what_kubeflow_trainer_requires():
    job = yaml.safe_load((EXAMPLES / "kubeflow-trainjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["metadata"]["name"]
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert isinstance(trainer["numNodes"], int) and trainer["numNodes"] >= 1
    assert _is_trainforge_launch(_command(trainer))
    # the torch runtime sets these itself and refuses a TrainJob that sets them
    assert not {e["name"] for e in trainer.get("env", [])} & {"PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR"}
    assert not {"--nnodes", "--node-rank", "--master-addr"} & set(_command(trainer))


def test_pytorchjob_manifest_has_what_the_training_operator_requires():
    job = yaml.safe_load((EXAMPLES / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    for spec in specs.values():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        containers = spec["template"]["spec"]["containers"]
        pytorch = [c for c in containers if c["name"] == "pytorch"]  # the container the operator configures
        assert len(pytorch) == 1 and _is_trainforge_launch(_command(pytorch[0]))
    assert str(job["spec"]["nprocPerNode"]).isdigit()


def test_skypilot_task_runs_trainforge_launch_on_every_node_with_its_variables():
    task = yaml.safe_load((EXAMPLES / "skypilot.yaml").read_text())
    assert isinstance(task["num_nodes"], int) and task["num_nodes"] >= 2
    run = task["run"]
    assert "trainforge launch" in run and "examples/char_gpt.py" in run
    for variable in ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE"):
        assert "$" + variable in run, variable


def _char_gpt_args(command: list) -> list:
    return command[command.index("examples/char_gpt.py") + 1 :]


def test_the_job_files_give_char_gpt_arguments_it_accepts_and_resume_when_a_checkpoint_exists(monkeypatch):
    """A job's command is the same at its first start and at every restart: `--resume auto` (resume when there
    is a checkpoint, else start fresh), not `--resume` (which requires one)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import char_gpt

    trainjob = yaml.safe_load((EXAMPLES / "kubeflow-trainjob.yaml").read_text())["spec"]["trainer"]
    pytorchjob = yaml.safe_load((EXAMPLES / "pytorchjob.yaml").read_text())["spec"]["pytorchReplicaSpecs"]
    skypilot = yaml.safe_load((EXAMPLES / "skypilot.yaml").read_text())["run"].split()
    commands = [_command(trainjob), _command(pytorchjob["Master"]["template"]["spec"]["containers"][0]), skypilot]
    for command in commands:
        assert char_gpt.parse_args(_char_gpt_args(command)).resume == "auto", command
    assert char_gpt.parse_args(["--resume"]).resume == "last"  # as before: a checkpoint is required
    assert char_gpt.parse_args([]).resume is None
