"""A stop request saves and exits cleanly: the signal a scheduler sends before it kills or requeues a
job (SLURM ``--signal=USR1@90``, then SIGTERM; Kubernetes and spot instances SIGTERM and a grace
period; Ctrl-C) makes every rank stop at the same step, write that step's checkpoint and exit with
a documented code, instead of losing the steps since the last periodic checkpoint.

``Trainer(stop_signals=...)`` (default ``DEFAULT_STOP_SIGNALS``: SIGTERM, SIGINT, SIGUSR1) catches
them while the training loop runs (``StopSignals.catching``); ``Accelerator(stop_signals=...)``
catches them from its creation on, for a user's loop (``accelerator.stop_requested``). Only a
signal left to its default action is taken over: a handler someone else installed (a user's, the
``Trainer(devices=N)`` launcher's) is kept, and said so.

- The handler only records the signal. A second Ctrl-C raises ``KeyboardInterrupt`` at once (no
  checkpoint). Another stop signal more than ``SECOND_SIGNAL_AFTER_S`` after the first, while the ranks
  have not yet agreed on a stop step, ends the process at once with the signal's default action (the
  loop is not coming back: a rank stuck in a collective); one that comes sooner is the same request
  delivered twice (SLURM signals every process of a step, and the launcher forwards it too), and one
  that comes once the stop step is agreed would cut its checkpoint: both are ignored.
- A main thread stuck in native code (a collective whose peer is gone) runs no Python handler: while the
  handlers are installed, ``trainer/cluster/stuck_process.py`` ends such a process on a second stop signal,
  and a worker of ``trainforge launch`` or ``Trainer(devices=N)`` when its launcher dies (SIGTERM then
  SIGKILL, as ``timeout`` and schedulers stop a job), so that no orphan is left.
- Agreement: the loop polls after every optimizer step. About every ``EXCHANGE_EVERY_S`` of training
  (every poll when steps are slower), each rank contributes its signal number (0: none) to a MAX
  all-reduce started with ``async_op=True`` and read at the next poll; every rank reads the same
  value after the same step, so all stop there, and the loop never waits on it (the result is there
  by then; on CUDA it is copied to pinned host memory behind an event, so the host waits only for
  the step before, never for the device to drain). The interval, in polls, is rank 0's, carried in
  the same all-reduce, so the schedule is the same on every rank. One process stops after the step
  in which the signal came; several within ~``EXCHANGE_EVERY_S`` + two steps. Cost: one 8-byte
  all-reduce per interval, in flight during a step (``benchmarks/stop_signals.py``).
- The stop: ``trainer.stop_requested`` is the signal's name at that step, ``ModelCheckpoint`` saves
  it through its usual path (its directory, its names, its asynchronous writer), fit runs its end
  events, waits until every checkpoint is committed, and raises ``TrainingStopped``: a
  ``SystemExit`` whose code is 128 + the signal number (143 SIGTERM, 138 SIGUSR1, 130 SIGINT). That
  is the shell's code for "ended by that signal", so requeue logic keyed on it keeps working and a
  Kubernetes Job is not marked complete, unlike 0; a crash stays 1. A signal that arrives after the
  last step finds the run complete: once fit has committed its checkpoints it is said and dropped
  (the run exits 0: it is finished, not cut), except Ctrl-C, which is delivered then.
- Processes forked while the handlers are installed (DataLoader workers) get a process group of
  their own: torchrun forwards a signal to each worker's process group, and a terminal sends Ctrl-C
  to the foreground group, and DataLoader workers die of SIGTERM from anyone but their parent
  (torch's handler), which fails the loader before the stop step. Their parent still ends them; if
  the parent is SIGKILLed, the kernel ends them at once (Linux: ``PR_SET_PDEATHSIG``, for children of
  the main thread; elsewhere torch's watchdog ends them within seconds), so that the other ranks see
  the lost rank's connections close instead of waiting for its workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.cluster.stuck_process import (
    HANDLING,
    SECOND_SIGNAL_AFTER_S,
    SignalWatch,
    forget_wakeup_fd_in_child,
    say,
    watch_launcher,
)

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy

log = logging.getLogger("trainforge")

STOPPABLE = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
EXCHANGE_EVERY_S = 0.25  # ranks exchange their flags about this often (every optimizer step if slower)
SignalsArg = Union[str, int, signal.Signals, Sequence[Union[str, int, signal.Signals]], None]

_installed = 0  # StopSignals objects with handlers installed in this process
_fork_hook = False
_forked_from_main, _forking_pid = True, 0  # set by the fork hook in the parent just before each fork
_prctl: Any = None  # libc's prctl, looked up when the fork hook is installed (Linux)


def exit_code(sig: Union[int, signal.Signals]) -> int:
    """The exit code of a run stopped by ``sig`` after its checkpoint: 128 + the signal number."""
    return 128 + int(sig)


def parse_stop_signals(value: SignalsArg, where: str) -> Tuple[signal.Signals, ...]:
    """``("SIGTERM", "SIGUSR1")``, ``"SIGTERM,SIGUSR1"``, ``signal.SIGTERM``, ``15`` or None/() (off)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [value] if isinstance(value, int) else value
    try:
        items = list(items)
    except TypeError:
        raise ConfigurationError(
            f"{where}={value!r} must be signal names such as ('SIGTERM', 'SIGUSR1'); {_choices()}"
        ) from None
    out = []
    for item in items:
        sig = _one_signal(item, value, where)
        if sig not in out:
            out.append(sig)
    return tuple(out)


def _choices() -> str:
    return f"catchable choices: {', '.join(n for n in STOPPABLE if hasattr(signal, n))}; None catches none"


def _one_signal(item: Any, value: Any, where: str) -> signal.Signals:
    fix = _choices()
    name = ""
    if isinstance(item, signal.Signals):
        name = item.name
    elif isinstance(item, int) and not isinstance(item, bool):
        try:
            name = signal.Signals(item).name
        except ValueError:
            name = str(item)
    elif isinstance(item, str):
        name = item.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
    if name in ("SIGKILL", "SIGSTOP"):
        raise ConfigurationError(
            f"{where}={value!r}: {name} cannot be caught (the kernel {'ends' if name == 'SIGKILL' else 'stops'} "
            f"the process without telling it), so no checkpoint can be written on it; {fix}. Schedulers "
            "send SIGTERM (or SLURM's --signal=USR1@90) first: catch that"
        )
    if not hasattr(signal, name) or name not in STOPPABLE:
        raise ConfigurationError(f"{where}={value!r}: {item!r} is not a signal a run can stop on; {fix}")
    return signal.Signals[name]


class TrainingStopped(SystemExit):
    """Raised by ``Trainer.fit`` after a stop signal, once the checkpoint of the stop step is committed.
    A ``SystemExit``: uncaught, the process exits with ``code`` (128 + the signal number)."""

    def __init__(self, signal_name: str, step: int, checkpoint: Optional[str]) -> None:
        super().__init__(exit_code(signal.Signals[signal_name]))
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class StopSignals:
    """The stop signals of one Trainer or Accelerator: handlers, and the agreement between ranks."""

    def __init__(self, signals: SignalsArg, where: str, install: bool = False) -> None:
        self.signals = parse_stop_signals(signals, where)
        self.where = where
        self.received: Optional[signal.Signals] = None  # in this process
        self.agreed: Optional[signal.Signals] = None  # every rank stops at ``stopped_at`` on it
        self.stopped_at: Optional[int] = None
        self._previous: Dict[signal.Signals, Any] = {}
        self._exchange: Optional[_Exchange] = None
        self._polled_step: Optional[int] = None
        self._polls, self._next_exchange = 0, 1  # poll counts: every rank the same
        self._per_poll: Optional[float] = None  # rank 0: seconds between polls
        self._last_proposal: Optional[Tuple[float, int]] = None
        self._pid = os.getpid()  # the process whose handlers these are
        self._received_at = 0.0
        self.handled_at = 0.0  # when this process's handler last ran
        self._watch: Optional[SignalWatch] = None
        if install:
            self.install()

    @property
    def stop_requested(self) -> Optional[str]:
        """The agreed signal's name once every rank stops at this step, else None."""
        return None if self.agreed is None else self.agreed.name

    @property
    def caught(self) -> List[signal.Signals]:
        """The signals whose handler is this object's now."""
        return list(self._previous)

    @property
    def exit_code(self) -> Optional[int]:
        return None if self.agreed is None else exit_code(self.agreed)

    # ---- handlers -----------------------------------------------------------------------------------
    def install(self) -> None:
        """Catch the signals (main thread only: Python runs handlers there). A signal with a handler
        of someone else's is left to it."""
        global _installed
        if self._previous or not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "trainforge: %s: not catching %s: signal handlers can only be installed from the main thread",
                self.where,
                ", ".join(s.name for s in self.signals),
            )
            return
        self._pid = os.getpid()
        for sig in self.signals:
            previous = signal.getsignal(sig)
            if previous in (signal.SIG_DFL, signal.default_int_handler):  # None: a handler set outside Python
                self._previous[sig] = previous
                signal.signal(sig, self._handle)
            else:
                log.info(
                    "trainforge: %s: %s already has a handler (%r); it is left in place", self.where, sig.name, previous
                )
        if self._previous:
            _installed += 1
            HANDLING.append(self)
            _install_fork_hook()
            watch_launcher()
            self._watch = SignalWatch(self, list(self._previous))
            if not self._watch.start():
                self._watch = None

    def uninstall(self, deliver: bool = True) -> None:
        """Restore the handlers. ``deliver``: a signal received but not acted on (it came after the
        last step) is handled as ``_after_the_last_step`` says."""
        global _installed
        if self._previous:
            _installed -= 1
            HANDLING.remove(self)
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if deliver and self._exchange is not None and self._exchange.pending:
            # Every rank started this exchange at the same poll: wait for it, so that no collective is in
            # flight when the process group is destroyed or the interpreter exits (strategies/clean_exit.py).
            self._exchange.result()
        self._exchange = None
        pending, self.received = self.received, None
        if deliver and pending is not None and self.agreed is None:
            _after_the_last_step(pending, self.where)

    @contextlib.contextmanager
    def catching(self, step: int) -> Iterator[StopSignals]:
        """The handlers installed for the block; polls count optimizer steps after ``step``."""
        self.received = self.agreed = self.stopped_at = self._exchange = self._per_poll = self._last_proposal = None
        self._polled_step, self._polls, self._next_exchange = step, 0, 1
        self.install()
        try:
            yield self
        except BaseException:
            self.uninstall(deliver=False)
            raise
        self.uninstall()

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a process forked meanwhile (a DataLoader worker); SLURM signals every
            return  # process of a job step: the training process decides, the worker carries on
        self.handled_at = time.monotonic()  # the main thread takes signals (stuck_process.SignalWatch reads it)
        sig = signal.Signals(signum)
        if self.received is not None:
            if sig == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: stop at once, without a checkpoint
            if self.agreed is None and time.monotonic() - self._received_at > SECOND_SIGNAL_AFTER_S:
                self._end_now(sig)
            return
        self.received, self._received_at = sig, time.monotonic()
        again = " (Ctrl-C again stops at once, without a checkpoint)" if sig == signal.SIGINT else ""
        say(
            f"trainforge: {sig.name} received (pid {os.getpid()}): the ranks agree on a step to stop at (this "
            f"one or one of the next few), save it and exit with code {exit_code(sig)}{again}\n"
        )

    def _end_now(self, sig: signal.Signals) -> None:
        """A second stop signal before the ranks agreed: the signal's default action (the process ends)."""
        say(f"trainforge: {sig.name} again (pid {os.getpid()}) before the ranks agreed on a stop step: ending now\n")
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)

    # ---- agreement ----------------------------------------------------------------------------------
    def poll(self, strategy: Strategy, step: Optional[int] = None) -> Optional[str]:
        """Whether every rank stops now; call on every rank at the same point, after an optimizer step
        (``step``: global step; a repeated step, a micro-batch of the same window, is not polled)."""
        if self.agreed is not None or not self.signals or (step is not None and step == self._polled_step):
            return self.stop_requested
        self._polled_step = step
        decided = int(self.received or 0) if strategy.world_size == 1 else self._agree(strategy)
        if decided:
            self.agreed, self.stopped_at, self._exchange = signal.Signals(decided), step, None
        return self.stop_requested

    def _agree(self, strategy: Strategy) -> int:
        """Read the exchange started at the poll before, if any; start one when it is due. The interval
        (in polls) comes from rank 0 inside each exchange, so every rank keeps the same schedule."""
        self._polls += 1
        if self._exchange is None:
            self._exchange = _Exchange(strategy)
        decided = 0
        if self._exchange.pending:
            decided, every = self._exchange.result()
            self._next_exchange = self._polls + max(every, 1) - 1
        if not decided and self._polls >= self._next_exchange:
            proposal = self._interval() if strategy.global_rank == 0 else 0
            self._exchange.start(int(self.received or 0), proposal)
        return decided

    def _interval(self) -> int:
        """Rank 0's next interval in polls: about ``EXCHANGE_EVERY_S`` of training, at least one poll."""
        now = time.monotonic()
        if self._last_proposal is not None:
            per_poll = (now - self._last_proposal[0]) / max(self._polls - self._last_proposal[1], 1)
            self._per_poll = per_poll if self._per_poll is None else 0.5 * (self._per_poll + per_poll)
        self._last_proposal = (now, self._polls)
        return 1 if not self._per_poll else max(1, min(10_000, int(EXCHANGE_EVERY_S / self._per_poll)))


class _Exchange:
    """One MAX all-reduce of [signal number, rank 0's next interval] in flight, read one poll later:
    gloo on a CPU tensor; NCCL on a device tensor copied to pinned memory behind an event; another
    kind of process group (XLA) through the strategy's blocking all_reduce."""

    def __init__(self, strategy: Strategy) -> None:
        device = strategy.root_device
        usable = dist.is_available() and dist.is_initialized() and dist.get_world_size() == strategy.world_size
        self.mode = "blocking" if not usable or device.type not in ("cpu", "cuda") else "async"
        if self.mode == "async" and device.type == "cuda" and "gloo" not in str(dist.get_backend()):
            self.mode = "cuda"  # NCCL takes device tensors only
        self.strategy, self.pending = strategy, False
        self.buffer = torch.zeros(2, dtype=torch.int32, device=device if self.mode != "async" else "cpu")
        self.host = torch.zeros(2, dtype=torch.int32, pin_memory=True) if self.mode == "cuda" else self.buffer
        self.work: Any = None
        self.event: Any = None

    def start(self, flag: int, interval: int) -> None:
        self.pending = True
        if self.mode == "cuda":
            self.buffer[0], self.buffer[1] = flag, interval  # fills on the stream: no host-device sync
            dist.all_reduce(self.buffer, op=dist.ReduceOp.MAX, async_op=True).wait()  # the stream waits, not the host
            self.host.copy_(self.buffer, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        elif self.mode == "async":
            self.buffer = self.host = torch.tensor([flag, interval], dtype=torch.int32)
            self.work = dist.all_reduce(self.buffer, op=dist.ReduceOp.MAX, async_op=True)
        else:
            local = torch.tensor([flag, interval], dtype=torch.int32, device=self.buffer.device)
            self.host = self.strategy.all_reduce(local, "max").cpu()

    def result(self) -> Tuple[int, int]:
        """(the highest signal number of any rank, rank 0's interval) of the last ``start``."""
        self.pending = False
        if self.mode == "cuda":
            self.event.synchronize()  # the work queued up to the poll before: the device keeps the current step
        elif self.mode == "async":
            self.work.wait()  # done by now: it ran while this step computed
        return int(self.host[0]), int(self.host[1])


def _after_the_last_step(sig: signal.Signals, where: str) -> None:
    """A stop signal that came after the last step, once every checkpoint is committed: the run is complete.
    Ctrl-C is delivered again (a person at the terminal wants the script to stop); a scheduler's signal is
    not, so a finished run exits 0 and is not requeued or marked failed as if it had been cut (143 would
    say "stopped after a checkpoint, resume me"). The default handler is back: another signal acts at once."""
    if sig == signal.SIGINT:
        signal.raise_signal(sig)
        return
    log.warning(
        "trainforge: %s: %s came after the last step; the run is complete and its checkpoints are committed, so it "
        "is not stopped (it exits 0 when the script ends). The handler is restored: another %s ends the process",
        where,
        sig.name,
        sig.name,
    )


def _note_forking_thread() -> None:
    """``before`` fork hook: who forks, and whether from the main thread (the child reads the copy)."""
    global _forked_from_main, _forking_pid
    _forked_from_main = threading.current_thread() is threading.main_thread()
    _forking_pid = os.getpid()


def _own_group_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: a process forked while stop signals are caught gets
    its own process group (see the module docstring), and, forked by the main thread on Linux, is
    SIGKILLed when its parent dies: out of the parent's group, nothing else would end it at once when
    the parent is SIGKILLed, and a DataLoader worker holds the parent's sockets (the other ranks'
    collectives would wait for them) until torch's watchdog notices, up to 5 s later. Only a main
    thread's child: the kernel sends the signal when the forking *thread* ends."""
    if _installed > 0:
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        forget_wakeup_fd_in_child()
        if _forked_from_main and _set_parent_death_signal(signal.SIGKILL) and os.getppid() != _forking_pid:
            os._exit(1)  # the parent died before the request took effect


def _set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` (Linux; False elsewhere or when it fails). In a forked child: only
    calls the function looked up before (a lookup takes the dynamic loader's lock, which another thread of
    the parent may have held at the fork)."""
    return _prctl is not None and _prctl(1, int(sig), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG


def _find_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _install_fork_hook() -> None:
    global _fork_hook, _prctl
    if not _fork_hook:
        _prctl = _find_prctl()
        os.register_at_fork(before=_note_forking_thread, after_in_child=_own_group_in_child)
        _fork_hook = True


def checkpoint_of_step(callbacks: Sequence[Any], step: int) -> Optional[str]:
    """The checkpoint a ``Checkpointer`` (``ModelCheckpoint``) wrote of ``step``, if one did."""
    from trainforge.callbacks.base import Checkpointer

    for cb in callbacks:
        if isinstance(cb, Checkpointer) and cb.last_saved_step == step and cb.last_path:
            return cb.last_path
    return None


def stopped(
    stops: StopSignals, step: int, callbacks: Sequence[Any], is_global_zero: bool, requeue: Any = None
) -> TrainingStopped:
    """What fit raises once every checkpoint of the stop step is committed (and says on rank 0); a
    ``SlurmRequeue`` (``trainer/cluster/slurm_requeue.py``) then requeues a SLURM job stopped on its signal."""
    name = stops.stop_requested or "SIGTERM"
    path = checkpoint_of_step(callbacks, step)
    if is_global_zero:
        if path is not None:
            log.warning(
                "trainforge: stopped on %s after step %d on every rank; checkpoint %s is committed; exiting with "
                "code %d. Resume with Trainer(resume='auto') or fit(ckpt_path='last')",
                name,
                step,
                path,
                exit_code(signal.Signals[name]),
            )
        else:
            log.warning(
                "trainforge: stopped on %s after step %d on every rank, WITHOUT a checkpoint (no ModelCheckpoint "
                "saves in this run: enable_checkpointing=False or save_top_k=0); exiting with code %d",
                name,
                step,
                exit_code(signal.Signals[name]),
            )
    if requeue is not None:
        requeue.after_stop(name, is_global_zero, path)
    return TrainingStopped(name, step, path)
