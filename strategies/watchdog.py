"""Hang watchdog: a process that makes no progress for ``timeout`` seconds says where it is and ends.

Why: a rank stuck in a collective (a peer died, diverged or deadlocked) otherwise waits out the
process group's timeout (torch: 30 min for gloo, 10 min for NCCL, or forever with
``TORCH_NCCL_BLOCKING_WAIT`` off and no heartbeat), and then says only "timed out", not where.

How: one daemon thread per process, armed with :meth:`ProgressWatchdog.start`. The owner calls
:meth:`ProgressWatchdog.beat` at every unit of progress (the Trainer's callback: every training and
validation batch start and end, so a long validation is not a hang while each batch is shorter than
the timeout). A beat is one attribute write and one ``time.monotonic()`` call; the thread wakes once
per ``timeout / 4``, so the cost per step is nothing measurable (``benchmarks/hang_watchdog.py``).

When ``timeout`` seconds pass without a beat, the thread, on every rank whose own timer ran out
(every rank of a hung job: the stalled rank and the peers waiting for it in a collective stop
beating at the same step):

1. writes a header (rank, host, pid, the last progress and how long ago) and every thread's Python
   stack (``faulthandler.dump_traceback(all_threads=True)``) to stderr and to
   ``<dump_dir>/rank<r>.txt``; the stalled rank's main thread shows the frame it is stuck in
   (``training_step``), a waiting peer's shows the collective (``backward``/``all_reduce``);
2. writes the same message to torch elastic's error file (``TORCHELASTIC_ERROR_FILE``, set by
   torchrun) so the launcher's failure summary names the rank, host and stack file;
3. waits ``GRACE_S`` (peers whose timers ran out at the same moment finish their dumps before this
   process's exit closes their connections), then ends with ``os._exit(HANG_EXIT_CODE)``: the main
   thread is stuck, so no exception could reach it. torchrun sees the failed worker and stops the
   others (its ordinary failure path, ``trainforge launch`` adds a line naming the hung ranks).

``HANG_EXIT_CODE`` is 124, the code of coreutils ``timeout``: not 1 (a Python exception), not 128 + N
(a signal, ``TrainingStopped``).

NCCL: torch's own flight recorder is enabled through its documented environment variables, read when
the process group is created: ``TORCH_NCCL_TRACE_BUFFER_SIZE=2000`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``
(``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` for where). It dumps on NCCL's own timeout; its on-demand dump is a
private torch function, which this module does not call. Set those variables in the job's environment
when the collectives' state is needed too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.files import open_new

HANG_EXIT_CODE = 124
GRACE_S = 2.0
# longer than any step, save or validation; the watchdog thread's waits must stay under threading.TIMEOUT_MAX
MAX_HANG_TIMEOUT_S = 7 * 24 * 3600.0


def check_hang_timeout(value: Any, owner: str, name: str = "hang_timeout") -> Optional[float]:
    """``None`` (off) or a positive number of seconds; anything else is a ``ConfigurationError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigurationError(
            f"{owner}({name}={value!r}) is not one of: None (off), a positive number of seconds. Pass more than the "
            f"longest time a step, a validation batch or a checkpoint save may take (e.g. {owner}({name}=1800)), "
            "or None to turn the hang watchdog off"
        )
    if value > MAX_HANG_TIMEOUT_S:
        raise ConfigurationError(
            f"{owner}({name}={value!r}) is more than a week ({MAX_HANG_TIMEOUT_S:g} s): such a timeout never fires "
            f"(and a thread cannot wait that long). Pass at most {MAX_HANG_TIMEOUT_S:g} seconds, or None to turn the "
            "hang watchdog off"
        )
    return float(value)


class ProgressWatchdog:
    """Ends the process with ``HANG_EXIT_CODE`` after ``timeout`` seconds without :meth:`beat`, after
    writing every thread's stack to stderr and ``dump_dir/rank<rank>.txt`` (see the module docstring)."""

    def __init__(self, timeout: float, dump_dir: str, rank: int = 0, grace_s: float = GRACE_S) -> None:
        self.timeout = check_hang_timeout(timeout, "ProgressWatchdog", "timeout")
        self.dump_dir = Path(dump_dir)
        self.rank = rank
        self.grace_s = grace_s
        self._last = time.monotonic()
        self._where = "armed"
        self._beats = 0  # progress marks so far: ranks in lockstep have equal counts, the one behind fewer
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def beat(self, where: str) -> None:
        """Progress: ``where`` is what the hang report names as the last thing completed."""
        self._where = where
        self._beats += 1
        self._last = time.monotonic()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self.beat("armed")
        self._thread = threading.Thread(target=self._watch, name="trainforge-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _watch(self) -> None:
        assert self.timeout is not None
        while not self._stop.wait(self.timeout / 4):
            idle = time.monotonic() - self._last
            if idle >= self.timeout:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        path = self.dump_dir / f"rank{self.rank}.txt"
        f: Any = None
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            f, path = open_new(path)  # rank<r>-1.txt... when one exists: nothing is overwritten
        except OSError as exc:
            failure = f" (could not write {path}: {exc})"
        host = socket.gethostname()
        message = (
            f"trainforge hang watchdog: rank {self.rank} on {host} (pid {os.getpid()}) made no progress for "
            f"{idle:.1f} s (hang_timeout={self.timeout:g} s); last progress: {self._where} (progress mark "
            f"{self._beats}). Every thread's "
            f"stack follows and is in {path}; exiting with code {HANG_EXIT_CODE}"
        )
        if f is None:
            message += failure
        else:
            try:
                with f:
                    f.write(message + "\n\n")
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
            except OSError as exc:
                message += f" (could not write {path}: {exc})"
        print(message, file=sys.stderr, flush=True)
        # stderr closed, or replaced by an object without a fileno
        with contextlib.suppress(OSError, ValueError, AttributeError):
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        _write_elastic_error_file(message)
        time.sleep(self.grace_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)


def _write_elastic_error_file(message: str) -> None:
    """torchrun's failure summary reads a worker's ``TORCHELASTIC_ERROR_FILE`` (the format of torch elastic's
    ``ErrorHandler.record_exception``), so the summary names the hang instead of "<N/A>"."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
    data = {"message": {"message": f"HangDetected: {message}", "extraInfo": extra}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


_MARK = re.compile(r"\(progress mark (\d+)\)")


def hang_summary(messages: Dict[int, str]) -> Optional[str]:
    """The launcher's line for the ranks that ended with ``HANG_EXIT_CODE`` (``{rank: error-file message}``):
    which ranks were behind (fewest progress marks: the others waited for them in a collective) and where
    every rank's stacks are. ``None`` when no rank hung."""
    if not messages:
        return None
    marks = {r: int(m.group(1)) for r, text in messages.items() if (m := _MARK.search(text))}
    lines = [
        f"trainforge launch: rank(s) {sorted(messages)} hung: no progress within hang_timeout (exit code "
        f"{HANG_EXIT_CODE}); the hang watchdog dumped every thread's stack of each."
    ]
    if marks and len(set(marks.values())) > 1:
        behind = sorted(r for r, n in marks.items() if n == min(marks.values()))
        lines.append(f"  behind: rank(s) {behind} (the others waited for them in a collective)")
    for r in sorted(messages):
        lines.append(f"  rank {r}: {messages[r].removeprefix('HangDetected: ')}")
    return "\n".join(lines)
