"""Run a script under ``python -m torch.distributed.run --standalone`` with a hard timeout.

The whole process group (agent and workers) is killed when the time runs out or on failure, and
the JSON files the ranks wrote to ``$CB_OUT`` are returned.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict

SCRIPTS = Path(__file__).resolve().parent
from tests.helpers import forklaunch, procs


def torchrun(script: str, out_dir: Path, nproc: int = 2, timeout: float = 90.0) -> Dict[str, Any]:
    """``{file stem: parsed JSON}`` of what the ranks wrote; raises with the output on failure."""
    env = procs.test_env(
        CB_OUT=str(out_dir),
        MASTER_ADDR="127.0.0.1",
        PYTHONPATH=os.pathsep.join([str(SCRIPTS.parent.parent), str(SCRIPTS)]),
    )
    output = forklaunch.launch(SCRIPTS / script, nproc=nproc, env=env, timeout=timeout).stdout
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
            raise AssertionError(
                f"scenario {scenario!r} on rank {r} failed:\n{res['error'] if res else results['_output'][-6000:]}"
            )
    return ranks


def multirank_output() -> str:
    """stdout and stderr of the shared launch (run it first through ``multirank``)."""
    multirank("monitors")
    return _SHARED["results"]["_output"]
