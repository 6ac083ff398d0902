"""One writer per run directory: a lock that the process writing a run's checkpoints holds for as long as it
writes them (the Trainer's fit, the Accelerator's automatically named saves), so that a second process started on
the same directory (a job started twice, the script run again in another terminal) stops with an error before it
writes anything, instead of overwriting the first one's checkpoints.

Guarantees, by kind of directory:

- A local directory (also a shared file system that supports ``flock``, e.g. NFSv4, Lustre with ``flock``):
  an exclusive ``fcntl.flock`` on ``<dir>/.trainforge-run.lock``. The kernel releases it when the holding
  process ends, however it ends (a crash, SIGKILL), so a dead run never leaves it held. The file names the
  holder (host, pid, start time) and is removed when the lock is released (a crashed holder's file stays,
  unlocked, and is taken over); a lock taken on a file that was removed meanwhile is taken again on the new one.
- Object storage (an fsspec URL): a lease object ``<url>/.trainforge-run.lease`` holding an owner id, the holder
  and an expiry, renewed by a daemon thread every third of ``LEASE_SECONDS``. A start finding a lease of
  another owner that has not expired is refused; a lease whose holder died lapses after ``LEASE_SECONDS``
  (then the next start takes it over). Stores have no compare-and-swap here, so a start writes its lease,
  waits ``SETTLE_SECONDS`` and reads it back: of two starts whose read and write each took less than that,
  the later write wins and the earlier start is refused. Expiry uses the holders' clocks, which are assumed to
  agree to well under ``LEASE_SECONDS``. A renewal that finds another owner's lease logs an error.

Within one process the lock is re-entrant (counted per directory): a process's own Trainers and Accelerators
never lock each other out; the guarantee is about processes.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from trainforge.strategies.checkpoint.remote import RemotePath, access_errors, access_hint, location
from trainforge.strategies.errors import CheckpointError, ConfigurationError

LOCK_FILE = ".trainforge-run.lock"
LEASE_FILE = ".trainforge-run.lease"
LEASE_SECONDS = 60.0
SETTLE_SECONDS = 0.5

log = logging.getLogger("trainforge")
# directory -> (its lock, how many holders in this process)
_held: Dict[str, Tuple[RunLock, int]] = {}
_held_guard = threading.Lock()


def _holder_note() -> Dict[str, Any]:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": started}


def _describe(note: Dict[str, Any]) -> str:
    return f"host {note.get('host', '?')}, pid {note.get('pid', '?')}, started {note.get('started', '?')}"


def _refusal(directory: str, note: Dict[str, Any], how_it_ends: str) -> CheckpointError:
    return CheckpointError(
        f"{directory} is in use by another process writing the same run ({_describe(note)}): two writers would "
        "overwrite each other's checkpoints, so this one stops before writing anything. Wait until that process "
        "ends (then resume with resume='auto' or ckpt_path='last'), stop it, or give this run its own directory "
        f"(another default_root_dir, ModelCheckpoint(dirpath=...) or project_dir). {how_it_ends}"
    )


class RunLock:
    """A held lock; ``release()`` gives it back (a no-op the second time)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.pid = os.getpid()

    def release(self) -> None:
        # A forked child (a DataLoader worker) shares the lock's open file: only the holder gives it back.
        if os.getpid() != self.pid:
            return
        with _held_guard:
            lock, count = _held.get(self.key, (None, 0))
            if lock is not self:
                return
            if count > 1:
                _held[self.key] = (lock, count - 1)
                return
            del _held[self.key]
        self._give_back()

    def _give_back(self) -> None:
        raise NotImplementedError


class _FileLock(RunLock):
    def __init__(self, directory: Path, name: str) -> None:
        import fcntl

        super().__init__(str(directory.resolve() / name))
        directory.mkdir(parents=True, exist_ok=True)
        self._path = path = directory / name
        while True:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._fd)
                raise _refusal(
                    str(directory),
                    _read_note(path),
                    f"The lock ({path}) is released by the system the moment that process ends, however it ends.",
                ) from None
            if _same_file(self._fd, path):
                break
            # its holder removed the file as it released it: lock the file that stands there now
            os.close(self._fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(_holder_note()) + "\n").encode(), 0)

    def _give_back(self) -> None:
        import fcntl

        # Removed while still held, so that whoever opens the path next gets a new file; unlocked before
        # closing: a forked child (a DataLoader worker) shares the open file and would keep the lock.
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read_note(path: Path) -> Dict[str, Any]:
    try:
        note = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return note if isinstance(note, dict) else {}


class _Lease(RunLock):
    def __init__(self, directory: RemotePath) -> None:
        super().__init__(str(directory))
        self._url = f"{directory}/{LEASE_FILE}"
        self._note = {**_holder_note(), "owner": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._take()
        self._thread = threading.Thread(target=self._renew_loop, name="trainforge-run-lease", daemon=True)
        self._thread.start()

    def _read(self) -> Optional[Dict[str, Any]]:
        fs, inner = RemotePath(self._url).fs()
        with access_errors(self._url, "read the run's lease"):
            try:
                with fs.open(inner, "rb") as f:
                    lease = json.loads(f.read().decode() or "{}")
            except FileNotFoundError:
                return None
            except ValueError:
                return {}
        return lease if isinstance(lease, dict) else {}

    def _write(self) -> None:
        fs, inner = RemotePath(self._url).fs()
        lease = {**self._note, "expires": time.time() + LEASE_SECONDS, "lease_seconds": LEASE_SECONDS}
        try:
            with access_errors(self._url, "write the run's lease"), fs.open(inner, "wb") as f:
                f.write(json.dumps(lease).encode())
        except FileNotFoundError as e:
            # a bucket that does not exist: refused before training, as every unwritable store is
            raise ConfigurationError(
                f"{self.key}: cannot write the run's lease ({type(e).__name__}: {str(e).strip()[:300]}); no "
                f"checkpoint could be saved there: {access_hint(self._url)}"
            ) from None

    def _live_other(self, lease: Optional[Dict[str, Any]]) -> bool:
        if not lease or lease.get("owner") == self._note["owner"]:
            return False
        try:
            return float(lease.get("expires", 0)) > time.time()
        except (TypeError, ValueError):
            return False

    def _take(self) -> None:
        lapse = f"A lease of a process that died lapses {LEASE_SECONDS:.0f} s after its last renewal."
        found = self._read()
        if self._live_other(found):
            raise _refusal(self.key, found or {}, lapse)
        self._write()
        time.sleep(SETTLE_SECONDS)
        found = self._read()
        if found is None or found.get("owner") != self._note["owner"]:
            raise _refusal(self.key, found or {}, lapse)

    def _renew_loop(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 3):
            try:
                found = self._read()
                if found is not None and found.get("owner") not in (None, self._note["owner"]):
                    log.error("trainforge: the run lease %s was taken by %s", self._url, _describe(found))
                    return
                self._write()
            # The next renewal retries; the lease lapses only after LEASE_SECONDS.
            except Exception as e:
                log.warning("trainforge: could not renew the run lease %s (%s)", self._url, e)

    def _give_back(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        fs, inner = RemotePath(self._url).fs()
        try:
            found = self._read()
            if found is not None and found.get("owner") == self._note["owner"]:
                fs.rm(inner)
        # The lease lapses by itself.
        except Exception as e:
            log.warning("trainforge: could not delete the run lease %s (%s)", self._url, e)


@atexit.register
def _release_all() -> None:
    # A process that ends without releasing (an Accelerator never ended) leaves no lock file behind.
    with _held_guard:
        held = [lock for lock, _ in _held.values() if lock.pid == os.getpid()]
        _held.clear()
    for lock in held:
        with contextlib.suppress(Exception):
            lock._give_back()


def acquire_run_lock(directory: Any, name: str = LOCK_FILE) -> RunLock:
    """Hold ``directory``'s run lock (a local path or an fsspec URL), or a CheckpointError naming the directory,
    the holder and what to do. Re-entrant within a process: release once per acquire. ``name``: the lock file
    of a local directory (another name locks another thing in the same folder: a tracker's file)."""
    where = location(directory)
    with _held_guard:
        key = str(where) if isinstance(where, RemotePath) else str(Path(where).resolve() / name)
        if key in _held:
            lock, count = _held[key]
            _held[key] = (lock, count + 1)
            return lock
        lock = _Lease(where) if isinstance(where, RemotePath) else _FileLock(Path(where), name)
        _held[key] = (lock, 1)
        return lock


def acquire_on_ranks(directory: Any, rank: int, broadcast: Callable[[Any, int], Any]) -> Optional[RunLock]:
    """Global rank 0 takes ``directory``'s run lock and every rank learns the outcome (a collective): on
    refusal every rank raises the same CheckpointError, so none waits for a peer that stopped. Rank 0 gets the
    lock, the others None."""
    lock, refusal, error = None, "", None
    if rank == 0:
        try:
            lock = acquire_run_lock(directory)
        except OSError:
            # The directory cannot be made (a file in its path, no permission): no process can write there, so
            # there is nothing to lock, and the checkpointing callback's own check names the path and the fix
            # (tests/callbacks/test_model_checkpoint.py::test_an_unwritable_checkpoint_directory_is_refused_at_fit_start).
            lock = None
        # Said to every rank, then raised as it is on rank 0.
        except Exception as e:
            refusal, error = str(e) or type(e).__name__, e
    refusal = broadcast(refusal, 0)
    if error is not None:
        raise error
    if refusal:
        raise CheckpointError(refusal)
    return lock
