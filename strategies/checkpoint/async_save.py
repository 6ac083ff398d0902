"""Asynchronous checkpoint saves: the loop blocks only while the state is staged.

    saver = AsyncCheckpointer(strategy)          # one per run (the Accelerator owns it)
    writer = saver.open(final_dir)               # waits for the save in flight, then a CheckpointWriter
    strategy.save_checkpoint(writer, ...)        # same calls as a synchronous save: each piece of
    writer.save_object("trainer_state", state)   #   state is copied to host memory here
    writer.finalize(metadata)                    # returns at once; the write goes on in the background
    saver.check()                                # at each step: raises a finished save's error
    saver.wait()                                 # at the end of fit: the last save is committed

What happens where:
- Main thread: wait for the previous save (at most one in flight; the first wait is logged),
  create the ``CheckpointWriter`` (its tmp dir), then *stage*: every tensor handed to
  ``save_tensors``/``save_object`` is copied into host buffers and every other object deep-copied,
  so training may change the live state the moment ``finalize`` returns. Staging uses torch's
  ``DefaultStager`` (torch.distributed.checkpoint.staging) kept for the whole run: buffers are
  cached per source storage and reused by the next save (pinned on CUDA, copied with
  ``non_blocking`` then synchronised), tensors sharing storage stay shared (tied weights).
  Its size is logged once.
- FSDP2 sharded state goes through ``torch.distributed.checkpoint.async_save`` with the same
  stager and this saver's process group; DeepSpeed's engine writes through a checkpoint engine
  that stages what it is given and writes it later (DeepSpeed's own engine has no async path on
  every backend, so it is staged like the rest).
- One background thread: wait for DCP's write, write the staged files, then every rank agrees
  (all_reduce) that its part was written before ``CheckpointWriter.finalize`` checksums, fsyncs,
  renames and moves ``latest``. If any rank failed, none commits: the tmp dir stays a
  ``.partial`` that readers ignore and the next save removes, ``latest`` keeps naming the
  previous checkpoint. Actions queued with ``after_commit`` (pruning) run only after a commit.
- With several processes the background collectives use a gloo group of their own, created
  collectively at the first asynchronous save, so they never interleave with the loop's.

A failure is raised in the main thread as CheckpointError naming the checkpoint, by ``check``
(the Trainer calls it before every step), ``wait`` or the next save. The worker thread is not a
daemon and an exit hook waits too, so the process does not exit before the last save is
committed.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, cast

import torch
import torch.distributed as dist

from trainforge.strategies.checkpoint.io import DEFAULT_MAX_SHARD_SIZE, CheckpointWriter
from trainforge.strategies.checkpoint.remote import is_remote
from trainforge.strategies.checkpoint.remote_write import open_writer
from trainforge.strategies.checkpoint.write_errors import is_write_error, save_failed
from trainforge.strategies.errors import CheckpointError, ConfigurationError

log = logging.getLogger("trainforge")


def check_async_save(value: Any, where: str = "") -> Optional[bool]:
    if not isinstance(value, (bool, type(None))):
        raise ConfigurationError(
            f"{where + ': ' if where else ''}async_save={value!r} is not one of: None (on when training on CUDA, off on "
            "CPU), True (the loop waits only while the state is copied to "
            "host memory), False (the loop waits for the whole write)"
        )
    return value


def resolve_async_save(value: Optional[bool], device: torch.device) -> bool:
    """``None`` means: on for CUDA (the device time saved is worth the host copy), off on CPU,
    where staging is a full memory copy competing with training for the same cores, and off on
    other devices, where staging has not been tried (pass True to have it there)."""
    check_async_save(value)
    return device.type == "cuda" if value is None else value


class AsyncCheckpointer:
    """At most one asynchronous save in flight for one run; see the module docstring."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.stage_seconds: Optional[float] = None  # how long the loop was blocked by the last save
        self._executor: Optional[ThreadPoolExecutor] = None
        self._future: Optional[Future] = None
        self._path: Optional[Path] = None
        self._committed: Optional[Path] = None
        self._after: List[Callable[[], Any]] = []  # of the save in flight; see after_commit
        self._after_closed = False
        self._stager: Any = None
        self._group: Any = None
        self._logged_wait = self._logged_size = False
        self._lock = threading.Lock()
        self._owner = os.getpid()  # the process whose writer thread runs the saves

    # ---- main thread -------------------------------------------------------------------------
    def open(self, final_dir: Any, kind: Optional[str] = None) -> StagingWriter:
        if self._future is not None and not self._future.done() and not self._logged_wait:
            if self.strategy.is_global_zero:
                log.info(
                    "trainforge: the asynchronous save of %s is still being written; the save of %s waits for "
                    "it (logged once; save less often if this repeats)",
                    self._path,
                    final_dir,
                )
            self._logged_wait = True
        self.wait()
        started = time.perf_counter()
        s = self.strategy
        if dist.is_available() and dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank saves, in the same order
        writer = open_writer(  # a URL: staged locally, uploaded by the background job (remote.py)
            final_dir,
            rank=s.global_rank,
            world_size=s.world_size,
            barrier=self.barrier if s.world_size > 1 else None,
            kind=kind,
        )
        return StagingWriter(writer, self, started)

    def in_flight(self) -> bool:
        return self._future is not None

    def check(self) -> None:
        """Raise the error of a save that has finished; never blocks."""
        if self._future is not None and self._future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is committed; raise CheckpointError if it failed."""
        future = self._future
        if future is None:
            return
        try:
            future.result()
            self._committed = self._path
        except BaseException as e:
            if is_remote(self._path):  # the remote writer's errors name the URL and what is intact
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(
                    f"asynchronous save of {self._path} failed ({type(e).__name__}: {e}); it was not uploaded "
                    "and 'latest' was not moved"
                ) from e
            cause = e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ is not None else e
            if not is_write_error(cause):  # the writer's explanation of a failed write is re-worded, not nested
                cause = e
            raise save_failed(cast(Path, self._path), cause, self._committed, asynchronous=True) from cause
        finally:
            self._future, self._after = None, []

    def after_commit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once the save in flight is committed (now if none is); dropped if it fails
        (then ``check``/``wait`` raise its error)."""
        with self._lock:
            if self._future is not None and not self._after_closed:
                self._after.append(fn)  # the worker runs it right after the commit
                return
        self.check()  # finished (or none in flight): raises if it failed
        fn()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    # ---- staging -----------------------------------------------------------------------------
    @property
    def stager(self) -> Any:
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.strategy.root_device.type == "cuda"
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
                )
            )
        return self._stager

    def stage(self, obj: Any) -> Any:
        return self.stager.stage(obj)

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def all_ok(self, ok: bool) -> bool:
        if self._group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _submit(self, path: Path, job: Callable[[], None], staged: List[Any]) -> None:
        if not self._logged_size and self.strategy.is_global_zero:
            pinned = " pinned" if self.strategy.root_device.type == "cuda" else ""
            log.info(
                "trainforge: asynchronous checkpoints stage %.1f MB of%s host memory on rank 0, reused by "
                "every save (logged once)",
                _nbytes(staged) / 1e6,
                pinned,
            )
            self._logged_size = True
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="trainforge-async-ckpt", initializer=_lower_priority
            )
            # Run before concurrent.futures' own exit hook (threading's exit hooks run last-registered
            # first): after that one, the writer's checksum threads could no longer be started.
            self._owner = os.getpid()
            getattr(threading, "_register_atexit", atexit.register)(self._at_exit)
        after: List[Callable[[], Any]] = []

        def run() -> None:
            job()
            with self._lock:  # from here on, after_commit runs its action in the main thread
                self._after_closed = True
            for fn in after:  # pruning: only once the new checkpoint is committed
                try:
                    fn()
                except Exception as e:  # the save itself is committed: report, do not fail it
                    log.warning("trainforge: after committing %s: %s: %s", path, type(e).__name__, e)

        self._path, self._after, self._after_closed = path, after, False
        self._last_staged = staged  # what the newest save staged (tests look at its buffers)
        self._future = self._executor.submit(run)

    def _at_exit(self) -> None:
        # A process forked from this one (a DataLoader worker) inherits the hook but not the writer
        # thread: waiting there for the save in flight would hang its exit until the DataLoader
        # kills it (5 s per worker at every epoch's end). The save is the parent's to finish.
        if os.getpid() != self._owner:
            return
        try:
            self.close()
        except CheckpointError as e:
            log.error("trainforge: %s", e)


class StagingWriter:
    """Stands in for a ``CheckpointWriter`` during an asynchronous save: the same calls, but each
    stages its state now and writes it in the background after ``finalize``."""

    def __init__(self, writer: CheckpointWriter, saver: AsyncCheckpointer, started: float) -> None:
        self._writer, self._saver, self._started = writer, saver, started
        self._ops: List[Callable[[], Any]] = []
        self._staged: List[Any] = []
        self._dcp: List[Future] = []
        self.final_dir, self.tmp_dir, self.root = writer.final_dir, writer.tmp_dir, writer.root
        self.rank, self.world_size, self.save_id = writer.rank, writer.world_size, writer.save_id

    def save_tensors(self, name: str, state_dict: Any, max_shard_size: Any = DEFAULT_MAX_SHARD_SIZE) -> None:
        staged = self._saver.stage(dict(state_dict))
        self._staged.append(staged)
        self._ops.append(lambda: self._writer.save_tensors(name, staged, max_shard_size=max_shard_size))

    def save_object(self, name: str, obj: Any) -> str:
        staged = self._saver.stage(obj)
        self._staged.append(staged)
        self._ops.append(lambda: self._writer.save_object(name, staged))
        return f"{name}.pt"

    def track(self, rel: str) -> None:
        self._writer.track(rel)  # the file exists already: its checksum runs in the background anyway

    def save_sharded(self, state: Dict[str, Any], rel: str) -> None:
        """``torch.distributed.checkpoint.async_save`` into ``tmp_dir/rel``: staged now with this
        run's stager, written by DCP's thread over this saver's gloo group."""
        import torch.distributed.checkpoint as dcp

        self._staged.append(state)  # counted in the logged staging size (DCP stages it)
        # a Future (not an AsyncSaveResponse): the stager stages synchronously (use_async_staging=False)
        self._dcp.append(
            cast(
                Future,
                dcp.async_save(
                    state,
                    checkpoint_id=str(self.tmp_dir / rel),
                    process_group=self._saver._group,
                    async_stager=self._saver.stager,
                ),
            )
        )

    @contextlib.contextmanager
    def deferred_engine(self, engine: Any) -> Iterator[None]:
        """While inside, a DeepSpeed engine's ``checkpoint_engine.save(state, path)`` stages the state
        and the write happens in the background through the same checkpoint engine."""
        original = engine.checkpoint_engine
        writer = self

        class Staging:
            def __getattr__(self, name: str) -> Any:
                return getattr(original, name)

            def save(self, state_dict: Any, path: str) -> None:
                staged = writer._saver.stage(state_dict)
                writer._staged.append(staged)
                writer._ops.append(lambda: original.save(staged, path))

        engine.checkpoint_engine = Staging()
        try:
            yield
        finally:
            engine.checkpoint_engine = original

    def finalize(self, metadata: Optional[Dict[str, Any]] = None, *, update_latest: bool = True) -> Path:
        """Queue the write and commit; returns ``final_dir`` (committed once ``wait`` returns)."""
        meta = copy.deepcopy(dict(metadata or {}))
        writer, saver, ops, dcp_futures = self._writer, self._saver, self._ops, self._dcp

        def job() -> None:
            error: Optional[BaseException] = None
            try:
                for future in dcp_futures:
                    future.result()
                for op in ops:
                    op()
            except BaseException as e:  # still join the vote below, so no rank waits forever
                error = e
            all_ok = saver.all_ok(error is None)
            if error is not None:
                raise error
            if not all_ok:
                raise CheckpointError(f"{writer.final_dir}: another rank failed to write its part; see its error")
            writer.finalize(meta, update_latest=update_latest)

        saver._submit(writer.final_dir, job, self._staged)
        saver.stage_seconds = time.perf_counter() - self._started
        return writer.final_dir


WRITER_NICENESS = (
    10  # added to the nice value; measured on a 2-core CPU run: window throughput with one async save 0.63 -> 0.74
)


def _lower_priority() -> None:
    """The background writer (and the checksum threads it starts, which inherit this) yields the
    CPU to the training threads: on a busy host a write that competes at equal priority slows every
    step (a CPU run's intra-op threads wait at their barriers for a descheduled peer). Linux
    threads have their own nice value; elsewhere this does nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICENESS))
    except (AttributeError, OSError):
        pass


def _nbytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages inside ``obj`` (DTensors count their local shard)."""
    seen: Dict[int, int] = {}

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            storage = local.untyped_storage()
            seen[storage.data_ptr() or id(local)] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(obj)
    return sum(seen.values())
