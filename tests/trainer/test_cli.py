"""The trainforge CLI. Launches run as `python -m trainforge launch ...` subprocesses (real torchrun, gloo,
2 ranks); what ends before anything starts (`config`, refused launches) runs `cli.main` in this process,
with torchrun's `run` replaced by a failure, so that a refusal that broke cannot start a job here."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.cli import main as cli
from trainforge.trainer.cli.config import resolve_answers
from trainforge.trainer.cli.launch import resolve_settings, torchrun_argv
from trainforge.trainer.cli.launch_settings import LAUNCH_CONFIG_ENV, launch_defaults, save_config

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_cli(args, tmp_path, timeout=120, stdin=None, **env_extra):
    """`python -m trainforge ARGS` with an isolated config home; the whole process group dies on timeout."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), **env_extra}
    env.pop(LAUNCH_CONFIG_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainforge", *map(str, args)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def cli_here(tmp_path, monkeypatch, capsys):
    """`trainforge ARGS` as `cli.main` in this process, in ``tmp_path`` with an isolated config home, as
    ``run_cli`` runs it: the exit code, stdout and stderr. torchrun never starts: it raises instead."""

    def started(*args, **kwargs):
        raise AssertionError("torchrun was started: the launch should have been refused before")

    monkeypatch.setattr("torch.distributed.run.run", started)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(LAUNCH_CONFIG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)

    def run(args, stdin=None):
        capsys.readouterr()
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        code = cli.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["trainforge", *args], code, out, err)

    return run


@pytest.mark.slow
def test_launch_two_ranks_all_reduce_with_config_defaults_and_flag_overrides(tmp_path):
    save_config(
        {"nproc_per_node": 1, "strategy": "ddp", "precision": "bf16-mixed", "gradient_accumulation_steps": 4},
        tmp_path / "xdg" / "trainforge" / "default_config.yaml",
    )
    out = tmp_path / "out"
    out.mkdir()
    result = run_cli(
        ["launch", "--nproc-per-node", "2", "--precision", "16-mixed", SCRIPTS / "cli_allreduce.py", "--out", out],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert (record["rank"], record["world_size"], record["kind"]) == (rank, 2, "torchrun")
        assert record["sum"] == 1.0 + 2.0  # ranks contribute rank + 1
        # strategy and accumulation from the file, precision from the flag that overrides it
        assert record["defaults"] == {"strategy": "ddp", "precision": "16-mixed", "gradient_accumulation_steps": 4}
        assert record["argv"] == [str(SCRIPTS / "cli_allreduce.py"), "--out", str(out)]
        assert record["sys_path0"] == str(SCRIPTS)


@pytest.mark.slow
def test_crashing_rank_fails_the_job_fast_with_its_traceback(tmp_path):
    crash_time = tmp_path / "crash_time"
    result = run_cli(["launch", "--nproc-per-node", "2", SCRIPTS / "cli_crash.py", crash_time], tmp_path)
    ended = time.time()
    assert result.returncode == 1  # the failed rank's exit code
    # rank 0 sleeps 120 s: the job must end soon after rank 1 crashed, not when rank 0 wakes up
    assert ended - float(crash_time.read_text()) < 30
    output = result.stdout + result.stderr
    assert "RuntimeError: rank one exploded on purpose" in output
    assert "rank 1 (local rank 1) failed" in result.stderr
    assert "rank      : 1 (local_rank: 1)" in result.stderr  # torchrun's root-cause summary


def test_master_port_in_use_is_refused_before_start(cli_here):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli_here(["launch", "--nproc-per-node", "2", "--master-port", port, SCRIPTS / "cli_crash.py"])
    assert result.returncode == 2
    assert f"master port {port} is already in use" in result.stderr
    assert "--master-port" in result.stderr
    assert "exploded" not in result.stdout + result.stderr  # nothing was started
    assert "Traceback" not in result.stderr


def test_config_non_interactive_writes_flags_and_defaults(tmp_path, cli_here):
    target = tmp_path / "cfg.yaml"
    result = cli_here(
        [
            "config",
            "--non-interactive",
            "--config-file",
            target,
            "--strategy",
            "deepspeed",
            "--zero-stage",
            "3",
            "--offload-param-device",
            "cpu",
            "--precision",
            "bf16",
            "--nproc-per-node",
            "2",
            "--accelerator",
            "cpu",
        ]
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(target.read_text()) == {
        "compute_environment": "this_machine",
        "accelerator": "cpu",
        "nproc_per_node": 2,
        "strategy": "deepspeed",
        "deepspeed": {"zero_stage": 3, "offload_optimizer_device": "none", "offload_param_device": "cpu"},
        "precision": "bf16-mixed",
        "gradient_accumulation_steps": 1,
    }


def test_config_interactive_reasks_bad_answers_and_writes_default_location(tmp_path, cli_here):
    answers = [
        "multi_node",
        "3",
        "3",
        "1",
        "head-node",
        "",
        "c10d",
        "cpu",
        "0",
        "4",
        "zero",
        "fsdp",
        "SHARD_GRAD_OP",
        "fp17",
        "fp16",
        "bf16",
        "8",
    ]  # "" takes the default; bad answers are re-asked
    result = cli_here(["config", "--interactive"], stdin="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stderr
    assert "node_rank=3 must be < nnodes=3" in result.stdout
    assert "nproc_per_node='0' must be an integer >= 1" in result.stdout
    assert "strategy='zero' is not one of: auto, single, ddp" in result.stdout
    assert "precision='fp17' is not one of" in result.stdout
    assert "precision='16-mixed' needs a GPU, but accelerator='cpu'" in result.stdout  # launch would refuse it
    written = yaml.safe_load((tmp_path / "xdg" / "trainforge" / "default_config.yaml").read_text())
    assert written == {
        "compute_environment": "multi_node",
        "nnodes": 3,
        "node_rank": 1,
        "master_addr": "head-node",
        "master_port": 29500,
        "rdzv_backend": "c10d",
        "accelerator": "cpu",
        "nproc_per_node": 4,
        "strategy": "fsdp",
        "fsdp": {"sharding_strategy": "SHARD_GRAD_OP"},
        "precision": "bf16-mixed",
        "gradient_accumulation_steps": 8,
    }


def test_interactive_questions_give_up_after_bounded_bad_answers():
    replies, said = iter(["bad"] * 10), []
    with pytest.raises(ConfigurationError, match="no valid answer for 'compute_environment' after 3"):
        resolve_answers({}, interactive=True, ask=lambda prompt: next(replies), say=said.append)
    assert len(said) == 3


def test_env_reports_versions_and_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    save_config({"strategy": "ddp"}, tmp_path / "trainforge" / "default_config.yaml")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"- torch version: {torch.__version__}" in out
    assert f"- CPU count: {os.cpu_count()}" in out
    assert "    strategy: ddp" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["launch", "--strategy", "ddpp", "s.py"], "--strategy='ddpp' is not one of: auto, single, ddp, fsdp"),
        (["launch", "--precision", "fp17", "s.py"], "--precision='fp17' is not one of: 32, 16-mixed, bf16-mixed"),
        (["launch", "--nproc-per-node", "0", "s.py"], "--nproc-per-node='0' must be an integer >= 1"),
        (["launch", "--nproc-per-node", "two", "s.py"], "--nproc-per-node='two' must be an integer >= 1"),
        (["launch"], "no training script given"),
        (["launch", "missing_script.py"], "script 'missing_script.py' does not exist"),
        (["launch", "--config-file", "nope.yaml", "s.py"], "config file 'nope.yaml' does not exist"),
        (["launch", "--nnodes", "2", "--node-rank", "2", "s.py"], "node_rank=2 must be < nnodes=2"),
        (["config", "--non-interactive", "--zero-stage", "4"], "--zero-stage='4' must be an integer >= 0 and <= 3"),
        (
            ["config", "--non-interactive", "--strategy", "deepspeed", "--offload-param-device", "cpu"],
            "offload_param_device='cpu' needs zero_stage=3",
        ),
        (
            # a DeepSpeed flag under another strategy would be ignored without a word
            ["launch", "--strategy", "fsdp", "--zero-stage", "3", "s.py"],
            "--zero-stage is a DeepSpeed setting, but strategy='fsdp'",
        ),
        (["launch", "--zero-stage", "2", "s.py"], "--zero-stage is a DeepSpeed setting, but strategy=None"),
    ],
)
def test_bad_inputs_are_reported_without_traceback(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("raise SystemExit('must not run')\n")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_files_that_cannot_be_written_are_one_line_without_traceback(tmp_path, monkeypatch, capsys):
    """Issue 25: `config --config-file` under a regular file ended in a FileExistsError traceback; any
    OSError of a subcommand is one line now (exit 1), ours stay exit 2."""
    (tmp_path / "file").write_text("not a directory")  # root ignores permission bits: a file parent blocks all
    bad = str(tmp_path / "file" / "x.yaml")
    assert cli.main(["config", "--non-interactive", "--config-file", bad]) == 2
    err = capsys.readouterr().err
    assert f"trainforge config: error: --config-file={bad!r} cannot be written (File exists: " in err
    assert "give a path in a directory you can write to" in err and "Traceback" not in err

    def unreadable(args):
        open(tmp_path / "file" / "y")

    monkeypatch.setattr(cli.importlib.import_module(cli.COMMANDS["env"]), "run", unreadable)
    assert cli.main(["env"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"trainforge env: error: Not a directory: {str(tmp_path / 'file' / 'y')!r}"


def test_unknown_key_in_config_file_is_named(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.yaml").write_text("strategy: ddp\nprecison: bf16\n")
    (tmp_path / "s.py").write_text("")
    assert cli.main(["launch", "--config-file", str(tmp_path / "bad.yaml"), str(tmp_path / "s.py")]) == 2
    assert "'precison' is not one of" in capsys.readouterr().err


def test_torchrun_arguments_are_torchruns_own(tmp_path, monkeypatch):
    import torch.distributed.run as torchrun

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name in ("PET_NNODES", "PET_MASTER_PORT", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    parser = cli.build_parser()
    args = parser.parse_args(
        ["launch", "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.5", "train.py", "--lr", "1"]
    )
    parsed = torchrun.parse_args(torchrun_argv(resolve_settings(args), args.script, args.script_args))
    assert (parsed.nproc_per_node, parsed.max_restarts, parsed.monitor_interval) == ("2", 3, 0.5)
    assert parsed.standalone and parsed.module  # free port on one node; script under the bootstrap
    assert (parsed.training_script, parsed.training_script_args) == (
        "trainforge.trainer.cli.bootstrap",
        ["train.py", "--lr", "1"],
    )
    args = parser.parse_args(
        ["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "1234", "train.py"]
    )
    parsed = torchrun.parse_args(torchrun_argv(resolve_settings(args), args.script, args.script_args))
    assert not parsed.standalone
    assert (parsed.nnodes, parsed.node_rank, parsed.master_addr, parsed.master_port) == ("2", 1, "h0", 1234)


def test_launch_defaults_empty_outside_launch_and_read_inside(tmp_path):
    assert launch_defaults({}) == {}
    path = save_config(
        {"nproc_per_node": 2, "strategy": "deepspeed", "deepspeed.zero_stage": 2}, tmp_path / "resolved.yaml"
    )
    assert launch_defaults({LAUNCH_CONFIG_ENV: str(path)}) == {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2}}
    with pytest.raises(ConfigurationError, match="does not exist"):
        launch_defaults({LAUNCH_CONFIG_ENV: str(tmp_path / "gone.yaml")})


def test_waiting_message_names_what_where_and_how_long():
    from trainforge.trainer.cli.launch import waiting_message

    assert waiting_message({"nnodes": 1}, environ={}) is None
    text = waiting_message({"nnodes": 2, "node_rank": 0, "master_addr": "10.0.0.1", "master_port": 29999}, environ={})
    assert "node 0 of 2: waiting for all 2 nodes to join at 10.0.0.1:29999, up to 600 s" in text
    assert "--node-rank" in text
    elastic = waiting_message({"nnodes": "2:4", "rdzv_backend": "c10d", "rdzv_endpoint": "h:1"}, environ={})
    assert "h:1 (c10d rendezvous)" in elastic


@pytest.mark.slow
def test_launch_of_two_nodes_says_what_it_waits_for_before_waiting(tmp_path):
    """`launch --nnodes 2` without the other node must not wait silently."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "train.py").write_text("print('never started')\n")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    env.pop(LAUNCH_CONFIG_ENV, None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainforge",
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "train.py",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline, seen = time.monotonic() + 90, ""
        while "waiting for all 2 nodes" not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stderr.readline()
        assert f"node 0 of 2: waiting for all 2 nodes to join at 127.0.0.1:{port}" in seen, seen[-2000:]
        assert proc.poll() is None  # still waiting for the other node, as it said
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.slow
def test_launch_reads_the_megatron_section_the_readme_documents(tmp_path, cli_here):
    """`megatron: {tensor_parallel_size: 2}` in a config file reaches MegatronStrategy (not refused by launch)."""
    config = tmp_path / "mg.yaml"
    config.write_text("strategy: megatron\nnproc_per_node: 2\nmegatron: {tensor_parallel_size: 2}\n")
    (tmp_path / "s.py").write_text(
        "from trainforge import Accelerator\na = Accelerator()\n"
        # one write per rank: the two ranks share the pipe unbuffered, print's separate pieces interleaved
        "import sys\nsys.stdout.write(f'STRAT {type(a.strategy).__name__} {a.strategy.sizes[\"tp\"]}\\n')\n"
    )
    result = run_cli(["launch", "--config-file", config, "s.py"], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("STRAT MegatronStrategy 2") == 2
    (tmp_path / "bad.yaml").write_text("strategy: ddp\nmegatron: {tensor_parallel_size: 2}\n")
    refused = cli_here(["launch", "--config-file", tmp_path / "bad.yaml", "s.py"])
    assert (
        refused.returncode == 2
        and "a megatron section (MegatronStrategy arguments) needs strategy megatron" in refused.stderr
    )
    (tmp_path / "typo.yaml").write_text("strategy: megatron\nmegatron: {tp_size: 2}\n")
    typo = cli_here(["launch", "--config-file", tmp_path / "typo.yaml", "s.py"])
    assert typo.returncode == 2 and "megatron.tp_size" in typo.stderr and "tensor_parallel_size" in typo.stderr
