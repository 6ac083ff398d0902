"""Writing and loading trainforge checkpoint directories: atomic, verified, safe to load.

Every strategy saves through this module (sharded ones add their own sub-directories)::

    w = CheckpointWriter(root / "step-000200", rank=r, world_size=n, barrier=strategy.barrier)
    w.save_tensors("model", state_dict, max_shard_size="5GB")  # safetensors, + HF index when sharded
    w.save_object("optimizer", optimizer.state_dict())         # torch.save; each rank its own names
    w.track("dcp/__1_0.distcp")                                # a file this rank wrote by other means
    w.finalize({"step": 200, "epoch": 1, "strategy": "ddp", "precision": "32"})  # every rank -> Path

    load_tensors(ckpt_dir, "model", device="cpu") -> dict[str, Tensor]   # aliases (tied weights) restored
    load_object(ckpt_dir, "optimizer", map_location="cpu")               # torch.load(weights_only=True)
    to_plain(obj) / from_plain(obj)   # numpy arrays and scalars <-> data weights_only accepts

and, from ``checkpoint_verify`` (re-exported here): read_metadata, verify_checkpoint,
find_latest_valid, resolve_checkpoint, write_latest_pointer, read_latest_pointer,
list_checkpoints, delete_checkpoint. The directory layout and crash guarantees are described there.

Tied weights: safetensors refuses tensors that share storage. Tensors that are the very same view
(same storage, offset, shape, stride, dtype) are written once and the other names recorded as
aliases (``trainforge_aliases`` in the safetensors header, or in the index's ``metadata`` when
sharded), as ``safetensors.torch.save_model`` does; ``load_tensors`` gives the alias the same tensor
object back, so the tie survives. Different views of one storage are cloned into separate
tensors (they load untied). Non-contiguous tensors are made contiguous. Readers of the plain
safetensors files (``transformers``, ``safetensors.torch.load_file``) see only the kept names, as
with Hugging Face's own tied-weight checkpoints.

The files of a checkpoint must be on a filesystem every rank sees (as torch.distributed.checkpoint
assumes): each rank checksums and fsyncs the files it wrote, rank 0 checksums untracked ones
(written by a backend), then writes the manifest, commits and renames.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple, Union

import safetensors
import torch
from safetensors.torch import save_file

from trainforge.strategies.checkpoint.read import (  # noqa: F401  (re-exported API)
    from_plain,
    load_object,
    load_tensors,
    refuse_sharded,
    refused_load,
    to_plain,
)
from trainforge.strategies.checkpoint.verify import (  # noqa: F401  (re-exported API)
    ASIDE,
    FORMAT_VERSION,
    METADATA_FILE,
    PARTIAL,
    RESERVED_KEYS,
    PathLike,
    check_name,
    check_rel,
    check_replaceable,
    delete_checkpoint,
    file_crc32,
    find_latest_valid,
    fsync_dir,
    list_checkpoints,
    metadata_checksum,
    read_latest_pointer,
    read_metadata,
    remove_stale,
    resolve_checkpoint,
    verify_checkpoint,
    write_latest_pointer,
)
from trainforge.strategies.checkpoint.write_errors import explain_write_errors, last_committed
from trainforge.strategies.errors import CheckpointError, ConfigurationError

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB" as Hugging Face counts it
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SAVE_ID = ".save-id"  # a random id rank 0 gives each save; stored as metadata["save_id"]


def parse_size(value: Union[int, str], what: str = "max_shard_size") -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9), ``"500MB"``, ``"2GiB"`` (2**30)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ConfigurationError(
            f"{what}={value!r} is not a size: give a positive number of bytes or a string like '5GB', '500MB' or '2GiB'"
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def _versions() -> Dict[str, str]:
    try:
        ours = importlib.metadata.version("trainforge")
    except importlib.metadata.PackageNotFoundError:
        ours = "unknown"
    return {
        "trainforge": ours,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def _dedupe(state_dict: Mapping[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Tensors safetensors accepts (contiguous, no shared storage) and the aliases {dropped: kept}."""
    groups: Dict[Tuple[str, int], List[str]] = {}
    for key, t in state_dict.items():
        if not isinstance(key, str) or not isinstance(t, torch.Tensor):
            raise ConfigurationError(
                f"save_tensors: entry {key!r} is a {type(t).__name__}; only str -> Tensor entries "
                f"go to safetensors, store other state with save_object"
            )
        if t.device.type == "meta" or t.layout != torch.strided:
            raise ConfigurationError(
                f"save_tensors: tensor {key!r} is {t.device.type}/{t.layout}; safetensors stores "
                f"dense tensors with data: materialize it, or store it with save_object"
            )
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        groups.setdefault((str(t.device), ptr) if ptr else ("", id(t)), []).append(key)
    kept: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    for names in groups.values():
        by_view: Dict[Tuple[Any, ...], str] = {}
        for key in names:
            t = state_dict[key]
            view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if view in by_view:
                aliases[key] = by_view[view]
            else:
                by_view[view] = key
        for key in by_view.values():
            t = state_dict[key].detach()
            kept[key] = t.clone(memory_format=torch.contiguous_format) if len(by_view) > 1 else t.contiguous()
    return {k: kept[k] for k in state_dict if k in kept}, aliases


class CheckpointWriter:
    """One save of one checkpoint directory, created on every rank with the same ``final_dir``.

    Everything is written under ``tmp_dir`` (``<parent>/.<name>.partial``); ``finalize`` makes it
    durable and renames it into place. ``barrier`` is the strategy's barrier (required when
    ``world_size > 1``). A leftover ``tmp_dir`` from a killed save is removed here by rank 0.
    An existing ``final_dir`` is replaced only if it is a trainforge checkpoint of the same ``kind``
    (None: any kind) or empty; anything else is refused here, before any work (``check_replaceable``)."""

    def __init__(
        self,
        final_dir: PathLike,
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Optional[Callable[[], Any]] = None,
        kind: Optional[str] = None,
    ) -> None:
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ConfigurationError(f"rank={rank!r}, world_size={world_size!r}: need 0 <= rank < world_size")
        if world_size > 1 and barrier is None:
            raise ConfigurationError(
                f"world_size={world_size} needs barrier=<the strategy's barrier callable> so rank 0 "
                f"commits only after every rank has written its files"
            )
        self.final_dir = Path(final_dir).absolute()
        check_name(self.final_dir.name)
        check_replaceable(self.final_dir, kind)  # every rank: the same shared files, the same answer
        self.root = self.final_dir.parent
        self.tmp_dir = self.root / f".{self.final_dir.name}{PARTIAL}"
        self.rank, self.world_size, self._barrier_fn = rank, world_size, barrier
        # rel path -> future of {"size", "crc32"}: each file is checksummed and, at the same time,
        # fsynced on background threads while the next file is written (zlib.crc32, fsync and file
        # I/O release the GIL), so a save costs little more than writing its bytes durably.
        self._files: Dict[str, Future[Dict[str, Any]]] = {}
        self._syncs: List[Future[None]] = []
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainforge-ckpt")
        self._done = False
        self._previous = last_committed(self.root)  # named by a failed write's error (disk full, ...)
        if rank == 0:
            with self._failing():
                self.root.mkdir(parents=True, exist_ok=True)
                if self.tmp_dir.exists():
                    shutil.rmtree(self.tmp_dir)
                self.tmp_dir.mkdir()
                _write_durable(self.tmp_dir / _SAVE_ID, uuid.uuid4().hex)
        self._barrier()
        try:  # every rank learns this save's id: it tells them later whether rank 0 committed it
            self.save_id = (self.tmp_dir / _SAVE_ID).read_text(encoding="utf-8")
        except OSError:
            raise CheckpointError(
                f"{self.tmp_dir}: not visible on rank {rank}; the checkpoint directory must be on a "
                f"filesystem every rank shares"
            ) from None

    def _barrier(self) -> None:
        if self._barrier_fn is not None:
            self._barrier_fn()

    def _failing(self) -> ContextManager[None]:
        return explain_write_errors(self.final_dir, self._previous)

    def _path(self, rel: str) -> Path:
        if self._done:
            raise ConfigurationError(f"{self.final_dir}: this writer is finalized; create a new CheckpointWriter")
        if rel in self._files:
            raise ConfigurationError(f"{rel!r} was already written to {self.tmp_dir}; give each piece its own name")
        path = self.tmp_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def track(self, rel: str) -> None:
        """Record (size, crc32) and fsync a file this rank wrote under ``tmp_dir`` by other means
        (in the background). Untracked files are still covered: rank 0 hashes them at ``finalize``."""
        path = self.tmp_dir / check_rel(rel)
        if not path.is_file():
            raise ConfigurationError(f"track({rel!r}): {path} is not a file this rank wrote under tmp_dir")
        self._syncs.append(self._hasher.submit(_fsync_file, path))
        self._files[rel] = self._hasher.submit(_entry, path)

    def _entries(self) -> Dict[str, Dict[str, Any]]:
        """Wait for the background checksums and fsyncs of this rank's files."""
        try:
            for future in self._syncs:
                future.result()
            return {rel: future.result() for rel, future in self._files.items()}
        finally:
            self._hasher.shutdown(wait=True)

    def deferred_engine(self, engine: Any) -> ContextManager[None]:
        """A synchronous save writes through a DeepSpeed engine's checkpoint engine as it is (the
        asynchronous StagingWriter defers those writes to the background)."""
        return contextlib.nullcontext()

    def save_sharded(self, state: Dict[str, Any], rel: str) -> None:
        """A torch.distributed.checkpoint save of ``state`` into ``tmp_dir/rel``, every rank writing
        its own file (collective; rank 0 hashes the files at ``finalize``)."""
        import torch.distributed.checkpoint as dcp

        with self._failing():
            dcp.save(state, checkpoint_id=str(self.tmp_dir / check_rel(rel)))

    def save_tensors(
        self,
        name: str,
        state_dict: Mapping[str, torch.Tensor],
        max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    ) -> List[str]:
        """Write ``<name>.safetensors``, or above ``max_shard_size`` bytes the shards
        ``<name>-0000i-of-0000N.safetensors`` plus ``<name>.safetensors.index.json`` (HF format).
        Returns the file names written."""
        limit = parse_size(max_shard_size)
        tensors, aliases = _dedupe(state_dict)
        sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
        shards: List[List[str]] = [[]]
        used = 0
        for key, size in sizes.items():
            if shards[-1] and used + size > limit:
                shards.append([])
                used = 0
            shards[-1].append(key)
            used += size
        base = check_rel(name)
        n = len(shards)
        names = (
            [f"{base}.safetensors"] if n == 1 else [f"{base}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        )
        with self._failing():
            for file, keys in zip(names, shards):
                header = {"format": "pt"}  # transformers refuses safetensors files without format=pt
                if n == 1 and aliases:
                    header["trainforge_aliases"] = json.dumps(aliases, sort_keys=True)
                save_file({k: tensors[k] for k in keys}, str(self._path(file)), metadata=header)
                self.track(file)
            if n > 1:
                meta: Dict[str, Any] = {"total_size": sum(sizes.values())}
                if aliases:
                    meta["trainforge_aliases"] = aliases
                index = {"metadata": meta, "weight_map": {k: f for f, keys in zip(names, shards) for k in keys}}
                file = f"{base}.safetensors.index.json"
                self._path(file).write_text(json.dumps(index, indent=2, sort_keys=True), encoding="utf-8")
                self.track(file)
                names.append(file)
        return names

    def save_object(self, name: str, obj: Any) -> str:
        """``torch.save`` to ``<name>.pt``. Refuses (ConfigurationError, nothing kept) an object that
        ``torch.load(weights_only=True)`` could not read back, e.g. numpy arrays: see ``to_plain``."""
        file = f"{check_rel(name)}.pt"
        with self._failing():
            path = self._path(file)
            torch.save(obj, path)
        check = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # torch >= 2.5
        unsafe = check(path) if check is not None else []
        if unsafe:
            path.unlink()
            raise ConfigurationError(
                f"save_object({name!r}): the object holds {', '.join(unsafe)}, which torch.load(weights_only=True) "
                f"refuses, so it could never be loaded; store tensors, numbers, strings, lists, tuples and dicts "
                f"(convert numpy values with strategies.checkpoint.io.to_plain)"
            )
        self.track(file)
        return file

    def finalize(self, metadata: Optional[Mapping[str, Any]] = None, *, update_latest: bool = True) -> Path:
        """Called by every rank. ``metadata``: ``step`` (int; None for exports without one, which
        then sort before every stepped checkpoint), ``epoch``, ``strategy``, ``precision`` and any
        JSON-serializable extras. Rank 0 writes the manifest and metadata.json, fsyncs, renames
        into place, then moves ``latest`` (unless ``update_latest=False``). Returns ``final_dir``;
        on ranks other than 0, raises CheckpointError if rank 0 failed to commit."""
        with self._failing():
            return self._finalize(metadata, update_latest)

    def _finalize(self, metadata: Optional[Mapping[str, Any]], update_latest: bool) -> Path:
        meta = self._metadata(metadata)
        entries = self._entries()
        if self.rank != 0:
            frag = self.tmp_dir / f".manifest-rank-{self.rank:05d}.json"
            _write_durable(frag, json.dumps(entries))
        self._barrier()
        if self.rank == 0:
            try:
                self._commit(meta, update_latest, entries)
            finally:  # release the other ranks even if the commit failed; they check the outcome
                self._barrier()
        else:
            self._barrier()
            try:  # final_dir cannot change before this rank joins the next save's finalize
                committed = json.loads((self.final_dir / METADATA_FILE).read_text(encoding="utf-8"))["save_id"]
            except (OSError, ValueError, KeyError, TypeError):
                committed = None
            if committed != self.save_id:
                raise CheckpointError(f"{self.final_dir}: rank 0 did not commit this checkpoint; see rank 0's error")
        self._done = True
        return self.final_dir

    def _metadata(self, metadata: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
        given = dict(metadata or {})
        reserved = [k for k in RESERVED_KEYS if k in given]
        if reserved:
            raise ConfigurationError(
                f"finalize(metadata=...): {reserved} are written by trainforge itself; remove them"
            )
        step = given.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ConfigurationError(
                f"finalize(metadata=...): step={step!r} must be a non-negative int (the trainer's global_step) or None"
            )
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "epoch": None,
            "world_size": self.world_size,
            "strategy": None,
            "precision": None,
            "versions": _versions(),
            "created": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        }
        meta.update(given)
        try:
            return json.loads(json.dumps(meta))  # canonical form: what read_metadata will see
        except (TypeError, ValueError) as e:
            raise ConfigurationError(
                f"finalize(metadata=...): not JSON-serializable ({e}); store such state with save_object"
            ) from None

    def _commit(  # noqa: C901 - the commit protocol's steps in their required order, read top to bottom
        self, meta: Dict[str, Any], update_latest: bool, entries: Dict[str, Dict[str, Any]]
    ) -> None:
        tmp = self.tmp_dir
        (tmp / _SAVE_ID).unlink()
        meta["save_id"] = self.save_id
        files, owner = dict(entries), dict.fromkeys(entries, 0)
        for frag in sorted(tmp.glob(".manifest-rank-*.json")):
            rank = int(frag.stem.rsplit("-", 1)[1])
            for rel, entry in json.loads(frag.read_text(encoding="utf-8")).items():
                if rel in files and files[rel] != entry:
                    raise CheckpointError(
                        f"{tmp / rel}: written by rank {owner[rel]} and rank {rank}; give each rank "
                        f"its own file name, e.g. f'rng/rank-{{rank:05d}}'"
                    )
                files[rel], owner[rel] = entry, rank
            frag.unlink()
        for path in sorted(tmp.rglob("*")):
            rel = path.relative_to(tmp).as_posix()
            if path.is_file() and rel != METADATA_FILE:
                if rel not in files:  # written by a backend (DCP, DeepSpeed) without track()
                    size, crc = file_crc32(path, fsync=True)
                    files[rel] = {"size": size, "crc32": crc}
                elif path.stat().st_size != files[rel]["size"]:
                    raise CheckpointError(f"{path}: changed size after it was written; two writers used {tmp}?")
        for rel in files:
            if not (tmp / rel).is_file():
                raise CheckpointError(f"{tmp / rel}: missing file (rank {owner.get(rel, 0)} wrote it) before commit")
        meta["files"] = dict(sorted(files.items()))
        meta["checksum"] = metadata_checksum(meta)
        _write_durable(tmp / METADATA_FILE, json.dumps(meta, indent=2, sort_keys=True))
        for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            fsync_dir(d)
        fsync_dir(tmp)
        aside = self.root / f".{self.final_dir.name}{ASIDE}"
        if self.final_dir.exists():  # overwrite: old copy aside first, never a moment without one
            if aside.exists():
                shutil.rmtree(aside)
            os.rename(self.final_dir, aside)
        os.rename(tmp, self.final_dir)
        fsync_dir(self.root)
        if update_latest:
            write_latest_pointer(self.root, self.final_dir.name)
        remove_stale(self.root)  # the aside copy, partials of killed saves, interrupted deletions


def _entry(path: Path) -> Dict[str, Any]:
    size, crc = file_crc32(path)
    return {"size": size, "crc32": crc}


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
