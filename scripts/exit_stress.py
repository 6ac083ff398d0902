"""Repeat short 2-process runs of each kind and count how many exit 0 (issue: SIGABRT at exit).

    python3 scripts/exit_stress.py --runs 20                  # every kind, 20 launches each
    python3 scripts/exit_stress.py --runs 50 --kinds trainer-ddp accelerator

Each launch is ``torch.distributed.run --nproc-per-node 2 tests/scripts/exit_kinds.py KIND``; a run
passes when the launcher exits 0. Prints one line per kind and exits 1 if any run failed, with the
tail of the first failure's output. tests/test_clean_exit.py runs a few of these in the suite.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("trainer-ddp", "fsdp", "megatron-pp", "deepspeed", "accelerator")


def launch(kind: str, root: Path, repo: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(repo / "tests" / "scripts" / "exit_kinds.py"),
        kind,
        str(root),
    ]
    try:
        return subprocess.run(
            cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return subprocess.CompletedProcess(cmd, -1, out + f"\n(timed out after {timeout}s)", "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="launches per kind (default 20)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout to run (default: this one)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs} must be at least 1")
    failed_any = None
    with tempfile.TemporaryDirectory(prefix="trainforge-exit-") as tmp:
        for kind in args.kinds:
            ok, aborts, start = 0, 0, time.monotonic()
            for i in range(args.runs):
                proc = launch(kind, Path(tmp) / f"{kind}-{i}", args.repo, args.timeout)
                if proc.returncode == 0:
                    ok += 1
                    continue
                aborts += "terminate called" in proc.stdout or "exitcode  : -6" in proc.stdout
                failed_any = failed_any or proc.stdout[-3000:]
            print(
                f"{kind:12s} {ok}/{args.runs} exited 0 ({aborts} SIGABRT at exit) in {time.monotonic() - start:.0f} s",
                flush=True,
            )
    if failed_any:
        print("first failure:\n" + failed_any)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
