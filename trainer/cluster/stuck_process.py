"""What still ends a process whose main thread waits in native code: a collective whose peer is gone, a
rendezvous for a rank that never comes. Python runs signal handlers in the main thread, between bytecodes, so
such a process takes no stop signal and waits (for the process group's timeout, 30 minutes or more). Two
daemon threads act instead (``trainer/cluster/stop_signals.py`` starts them with its handlers):

- ``watch_launcher``: a worker of ``trainforge launch`` or of ``Trainer(devices=N)`` polls its launcher's pid
  (``LAUNCHER_PID_ENV``) and ends when the launcher dies (a job stopped by SIGTERM then SIGKILL, as
  ``timeout`` and schedulers do): it first stops as on a stop signal when its main thread still takes
  signals (its checkpoint, within the launcher's grace ``STOP_GRACE_ENV``), else exits at once with 137.
- ``SignalWatch``: Python's C-level handler writes each signal's number to a pipe
  (``signal.set_wakeup_fd``), which a thread reads: a second stop signal more than
  ``SECOND_SIGNAL_AFTER_S`` after a first one that the main thread never took ends the process with
  ``ENDED_CODE``. Where someone else owns the wakeup fd (asyncio's loop), it is left to them.

Both end with 137 (128 + SIGKILL, what the launcher would have done after its grace), never with the
128 + N of a stop that saved its checkpoint (``trainforge launch`` reports that one as a clean stop).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Any, List, Mapping, Optional, Sequence

from trainforge.strategies.environment import STOP_GRACE_ENV

# the pid of the process that started this worker (trainforge launch, Trainer(devices=N))
LAUNCHER_PID_ENV = "TRAINFORGE_LAUNCHER_PID"
LAUNCHER_POLL_S = 0.5
# a second stop signal sooner than this after the first is the same request delivered twice (SLURM signals
# every process of a step, and the launcher forwards the signal too)
SECOND_SIGNAL_AFTER_S = 1.0
ENDED_CODE = 128 + 9
# the handler may run before this thread reads the signal's byte; well under SECOND_SIGNAL_AFTER_S
HANDLED_SLACK_S = 0.5
#: The StopSignals whose handlers are installed in this process (each has ``received`` and ``caught``).
HANDLING: List[Any] = []
_launcher_watch: Optional[threading.Thread] = None


def say(text: str) -> None:
    """One write to stderr (no lock that a signal handler or a dying process could find taken)."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass


# ---- the launcher's death ----------------------------------------------------------------------------
def watch_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """End this worker when the launcher that started it dies: once per process, and only in a direct
    child of the launcher named in ``LAUNCHER_PID_ENV`` (a process the worker forks inherits the variable,
    but not the parent)."""
    global _launcher_watch
    value = environ.get(LAUNCHER_PID_ENV, "")
    if _launcher_watch is not None or not value.isdigit() or os.getppid() != int(value):
        return
    _launcher_watch = threading.Thread(
        target=_watch_launcher, args=(int(value),), name="trainforge-launcher-watch", daemon=True
    )
    _launcher_watch.start()


def _watch_launcher(launcher: int) -> None:
    # an orphan is re-parented (to init or a subreaper): the parent pid changes once the launcher is gone
    while os.getppid() == launcher:
        time.sleep(LAUNCHER_POLL_S)
    say(f"trainforge: the launcher (pid {launcher}) of this worker (pid {os.getpid()}) is gone: ending\n")
    if HANDLING and _stop_taken(HANDLING[-1]):
        grace = _stop_grace()
        say(f"trainforge: stopping as on a stop signal; exiting in at most {grace:g} s\n")
        time.sleep(grace)
    os._exit(ENDED_CODE)


def _stop_taken(stops: Any, wait_s: float = 2.0) -> bool:
    """Ask the main thread to stop as on the first of its stop signals; whether its handler ran."""
    if stops.received is None and stops.caught:
        os.kill(os.getpid(), stops.caught[0])
    deadline = time.monotonic() + wait_s
    while stops.received is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return stops.received is not None


def _stop_grace() -> float:
    try:
        return max(0.0, float(os.environ.get(STOP_GRACE_ENV, "30")))
    except ValueError:
        return 30.0


# ---- a second signal the main thread cannot take -----------------------------------------------------
class SignalWatch:
    """The stop signals of ``stops`` as Python's C-level handler sees them, read from a daemon thread."""

    def __init__(self, stops: Any, signals: Sequence[signal.Signals]) -> None:
        self.stops, self.numbers = stops, {int(s) for s in signals}
        self._pipe: Optional[tuple] = None
        self._done = threading.Event()

    def start(self) -> bool:
        """From the main thread; False where the wakeup fd is someone else's (left to them)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            previous = None
        if previous != -1:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return False
        self._pipe = (read, write)
        threading.Thread(target=self._run, args=(read,), name="trainforge-signal-watch", daemon=True).start()
        return True

    def stop(self) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(-1)
        self._done.set()
        os.close(self._pipe[1])  # the reader closes its end when it sees the flag
        self._pipe = None

    def _taken(self, arrived: float) -> bool:
        """Whether the main thread's handler ran for the signal that arrived at ``arrived`` (within a second):
        the first one may have been taken before the main thread entered native code, so a received
        signal says nothing about this one."""
        deadline = arrived + 1.0
        while time.monotonic() < deadline:
            if self.stops.handled_at >= arrived - HANDLED_SLACK_S:
                return True
            time.sleep(0.02)
        return self.stops.handled_at >= arrived - HANDLED_SLACK_S

    def _run(self, read: int) -> None:
        first: Optional[float] = None
        while not self._done.is_set():
            if not select.select([read], [], [], 0.5)[0]:
                continue
            try:
                data = os.read(read, 64)
            except OSError:
                break
            for number in (n for n in data if n in self.numbers):
                now = time.monotonic()
                if first is None:
                    first = now
                elif now - first > SECOND_SIGNAL_AFTER_S and not self._taken(now):
                    name = signal.Signals(number).name
                    say(
                        f"trainforge: {name} again (pid {os.getpid()}); the main thread waits in native code and "
                        "took none: ending now\n"
                    )
                    os._exit(ENDED_CODE)
        os.close(read)


def forget_wakeup_fd_in_child() -> None:
    """In a forked child (a DataLoader worker): its signals are its own, not written to the parent's pipe."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
