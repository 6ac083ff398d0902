"""SLURM auto-requeue: a batch job signalled before its time limit or a preemption saves, requeues itself
and, started again by SLURM with the same script, resumes where it stopped (what Lightning's
``SLURMEnvironment(auto_requeue=True)`` does).

``Trainer(auto_requeue=True, requeue_signal="SIGUSR1")`` (the defaults), in a SLURM batch job:

- The requeue signal is one of the stop signals (``trainer/cluster/stop_signals.py``): every rank stops after
  the same step and saves it; once that checkpoint is committed, global rank 0 runs
  ``scontrol requeue <job>`` (``<array job>_<task>`` for a task of a job array) and says so, and every
  process exits with 128 + the signal number (138 for SIGUSR1). SLURM ends the job's processes and
  queues the job again under the same id; the output file is appended to with ``--open-mode=append``.
- The job started again (SLURM_RESTART_COUNT >= 1) resumes its own run: checkpoints record the SLURM job
  that wrote them (``slurm_job`` in metadata.json), and the job resumes from the newest one this job wrote,
  from scratch when there is none (with ``Trainer(resume="auto")`` given too: from the newest of any run).
  A newer checkpoint of another run in the same directory (another job, a run outside SLURM) is left alone
  and named in the warning, beside the one resumed. The final weights are those of a run never stopped.
- Other stop signals (SIGTERM: ``scancel``, the time limit itself, a node going down) save and exit
  without requeueing: a job someone cancelled stays cancelled.
- Not requeued: an interactive allocation (``salloc``, ``srun --pty``: SLURM_JOB_NAME "bash" or
  "interactive", or ``scontrol show job`` saying BatchFlag=0), and a job submitted with ``--no-requeue``
  (or under ``JobRequeue=0`` without ``--requeue``: Requeue=0); each is said, with what to change.
- A failed ``scontrol`` (not installed, refused, timed out) is reported with its output; the
  checkpoint is committed all the same, so submitting the script again resumes from it.

Signals under SLURM: ``#SBATCH --signal=USR1@90`` signals the job's steps (every process ``srun``
started: a launcher and its workers alike) 90 s before the time limit; ``B:USR1@90`` would signal only
the batch shell, which does not pass it on. ``examples/slurm/`` has sbatch scripts for one and several
nodes, ``docs/guides/multi-node.md`` explains them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Any, Mapping, Optional, Sequence, Union

from trainforge.strategies.checkpoint.io import read_metadata
from trainforge.strategies.checkpoint.remote import RemotePath, read_remote_metadata
from trainforge.strategies.checkpoint.remote_read import Location, list_checkpoints_at
from trainforge.strategies.environment import slurm_job_id, slurm_restart_count
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.cluster.stop_signals import parse_stop_signals

log = logging.getLogger("trainforge")

# one scontrol call (slurmctld answers in milliseconds when it is up); both calls fit well inside the
# launcher's grace period after a signal (--shutdown-timeout, 30 s by default) with the save before them
SCONTROL_TIMEOUT_S = 10
SignalArg = Union[str, int, signal.Signals]


class SlurmRequeue:
    """The requeue settings of one Trainer, and what they mean for this process's SLURM job."""

    def __init__(
        self,
        auto_requeue: bool,
        requeue_signal: SignalArg,
        stop_signals: Sequence[signal.Signals],
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        if not isinstance(auto_requeue, bool):
            raise ConfigurationError(
                f"Trainer(auto_requeue={auto_requeue!r}) must be True (a SLURM batch job signalled with "
                "requeue_signal saves, requeues itself and resumes) or False (it saves and exits)"
            )
        where = "Trainer(requeue_signal)"
        if requeue_signal is None or isinstance(requeue_signal, (list, tuple, set)):
            raise ConfigurationError(
                f"{where}={requeue_signal!r} must be one signal name such as 'SIGUSR1' (what "
                "#SBATCH --signal=USR1@90 sends); to not requeue, pass Trainer(auto_requeue=False)"
            )
        try:
            parsed = parse_stop_signals(requeue_signal, where)  # names the value and the valid choices
        except ConfigurationError as error:  # without the stop_signals-only "None catches none"
            raise ConfigurationError(str(error).replace("; None catches none", "")) from None
        if len(parsed) != 1:
            raise ConfigurationError(f"{where}={requeue_signal!r} must be one signal name such as 'SIGUSR1'")
        self.enabled, self.signal = auto_requeue, parsed[0]
        # outside a SLURM job nothing is requeued: stop_signals without the requeue signal is simply a choice
        in_slurm = auto_requeue and bool(stop_signals) and slurm_job_id(environ) is not None
        if in_slurm and self.signal not in stop_signals:
            raise ConfigurationError(
                f"{where}={self.signal.name!r} is not one of Trainer(stop_signals)="
                f"{tuple(s.name for s in stop_signals)}: in this SLURM job the run would not stop on it, so nothing "
                f"would be saved before the requeue. Add {self.signal.name} to stop_signals, pick one of them as "
                "requeue_signal, or pass auto_requeue=False"
            )
        self.active = auto_requeue and bool(stop_signals)  # nothing caught: nothing to requeue on
        self.job_id = slurm_job_id(environ) if self.active else None
        self.restarts = slurm_restart_count(environ) if self.job_id is not None else 0
        # "auto" was chosen for this job because SLURM started it again, not by the user
        self.requeued = False

    @property
    def restarted(self) -> bool:
        """Whether this is a job SLURM started again (requeued, or after a node failure)."""
        return self.job_id is not None and self.restarts >= 1

    def resume(self, resume: Optional[str], is_global_zero: bool) -> Optional[str]:
        """``resume`` for this run: "auto" in a job SLURM started again (requeued), else as given."""
        if not self.restarted or resume is not None:
            return resume
        self.requeued = True
        return "auto"

    def own_checkpoint(self, root: Location, rank: int, broadcast: Any) -> Optional[str]:
        """What a restarted job resumes from (``fit``'s ``ckpt_path``): the newest checkpoint under ``root``
        this job wrote; else, when the user asked for ``resume="auto"``, ``"last"`` (any run's), else None (a
        fresh start). Rank 0 chooses and says which, naming a newer checkpoint of another run it leaves
        alone; every rank gets the same answer (a collective)."""
        chosen = ""
        if rank == 0:
            chosen = self._choose(root)
        return broadcast(chosen, 0) or None

    def _choose(self, root: Location) -> str:
        stamped = [(p, _job_of(p)) for p in list_checkpoints_at(root)]
        own = [p for p, job in stamped if job == self.job_id]
        newest = stamped[-1] if stamped else None
        fallback = "" if self.requeued else "last"
        chosen = str(own[-1]) if own else fallback
        other = ""
        if newest is not None and newest[1] != self.job_id:
            writer = f"SLURM job {newest[1]}" if newest[1] else "a run outside SLURM (or an older trainforge)"
            other = f"; the newest checkpoint there, {newest[0]}, was written by {writer} and is not this job's"
        what = (
            f"from {chosen}, its own newest checkpoint"
            if own
            else (
                "from the newest checkpoint of any run (resume='auto')" if chosen else "from scratch: it wrote none yet"
            )
        )
        log.warning(
            "trainforge: SLURM job %s was started again (SLURM_RESTART_COUNT=%d): it resumes %s under %s%s "
            "(Trainer(auto_requeue=False) turns this off)",
            self.job_id,
            self.restarts,
            what,
            root,
            other,
        )
        return chosen

    def applies(self, signal_name: Optional[str]) -> bool:
        """Whether a stop on ``signal_name`` requeues this job (the same answer on every rank)."""
        return self.job_id is not None and signal_name == self.signal.name

    def after_stop(self, signal_name: Optional[str], is_global_zero: bool, checkpoint: Optional[str]) -> None:
        """Once every checkpoint of the stop step is committed: rank 0 requeues the job. Every rank then
        ignores SIGTERM (SLURM sends it to each process of a requeued job), so it exits with its own
        code and its log complete; rank 0 takes SIGTERM back if the requeue failed."""
        if not self.applies(signal_name) or self.job_id is None:
            return
        previous = _ignore_sigterm()
        if is_global_zero and not requeue_slurm_job(self.job_id, checkpoint) and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _job_of(path: Location) -> Optional[str]:
    meta = read_remote_metadata(path) if isinstance(path, RemotePath) else read_metadata(path)
    job = meta.get("slurm_job")
    return str(job) if job is not None else None


def requeue_slurm_job(job_id: Optional[str] = None, checkpoint: Optional[str] = None) -> bool:
    """``scontrol requeue job_id`` (default: this process's SLURM job) unless the job cannot be requeued;
    True when SLURM took it. Call it on one process, after the checkpoint is committed (the Trainer does;
    a loop on the Accelerator calls it after ``save_state``). Every outcome is logged; a failure names
    scontrol's output and what to do instead (nothing is lost: the checkpoint was committed before)."""
    saved = f"checkpoint {checkpoint} is committed" if checkpoint else "no checkpoint was written (none configured)"
    job_id = job_id if job_id is not None else slurm_job_id()
    if job_id is None:
        log.warning(
            "trainforge: not requeued: this is not a SLURM batch job (SLURM_JOB_ID unset, or an interactive "
            "allocation); %s",
            saved,
        )
        return False
    shown = _scontrol(["show", "job", "--oneliner", job_id])
    fields = dict(part.split("=", 1) for part in shown.stdout.split() if "=" in part) if shown else {}
    why_not = {
        "0": "it is not a batch job (an interactive allocation: salloc or srun), which SLURM cannot requeue",
    }.get(fields.get("BatchFlag", ""))
    if why_not is None and fields.get("Requeue") == "0":
        why_not = "it was submitted with --no-requeue (or JobRequeue=0 without --requeue); submit it with --requeue"
    if why_not is not None:
        log.warning("trainforge: SLURM job %s is not requeued: %s. %s", job_id, why_not, saved)
        return False
    log.warning("trainforge: requeuing SLURM job %s (scontrol requeue %s); %s", job_id, job_id, saved)
    done = _scontrol(["requeue", job_id])
    if done is not None and done.returncode == 0:
        log.warning(
            "trainforge: requeued SLURM job %s: SLURM starts it again with the same script, which resumes "
            "from the newest checkpoint",
            job_id,
        )
        return True
    output = "scontrol was not found on PATH" if done is None else _output(done)
    log.error(
        "trainforge: `scontrol requeue %s` failed (%s); the job is NOT requeued. %s: submit the job script "
        "again to resume from it",
        job_id,
        output,
        saved,
    )
    return False


def _scontrol(args: Sequence[str]) -> Optional[Any]:
    """``scontrol args`` (bounded in time; a timeout is a failed call), or None when there is no scontrol."""
    try:
        return subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired as timeout:
        out = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else (timeout.stdout or "")
        return subprocess.CompletedProcess(timeout.cmd, -1, out, f"no answer in {SCONTROL_TIMEOUT_S} s")


def _output(done: Any) -> str:
    text = " ".join(f"{done.stdout or ''} {done.stderr or ''}".split())
    return f"exit code {done.returncode}: {text or 'no output'}"


def _ignore_sigterm() -> Any:
    """SIGTERM ignored from now on where it had its default action; the previous handler, else None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return previous
