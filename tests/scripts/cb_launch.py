"""Run a script under ``python -m torch.distributed.run --standalone`` with a hard timeout.

The whole process group (agent and workers) is killed when the time runs out or on failure, and
the JSON files the ranks wrote to ``$CB_OUT`` are returned.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict

SCRIPTS = Path(__file__).resolve().parent


def torchrun(script: str, out_dir: Path, nproc: int = 2, timeout: float = 90.0) -> Dict[str, Any]:
    """``{file stem: parsed JSON}`` of what the ranks wrote; raises with the output on failure."""
    env = dict(os.environ, CB_OUT=str(out_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MASTER_ADDR="127.0.0.1", PYTHONPATH=os.pathsep.join([str(SCRIPTS.parent.parent), str(SCRIPTS)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(SCRIPTS / script)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{script} timed out after {timeout}s:\n{output[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed with exit code {proc.returncode}:\n{output[-6000:]}")
    results = {p.stem: json.loads(p.read_text()) for p in out_dir.glob("*.json")}
    results["_output"] = output
    return results


_SHARED: Dict[str, Any] = {}


def multirank(scenario: str, timeout: float = 240.0) -> Any:
    """The result of one scenario of ``cb_multirank.py`` for every rank: ``[rank0, rank1]``.

    All scenarios run in one launch per test session (each process pays the torch import once);
    a failed launch is remembered, so the other tests fail at once with the same output."""
    if "results" not in _SHARED:
        out_dir = tempfile.mkdtemp(prefix="cb_multirank_")
        atexit.register(shutil.rmtree, out_dir, True)
        try:
            _SHARED["results"] = torchrun("cb_multirank.py", Path(out_dir), 2, timeout)
        except AssertionError as err:
            _SHARED["results"] = err
    results = _SHARED["results"]
    if isinstance(results, AssertionError):
        raise results
    ranks = [results.get(f"{scenario}_rank{r}") for r in range(2)]
    for r, res in enumerate(ranks):
        if res is None or "error" in res:
            raise AssertionError(f"scenario {scenario!r} on rank {r} failed:\n"
                                 f"{res['error'] if res else results['_output'][-6000:]}")
    return ranks


def multirank_output() -> str:
    """stdout and stderr of the shared launch (run it first through ``multirank``)."""
    multirank("monitors")
    return _SHARED["results"]["_output"]
