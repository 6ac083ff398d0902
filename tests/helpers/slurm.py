"""A real single-node SLURM for tests: munged, slurmctld and slurmd (Debian's munge and slurm-wlm packages)
started on this machine under a temporary directory, nothing of /etc touched.

- munged runs on its own socket with a key generated here; slurm reaches it through
  ``AuthInfo=socket=...``. ``cred_expire=5`` (default 120) is how long SLURM holds a requeued job before
  it may start again, and ``sched_interval=1`` (default 60) how often it looks: a requeued job
  restarts in seconds, not minutes.
- The node is this host (``hostname -s``, address 127.0.0.1) with its CPU count; controller and node
  daemon listen on free ports; state, spool, logs and pid files live in the directory.
- ``stop()`` cancels every job, ends each daemon's process group (SIGTERM, then SIGKILL after a bounded
  wait) and then every process still carrying this cluster's marker variable (slurmstepd and the job's
  processes start sessions of their own), so nothing is left running.

``Slurm.start()`` raises ``SlurmUnavailable`` with the reason (not root, a program missing, a daemon that
did not come up, with its log's tail); the test fixture skips with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

from tests.helpers import procs
from trainforge.strategies.environment import find_free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "salloc", "scontrol", "scancel", "sinfo", "squeue", "srun")
MARKER = "TRAINFORGE_TEST_SLURM"  # in the environment of every process this cluster starts
INSTALL = "apt-get install -y --no-install-recommends slurm-wlm munge"


class SlurmUnavailable(Exception):
    """Why a SLURM cluster cannot run on this machine."""


def unavailable_reason() -> Optional[str]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a test SLURM cluster runs its daemons as root (SlurmUser=root); this test is not root"
    missing = [p for p in PROGRAMS if program(p) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} not on PATH): `{INSTALL}`"
    return None


def program(name: str) -> Optional[str]:
    """The path of ``name``: on PATH, else in the sbin directories a non-login root shell may lack."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


class Slurm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.env: Dict[str, str] = procs.test_env(SLURM_CONF=str(self.conf), **{MARKER: str(root)})
        self.daemons: Dict[str, subprocess.Popen] = {}

    # ---- start ------------------------------------------------------------------------------------
    def start(self, timeout: float = 30) -> None:
        reason = unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        munge = self.root / "munge"
        for sub in ("munge", "state", "spool"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = munge / "munge.socket"
        self._spawn(
            "munged",
            ["munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}"]
            + [f"--log-file={munge / 'munged.log'}", f"--pid-file={munge / 'munged.pid'}"]
            + [f"--seed-file={munge / 'munged.seed'}"],
        )
        self._wait(lambda: sock.exists(), 10, "munged did not create its socket", "munged")
        self.conf.write_text(self._config(sock))
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        self._wait(self._node_idle, timeout, f"node {self.host} did not come up idle", "slurmctld", "slurmd")

    def _config(self, munge_socket: Path) -> str:
        ctld_port = find_free_port()
        slurmd_port = find_free_port()
        while slurmd_port == ctld_port:
            slurmd_port = find_free_port()
        r = self.root
        lines = [
            "ClusterName=trainforge-test",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd.log'}",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "JobRequeue=1",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "KillWait=10",
            "MinJobAge=600",
            "SlurmdParameters=config_overrides",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN",
            f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]
        (r / "plugstack.conf").write_text("")
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, cmd: List[str]) -> None:
        out = open(self.root / f"{name}.out", "wb")
        self.daemons[name] = subprocess.Popen(
            [program(cmd[0]) or cmd[0], *cmd[1:]],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()

    def _node_idle(self) -> bool:
        done = self.run("sinfo", "--noheader", "--Node", "--format=%t", check=False, timeout=5)
        return done.returncode == 0 and "idle" in done.stdout

    def _wait(self, ready, timeout: float, what: str, *names: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [n for n in names if self.daemons[n].poll() is not None]
            if dead:
                break
            time.sleep(0.25)
        raise SlurmUnavailable(f"{what} within {timeout:.0f} s; {self.log_tail(*names)}")

    def log_tail(self, *names: str, chars: int = 1500) -> str:
        parts = []
        for name in names:
            for path in (self.root / f"{name}.out", self.root / f"{name}.log", self.root / "munge" / f"{name}.log"):
                if path.exists() and path.stat().st_size:
                    parts.append(f"{path.name}: {path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts) or "no daemon output"

    # ---- use --------------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, timeout: float = 15) -> subprocess.CompletedProcess:
        done = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited with {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        shown = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(part.split("=", 1) for part in shown.split() if "=" in part)

    # ---- stop -------------------------------------------------------------------------------------
    def stop(self) -> None:
        if self.conf.exists() and "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            try:
                jobs = self.run("squeue", "--noheader", "--format=%i", check=False, timeout=5).stdout.split()
                if jobs:
                    self.run("scancel", *jobs, check=False, timeout=5)
                deadline = time.monotonic() + 15
                while jobs and time.monotonic() < deadline:
                    time.sleep(0.5)
                    jobs = self.run("squeue", "--noheader", "--format=%i", check=False, timeout=5).stdout.split()
            except subprocess.TimeoutExpired:
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.pop(name, None)
            if proc is not None:
                _end_group(proc)
        _kill_marked(MARKER, str(self.root))


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process's group, SIGKILL after 10 s; waits for it (bounded)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_marked(name: str, value: str) -> None:
    """SIGKILL every process whose environment has ``name=value`` (slurmstepd and the job's processes),
    then wait until they are gone (bounded)."""
    needle = f"{name}={value}".encode()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    left.append(int(entry))
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, ValueError):
                continue
        if not left:
            return
        time.sleep(0.2)
