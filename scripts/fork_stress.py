"""Fork right after a DDP backward on 2 gloo ranks, many times, and count the forks whose child hangs.

    python3 scripts/fork_stress.py --runs 10                       # plain PyTorch, os.fork after backward
    python3 scripts/fork_stress.py --runs 10 --mode trainforge     # with clean_exit.register() (the fix)
    python3 scripts/fork_stress.py --runs 5 --fork dataloader      # DataLoader(num_workers=2) iterators
    python3 scripts/fork_stress.py --runs 3 --gdb                  # gdb backtrace of the first stuck child
    python3 scripts/fork_stress.py --runs 10 --load 2              # with 2 busy-looping processes (CI load)

Each run is ``torch.distributed.run --standalone --nproc-per-node 2`` on this script (``--worker``); each
rank trains a small DDP model (one bucket per parameter: several gloo all-reduces inside every backward)
and, right after every backward, forks: ``--fork os`` forks a child that exits at once, ``--fork
dataloader`` creates a ``DataLoader(num_workers=2)`` iterator (two forks) and reads one batch. A child
that has not exited (or not delivered its batch) within ``--child-timeout`` seconds counts as a hang; it
is killed and the rank goes on. Every loop is bounded by ``--iters`` and ``--seconds``; each launch by
``--timeout``, after which its whole process group is killed (the launch counts as hung). ``--load N``
keeps N busy-looping processes running during each launch: the hang needs a gloo worker thread to be
descheduled at the wrong moment, which a loaded machine (2 cores in CI) makes far more likely.

``--mode plain`` imports nothing from trainforge (torch's and CPython's own behaviour); ``--mode
trainforge`` calls ``trainforge.strategies.clean_exit.register()`` after ``init_process_group``, as every
trainforge strategy does (it installs the before-fork drain). strategies/clean_exit.py has the numbers.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = re.compile(r"RESULT rank=(\d+) forks=(\d+) hangs=(\d+) seconds=([\d.]+)")  # ranks may share a line


# --------------------------------------------------------------------------------------------- rank side
def _backtrace(pid: int) -> str:
    try:
        out = subprocess.run(
            ["gdb", "-p", str(pid), "-batch", "-ex", "bt"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
        )
        return "\n".join(line for line in out.stdout.splitlines() if line.startswith("#"))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(no backtrace: {exc!r})"


def _wait_child(pid: int, timeout: float) -> bool:
    """True when the child exited within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return True
        time.sleep(0.001)
    return False


def worker(args: argparse.Namespace) -> int:  # noqa: C901, PLR0915 - one stress run, read top to bottom
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if args.mode == "trainforge":
        from trainforge.strategies import clean_exit

        clean_exit.register()
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # one bucket per parameter
    data = list(range(8))
    forks = hangs = 0
    gdb_left = 1 if args.gdb else 0
    start = time.monotonic()
    for step in range(args.iters):
        # both ranks decide together when to stop (a rank stopping alone would hang the other's backward)
        flag = torch.tensor([float(time.monotonic() - start < args.seconds)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0:
            break
        ddp(torch.randn(4, 32)).sum().backward()
        if args.fork == "os":
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            forks += 1
            if not _wait_child(pid, args.child_timeout):
                hangs += 1
                if gdb_left:
                    gdb_left -= 1
                    print(f"HANG rank={rank} step={step} child={pid} backtrace:\n{_backtrace(pid)}", flush=True)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        else:
            loader = DataLoader(data, batch_size=4, num_workers=2, timeout=args.child_timeout)
            it = iter(loader)
            forks += 2
            try:
                next(it)
            except RuntimeError as exc:  # "DataLoader timed out after N seconds"
                if "timed out" not in str(exc):
                    raise
                hangs += 1
                pids = [w.pid for w in it._workers]
                if gdb_left:
                    gdb_left -= 1
                    for pid in pids:
                        print(f"HANG rank={rank} step={step} worker={pid} backtrace:\n{_backtrace(pid)}", flush=True)
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            del it
    print(f"RESULT rank={rank} forks={forks} hangs={hangs} seconds={time.monotonic() - start:.1f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------- driver side
def launch(args: argparse.Namespace) -> tuple:
    """(forks, hung forks, launch timed out, output) of one 2-process launch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRAINFORGE_LAUNCH_CONFIG", None)
    if args.mode == "trainforge":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    script_args = [
        "--worker",
        "--mode",
        args.mode,
        "--fork",
        args.fork,
        "--iters",
        str(args.iters),
        "--seconds",
        str(args.seconds),
        "--child-timeout",
        str(args.child_timeout),
    ]
    script_args += ["--gdb"] if args.gdb else []
    if args.launcher == "trainforge":
        cmd = [sys.executable, "-m", "trainforge", "launch", "--nproc-per-node", "2", __file__, *script_args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            *script_args,
        ]
    burners = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import time\nend = time.monotonic() + {args.timeout}\nwhile time.monotonic() < end: pass",
            ]
        )
        for _ in range(args.load)
    ]
    try:
        return _launch(args, cmd, env)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def _launch(args: argparse.Namespace, cmd: list, env: dict) -> tuple:
    with tempfile.TemporaryDirectory(prefix="fork-stress-") as cwd:  # plain mode: trainforge not importable
        proc = subprocess.Popen(
            cmd,
            cwd=cwd if args.mode == "plain" else REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            timed_out = True
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    results = RESULT.findall(out)
    forks = sum(int(r[1]) for r in results)
    hangs = sum(int(r[2]) for r in results)
    failed = timed_out or proc.returncode != 0 or len(results) != 2
    return forks, hangs, failed, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="launches (default 10)")
    parser.add_argument("--mode", choices=("plain", "trainforge"), default="plain")
    parser.add_argument("--fork", choices=("os", "dataloader"), default="os")
    parser.add_argument("--launcher", choices=("torchrun", "trainforge"), default="torchrun")
    parser.add_argument("--iters", type=int, default=2000, help="backward+fork steps per rank at most")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of steps per launch at most")
    parser.add_argument("--child-timeout", type=float, default=5.0, help="seconds before a child counts as hung")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per launch before it is killed")
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes during each launch")
    parser.add_argument("--gdb", action="store_true", help="print a gdb backtrace of the first hung child per rank")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.runs < 1 or args.iters < 1 or args.seconds <= 0:
        parser.error("--runs, --iters and --seconds must be positive")
    total_forks = total_hangs = runs_with_hangs = failed_runs = 0
    first_failure = None
    start = time.monotonic()
    for i in range(args.runs):
        forks, hangs, failed, out = launch(args)
        total_forks += forks
        total_hangs += hangs
        runs_with_hangs += hangs > 0
        failed_runs += failed
        if (failed or hangs) and first_failure is None:
            first_failure = out[-6000:]
        print(
            f"run {i + 1}/{args.runs}: forks={forks} hung={hangs}{' LAUNCH FAILED/TIMED OUT' if failed else ''}",
            flush=True,
        )
    print(
        f"mode={args.mode} fork={args.fork} launcher={args.launcher} load={args.load}: {args.runs} runs, {total_forks} forks, "
        f"{total_hangs} hung forks, {runs_with_hangs} runs with a hang, {failed_runs} launches failed, "
        f"{time.monotonic() - start:.0f} s",
        flush=True,
    )
    if first_failure:
        print("first run with a hang or failure (output tail):\n" + first_failure)
    return 1 if (total_hangs or failed_runs) else 0


if __name__ == "__main__":
    sys.exit(main())
