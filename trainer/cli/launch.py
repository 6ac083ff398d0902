"""``trainforge launch``: starts the processes of a job with torch.distributed.run (torchrun).

We build torchrun's own argument list and call its ``parse_args``/``run`` in this process (as HF
Accelerate's launcher does), so rendezvous, elastic restarts (``--max-restarts``), signal
forwarding and killing the other ranks when one fails are torchrun's tested code, not ours. What
we add:

- settings from the config file, overridden by flags, validated before anything starts, written
  to a temporary YAML file whose path the workers get as ``TRAINFORGE_LAUNCH_CONFIG``;
- under Kubeflow (Trainer v2 TrainJob, PyTorchJob) or SkyPilot, the node count, node rank and master
  address their controllers set (PET_*, SKYPILOT_*) as the flags' defaults, checked, each error naming the
  variable (``trainforge.trainer.cli.cluster_env``);
- single node without ``--master-port``: torchrun's ``--standalone`` rendezvous on a free port,
  so concurrent jobs on one machine do not collide;
- an explicit master port already in use on node 0 is reported before any process starts;
- the script runs through ``trainforge.trainer.cli.bootstrap`` (torch elastic ``@record``), so a crashing rank's
  traceback reaches the failure summary, and the exit code is non-zero.

``--xla`` starts the processes with torch_xla's launcher instead (``trainforge.trainer.cli.launch_xla``).

Stop signals: SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 reaching the launcher are forwarded to
the workers (torchrun's ``--signals-to-handle``, torch >= 2.9), which get ``--shutdown-timeout`` seconds
(torch >= 2.12; else 30) to save their stop step (``trainer/cluster/stop_signals.py``) before torchrun SIGKILLs them.
A worker whose launcher dies (SIGKILLed after the SIGTERM it forwarded) ends too (``watch_launcher``), instead of
living on as an orphan stuck in a collective.

Exit codes: 0 success, 1 (or the failed rank's code) when a worker failed, 2 bad arguments, 128 + N
when the launcher got signal N, or when every worker stopped on signal N after its checkpoint, 124 when a
rank's hang watchdog ended it (``Trainer(hang_timeout=...)``; the summary names the ranks that were behind
and each rank's stack file: ``strategies/watchdog.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from typing import Any, List, Mapping, Optional, Sequence

from trainforge.strategies.environment import STOP_GRACE_ENV, port_is_free, temporary_environ
from trainforge.strategies.errors import ConfigurationError, LaunchError
from trainforge.strategies.watchdog import HANG_EXIT_CODE, hang_summary
from trainforge.trainer.cli.cluster_env import cluster_settings
from trainforge.trainer.cli.launch_settings import (
    add_setting_arguments,
    default_config_path,
    flags_given,
    load_config,
    settings_for_workers,
    validate,
)
from trainforge.trainer.cli.launch_xla import run_xla
from trainforge.trainer.cluster.stuck_process import LAUNCHER_PID_ENV

HELP = "run a training script on N processes per node (torchrun underneath)"
TORCHRUN_DEFAULT_PORT = 29500
_TORCHRUN_FLAGS = (
    ("nproc_per_node", "--nproc-per-node"),
    ("nnodes", "--nnodes"),
    ("node_rank", "--node-rank"),
    ("master_addr", "--master-addr"),
    ("master_port", "--master-port"),
    ("rdzv_backend", "--rdzv-backend"),
    ("rdzv_endpoint", "--rdzv-endpoint"),
    ("max_restarts", "--max-restarts"),
    ("monitor_interval", "--monitor-interval"),
    ("shutdown_timeout", "--shutdown-timeout"),
)
# torchrun's default SIGTERM, SIGINT, SIGHUP, SIGQUIT, and SLURM's warning signals (--signal=USR1@90):
# the launcher forwards each to every worker's process group and waits --shutdown-timeout seconds
# (torch's default: 30) for them to save and exit before it SIGKILLs them (trainer/cluster/stop_signals.py).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config-file", default=None, help=f"settings file (default: {default_config_path()} when it exists)"
    )
    add_setting_arguments(parser)
    parser.add_argument(
        "--xla",
        action="store_true",
        help="run on XLA devices (TPU; XLA:CPU with PJRT_DEVICE=CPU) with torch_xla's launcher (PJRT), "
        "one process per local device, strategy 'xla'; needs torch_xla (default: off, torchrun starts the processes)",
    )
    parser.add_argument("script", nargs="?", help="the training script, run as `python script.py args` on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def resolve_settings(args: argparse.Namespace) -> dict:
    """Config file values (``--config-file`` or the default file when present), then what a cluster's
    controller set in the environment (PET_*, SKYPILOT_*: trainer/cli/cluster_env.py), then flags."""
    default_file = default_config_path()
    if args.config_file:
        settings = load_config(args.config_file)
    else:
        settings = load_config(default_file) if default_file.is_file() else {}
    from_cluster, family = cluster_settings()
    settings.update(from_cluster)
    settings.update(flags_given(args))
    return validate(settings, f"config file, {family} and flags" if family else "config file and flags")


def _effective(settings: Mapping[str, Any], key: str, environ: Mapping[str, str]) -> Any:
    """A setting as torchrun will see it: ours, else its PET_* environment default (Kubeflow sets those)."""
    return settings.get(key, environ.get("PET_" + key.upper()))


def uses_standalone(settings: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> bool:
    """One node and no rendezvous address given: let torchrun pick a free port."""
    nnodes = str(_effective(settings, "nnodes", environ) or 1)
    return (
        nnodes in ("1", "1:1")
        and _effective(settings, "master_port", environ) is None
        and not _effective(settings, "rdzv_endpoint", environ)
        and _effective(settings, "rdzv_backend", environ) in (None, "static")
    )


def torchrun_argv(settings: Mapping[str, Any], script: str, script_args: Sequence[str]) -> List[str]:
    """torchrun's command line for these settings; the script runs under ``trainforge.trainer.cli.bootstrap``."""
    argv: List[str] = []
    for key, flag in _TORCHRUN_FLAGS:
        if key in settings:
            argv += [flag, str(settings[key])]
    if uses_standalone(settings):
        argv.append("--standalone")
    if torchrun_accepts("signals_to_handle"):  # torch >= 2.9; before, SIGUSR1 ends the launcher alone
        argv += ["--signals-to-handle", FORWARDED_SIGNALS]
    return argv + ["--module", "trainforge.trainer.cli.bootstrap", script, *script_args]


def torchrun_accepts(option: str) -> bool:
    """Whether this torch's torchrun has ``option`` (a field of its LaunchConfig, e.g. shutdown_timeout)."""
    from torch.distributed.launcher.api import LaunchConfig

    return option in {field.name for field in dataclasses.fields(LaunchConfig)}


def check_shutdown_timeout(settings: Mapping[str, Any]) -> None:
    """``--shutdown-timeout`` needs a torchrun that has it (torch 2.12); older ones always wait 30 s."""
    if settings.get("shutdown_timeout") is not None and not torchrun_accepts("shutdown_timeout"):
        import torch

        raise ConfigurationError(
            f"--shutdown-timeout {settings['shutdown_timeout']} needs torchrun's --shutdown-timeout, which torch "
            f"{torch.__version__} lacks (torch >= 2.12 has it): its launcher gives the workers 30 s after a stop "
            "signal before SIGKILL. Upgrade torch, or leave --shutdown-timeout out"
        )


def check_master_port(settings: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> None:
    """On node 0 of a static rendezvous, the master port must be free before we start anything."""
    if uses_standalone(settings, environ) or (_effective(settings, "rdzv_backend", environ) or "static") != "static":
        return
    if int(_effective(settings, "node_rank", environ) or 0) != 0:
        return
    port = int(_effective(settings, "master_port", environ) or TORCHRUN_DEFAULT_PORT)
    if not port_is_free(port):
        raise LaunchError(
            f"master port {port} is already in use on this machine (another job or "
            f"process listens on it). Fix: pass a different --master-port, or on a "
            f"single node leave --master-port out to pick a free port automatically"
        )


def waiting_message(settings: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """What a multi-node launch waits for, where and how long, printed before it waits (a silent wait for a
    node that never comes looks like a hang: tests/trainer/test_cli.py,
    ``test_launch_of_two_nodes_says_what_it_waits_for_before_waiting``); None on one node."""
    nnodes = str(_effective(settings, "nnodes", environ) or 1)
    if nnodes in ("1", "1:1"):
        return None
    backend = _effective(settings, "rdzv_backend", environ) or "static"
    if backend == "static":
        where = (
            f"{_effective(settings, 'master_addr', environ) or '127.0.0.1'}:"
            f"{_effective(settings, 'master_port', environ) or TORCHRUN_DEFAULT_PORT}"
        )
        how_long = "up to 600 s (torch's static rendezvous timeout)"
        rank = f"node {_effective(settings, 'node_rank', environ) or 0} of {nnodes}"
    else:
        where = f"{_effective(settings, 'rdzv_endpoint', environ) or '(no --rdzv-endpoint)'} ({backend} rendezvous)"
        how_long = "until the rendezvous times out (--rdzv-conf timeout=...)"
        rank = f"a node of {nnodes}"
    return (
        f"trainforge launch: {rank}: waiting for all {nnodes} nodes to join at {where}, {how_long}. "
        "Start the same command on every other node (its own --node-rank, the same --master-addr and "
        "--master-port); Ctrl-C stops the wait."
    )


def run(args: argparse.Namespace) -> int:
    settings = resolve_settings(args)
    if args.script is None:
        raise ConfigurationError(
            "no training script given; usage: trainforge launch [options] script.py [script args...]"
        )
    if not os.path.isfile(args.script):
        raise ConfigurationError(
            f"script {args.script!r} does not exist (working directory "
            f"{os.getcwd()}); give the path of your training script"
        )
    if getattr(args, "xla", False):
        return run_xla(settings, flags_given(args), args.script, args.script_args)
    if settings.get("strategy") == "xla":
        raise ConfigurationError(
            "strategy 'xla' runs one process per XLA device started by torch_xla's launcher: "
            "use `trainforge launch --xla script.py` (torchrun does not start XLA processes)"
        )
    check_master_port(settings)
    check_shutdown_timeout(settings)
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parsed = torchrun.parse_args(torchrun_argv(settings, args.script, args.script_args))
    waiting = waiting_message(settings)
    if waiting:
        print(waiting, file=sys.stderr, flush=True)
    # what a worker has after a forwarded stop signal before torchrun SIGKILLs it (ModelCheckpoint compares
    # its saves against it): --shutdown-timeout, else torchrun's 30 s
    grace = {STOP_GRACE_ENV: str(settings.get("shutdown_timeout") or 30)}
    # a worker whose launcher died (SIGTERM then SIGKILL, as `timeout` and schedulers stop a job) ends too
    grace[LAUNCHER_PID_ENV] = str(os.getpid())
    with settings_for_workers(settings), temporary_environ(grace):  # read by every worker torchrun starts
        try:
            torchrun.run(parsed)
        except ChildFailedError as error:
            rank, failure = error.get_first_failure()
            stop = _stop_signal_of(failure.exitcode)
            if stop is not None:  # the others got there too (they agreed on the step) or are stopped now
                print(
                    f"trainforge launch: the workers stopped on {stop} (exit code {failure.exitcode} = 128 + "
                    f"{stop}: a stop signal, after the stop step's checkpoint; see the log above). Resume with "
                    "Trainer(resume='auto')",
                    file=sys.stderr,
                )
                return failure.exitcode
            print(error.format_msg(), file=sys.stderr)
            hung = {r: _message(f.message) for r, f in error.failures.items() if f.exitcode == HANG_EXIT_CODE}
            summary = hang_summary(hung)  # strategies/watchdog.py: which ranks were behind, where the stacks are
            if summary is not None:
                print(summary, file=sys.stderr)
                return HANG_EXIT_CODE
            print(
                f"trainforge launch: rank {rank} (local rank {failure.local_rank}) failed with exit code "
                f"{failure.exitcode}; the other ranks were stopped. Its traceback is above.",
                file=sys.stderr,
            )
            return failure.exitcode if 0 < failure.exitcode < 256 else 1
        except SignalException as error:  # the launcher got SIGTERM/SIGUSR1/...; torchrun forwarded it and waited
            print(
                f"trainforge launch: got {error.sigval.name}; forwarded it to the workers and waited for them "
                f"(a Trainer saves the stop step and exits with {128 + int(error.sigval)}; past "
                "--shutdown-timeout, 30 s by default, torchrun SIGKILLs them)",
                file=sys.stderr,
            )
            return 128 + int(error.sigval)
    return 0


def _message(message: Any) -> str:
    """A failure's message: the error file's text (torch elastic stores it as a dict or a str)."""
    return str(message.get("message", "") if isinstance(message, dict) else message)


def _stop_signal_of(exitcode: int) -> Optional[str]:
    """The signal a worker stopped on after its checkpoint, from its exit code (128 + the number)."""
    from trainforge.trainer.cluster.stop_signals import STOPPABLE

    names = [n for n in STOPPABLE if getattr(signal, n, None) is not None and 128 + getattr(signal, n) == exitcode]
    return names[0] if names else None
