"""Running real processes from tests: each command in its own process group, the whole group
(launcher and workers) killed on timeout or when the test ends, output captured."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
# tests/conftest.py hides CUDA from the test process and its children (CPU tests); gpu tests give
# their children this value back. Read at import, which conftest does before hiding.
ORIGINAL_CUDA_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")
_gpu_probe: Optional[str] = None


def gpu_env(**extra: str) -> Dict[str, str]:
    """``test_env`` with the GPUs visible (for tests marked ``gpu``)."""
    env = test_env(**extra)
    if ORIGINAL_CUDA_VISIBLE is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ORIGINAL_CUDA_VISIBLE
    env.update(extra)
    return env


def gpu_unavailable_reason() -> str:
    """'' when a child process can use CUDA, else why not (asked once, in a child, so that this
    process never initialises CUDA)."""
    global _gpu_probe
    if _gpu_probe is None:
        if not Path("/dev/nvidiactl").exists() and sys.platform == "linux":
            _gpu_probe = "no NVIDIA device on this machine (/dev/nvidiactl absent)"
        else:
            probe = run(
                [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                timeout=120,
                env=gpu_env(),
                check=False,
            )
            count = probe.stdout.strip().splitlines()[-1:] or ["?"]
            _gpu_probe = (
                ""
                if probe.returncode == 0 and count[0].isdigit() and int(count[0]) > 0
                else f"CUDA is not available to torch here ({probe.stdout.strip()[-300:]})"
            )
    return _gpu_probe


def test_env(**extra: str) -> Dict[str, str]:
    """This environment for a child: one intra-op thread (2 busy cores), no inherited launch
    settings, the repository importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRAINFORGE_LAUNCH_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run(
    cmd: Sequence[str],
    *,
    timeout: float,
    cwd: Optional[Path] = None,
    env: Optional[Dict[str, str]] = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``cmd`` with stdout+stderr merged; ``check``: raise AssertionError with the output tail
    unless it exits 0."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd or REPO,
        env=env or test_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} timed out after {timeout}s:\n{output[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited with {proc.returncode}:\n{output[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


def torchrun(script: Path | str, *args: str, nproc: int = 2) -> list:
    """The command that runs ``script`` on ``nproc`` local processes with torch.distributed.run."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *map(str, args),
    ]


def trainforge_launch(script: Path | str, *args: str, nproc: int = 2, launch_args: Sequence[str] = ()) -> list:
    """The same through the launcher users use (`trainforge launch`)."""
    return [
        sys.executable,
        "-m",
        "trainforge",
        "launch",
        "--nproc-per-node",
        str(nproc),
        *launch_args,
        str(script),
        *map(str, args),
    ]
