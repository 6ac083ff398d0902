"""Checkpoints in object storage: any fsspec URL (``s3://bucket/run``, ``gs://``, ``az://``, ``memory://``)
with the guarantees of a local checkpoint directory.

Design. Object stores have no atomic rename, so visibility comes from the order of the uploads:

- Writing: the existing writer (``io.CheckpointWriter``, and with it every strategy's format, DCP
  shards included) writes the checkpoint unchanged into a local *staging* directory
  (``<tmp>/trainforge-<uid>/staging/<hash of the URL's parent>/``, the same path on every rank of a
  node, so ranks share it as they share a checkpoint directory); it commits there (checksums, the
  manifest ``metadata.json`` with every rank's files, rename). Then global rank 0 uploads the
  checkpoint's files under ``<url>/``: first a marker object ``<url>/.trainforge-upload`` (this
  prefix is ours), then every file the manifest lists, then the manifest, then ``<parent>/latest``,
  then it deletes the marker and the staging copy. A checkpoint is a prefix holding ``metadata.json``:
  until the manifest is uploaded nothing lists, loads or prunes it; a failed or killed upload
  leaves the previous checkpoint the one ``latest`` names. The other ranks wait at a barrier and
  check that the manifest in the store carries this save's id (else ``CheckpointError``). Every
  rank's files are in the manifest because the local commit refuses a manifest without them
  (``io.CheckpointWriter._commit``), and only files of that manifest are uploaded.
- Replacing ``<url>`` (``last``): refused unless the prefix holds a trainforge checkpoint (readable
  manifest) of the same kind, our marker of a killed upload, or nothing; the old manifest is
  deleted first (the old copy stops being a checkpoint before any of its files change), then the
  files it listed. While ``last`` is re-uploaded, readers fall back to the newest other checkpoint.
- Reading (``remote_read.py``): list ``<root>/*/metadata.json``; take the one ``latest`` names, else
  the newest by (step, created); download the files its manifest lists into a per-rank cache
  directory and verify them with ``verify_checkpoint`` (sizes and crc32); on failure warn with the
  reason and try the next newest. Rank 0 chooses, the others download the same one.
- Pruning deletes only a prefix directly under the checkpoint root whose manifest reads, the
  manifest first, then exactly the files that manifest lists: a user's object under the prefix, or
  in a checkpoint's folder, is never deleted; the checkpoint ``latest`` names is never deleted.
- Asynchronous saves: ``async_save.AsyncCheckpointer`` opens this writer instead of the local one;
  the upload is part of its background job (the exit hook waits for it).
- Several nodes: not yet. The staging directory is on each node's local disk, so rank 0 would not see
  the other nodes' files; a save from ranks on several nodes (detected from the launcher's environment:
  LOCAL_WORLD_SIZE < WORLD_SIZE) is refused on every rank before any work, naming what to do instead.

Local paths never reach this module's fsspec code: ``is_remote`` is a string test, and fsspec is
imported only for URLs. Credentials and endpoints come from fsspec's usual sources (for S3 the
AWS environment or profile, ``AWS_ENDPOINT_URL`` for another endpoint, or fsspec's configuration).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple, Union, cast

from trainforge.strategies.checkpoint.io import CheckpointWriter
from trainforge.strategies.checkpoint.verify import (
    LATEST_FILE,
    METADATA_FILE,
    PathLike,
    check_name,
    check_rel,
    parse_metadata,
)
from trainforge.strategies.environment import detect_environment
from trainforge.strategies.errors import CheckpointError, ConfigurationError

MARKER = ".trainforge-upload"  # under a prefix while trainforge uploads a checkpoint there
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_PACKAGES = {"s3": "s3fs (pip install 'trainforge[s3]')", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL (``proto://...``) rather than a local path; imports nothing."""
    if isinstance(path, RemotePath):
        return True
    return isinstance(path, str) and _URL_RE.match(path) is not None


class RemotePath:
    """A URL with the few ``pathlib.Path`` operations checkpoint code uses: ``/``, ``name``, ``parent``,
    ``exists()``; ``str()`` gives the URL. Not ``os.PathLike``: local file code never takes it silently."""

    __slots__ = ("url",)

    def __init__(self, url: Union[str, "RemotePath"]) -> None:
        url = str(url)
        if not is_remote(url):
            raise ConfigurationError(f"{url!r} is not a URL (protocol://...)")
        protocol, rest = url.split("://", 1)
        rest = rest.rstrip("/")
        if not rest:
            raise ConfigurationError(f"{url!r}: the URL names no bucket or folder, e.g. s3://bucket/run")
        self.url = f"{protocol.lower()}://{rest}"

    @property
    def protocol(self) -> str:
        return self.url.split("://", 1)[0]

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[1].rsplit("/", 1)[-1]

    @property
    def parent(self) -> "RemotePath":
        protocol, rest = self.url.split("://", 1)
        return RemotePath(f"{protocol}://{rest.rsplit('/', 1)[0]}") if "/" in rest else self

    def __truediv__(self, rel: str) -> "RemotePath":
        return RemotePath(f"{self.url}/{rel}")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def fs(self) -> Tuple[Any, str]:
        """(fsspec filesystem, path inside it), listings not cached (other processes write too)."""
        fs, inner = filesystem(self.url)
        fs.invalidate_cache()
        return fs, inner

    def exists(self) -> bool:
        fs, inner = self.fs()
        return bool(fs.exists(inner))


def location(path: Any) -> Union[Path, RemotePath]:
    """``path`` as a ``Path`` (local) or a ``RemotePath`` (URL)."""
    return RemotePath(path) if is_remote(path) else Path(path)


def filesystem(url: str) -> Tuple[Any, str]:
    """fsspec's filesystem for ``url`` and the path inside it, or a ConfigurationError naming the URL and
    the package to install."""
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec
        import fsspec.core
    except ImportError:
        raise ConfigurationError(
            f"{url!r}: checkpoints in object storage need fsspec and the package of the protocol; pip install "
            f"'trainforge[s3]' (or fsspec with {_PACKAGES.get(protocol, 'the package of ' + protocol + '://')})"
        ) from None
    try:
        fsspec.get_filesystem_class(protocol)
        fs, inner = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        package = _PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
        raise ConfigurationError(
            f"{url!r}: fsspec cannot open {protocol}:// URLs here ({e}); install {package}, or save to a local "
            "directory"
        ) from None
    return fs, inner


def check_protocol(url: str) -> None:
    """Fail now (ConfigurationError) if ``url``'s protocol has no installed fsspec implementation."""
    filesystem(str(url))


def _cache_base() -> Path:
    try:
        user = getpass.getuser()
    except Exception:  # no user name (containers): the uid keeps users apart
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"trainforge-{user}"


def _digest(url: str) -> str:
    return hashlib.sha1(url.encode("utf-8")).hexdigest()[:16]


def staging_root(root: RemotePath) -> Path:
    """Where checkpoints of ``root`` are written before upload: the same path on every rank of a node."""
    return _cache_base() / "staging" / _digest(root.url)


def cache_dir(root: RemotePath, rank: int) -> Path:
    """Where rank ``rank`` downloads checkpoints of ``root`` to load them."""
    return _cache_base() / "cache" / _digest(root.url) / f"rank{rank}"


def read_remote_metadata(path: RemotePath) -> Dict[str, Any]:
    """The checked manifest of the checkpoint at ``path`` (CheckpointError when there is none or it is bad)."""
    fs, inner = path.fs()
    where = f"{path.url}/{METADATA_FILE}"
    try:
        data = fs.cat_file(f"{inner}/{METADATA_FILE}")
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing object; {path.url} is not a complete trainforge checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"{where}: cannot be read ({type(e).__name__}: {e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: unparsable metadata ({e}); the checkpoint is corrupted") from None
    return parse_metadata(text, where)


def listed_files(meta: Mapping[str, Any], where: str) -> List[str]:
    """The manifest's file names, each a safe relative name (a manifest is data, never trusted)."""
    out = []
    for rel in meta["files"]:
        if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/") or rel == METADATA_FILE:
            raise CheckpointError(f"{where}: invalid manifest entry {rel!r}; the manifest is corrupted")
        out.append(rel)
    return out


def claim(path: RemotePath, kind: Optional[str]) -> Optional[Dict[str, Any]]:
    """Check that a save may write ``path`` (nothing there, our marker of a killed upload, or a trainforge
    checkpoint of the same ``kind``) and return the manifest of the checkpoint it would replace (None: none).
    Anything else is refused (ConfigurationError) before any work: nothing trainforge did not write is replaced."""
    fs, inner = path.fs()
    names = sorted(p[len(inner) + 1 :] for p in fs.find(inner))
    if not names or MARKER in names and METADATA_FILE not in names:
        return None
    if METADATA_FILE in names:
        try:
            meta = read_remote_metadata(path)
        except CheckpointError:
            meta = None
        found = meta.get("kind", "trainer") if meta is not None else None
        if meta is not None and (kind is None or found == kind):
            return meta
        what = f"a trainforge {found!r} checkpoint, not {kind!r}" if found is not None else "an unreadable checkpoint"
    else:
        what = "not a trainforge checkpoint"
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    raise ConfigurationError(
        f"refusing to save into {path.url!r}: it exists and is {what}, holding {shown}; saving replaces it and "
        f"would delete them. Give a new name (e.g. {str(path / 'checkpoint')!r}), or remove it yourself"
    )


def remove_checkpoint_objects(path: RemotePath, meta: Optional[Mapping[str, Any]]) -> None:
    """Delete a checkpoint: its manifest first (it stops being a checkpoint at once), then the files the
    manifest lists and our marker; other objects under the prefix stay. ``meta`` None: a killed upload of ours
    (marker, no manifest): everything under the prefix goes."""
    fs, inner = path.fs()
    if meta is None:
        found = fs.find(inner)
        if found:
            fs.rm(found)
        return
    fs.rm_file(f"{inner}/{METADATA_FILE}")
    doomed = [f"{inner}/{rel}" for rel in listed_files(meta, path.url)] + [f"{inner}/{MARKER}"]
    present = set(fs.find(inner))
    existing = [p for p in doomed if p in present]
    if existing:
        fs.rm(existing)


def upload(local: Path, dest: RemotePath, update_latest: bool, replaced: Optional[Mapping[str, Any]]) -> None:
    """Upload a committed local checkpoint to ``dest`` in the order that makes it visible only when complete."""
    meta = json.loads((local / METADATA_FILE).read_text(encoding="utf-8"))
    fs, inner = dest.fs()
    local_fs = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if replaced is None:  # claim() found nothing there or a killed upload of ours: clear it
        remove_checkpoint_objects(dest, None)
    if local_fs:
        fs.makedirs(inner, exist_ok=True)
    fs.pipe_file(f"{inner}/{MARKER}", meta["save_id"].encode("utf-8"))
    if replaced is not None:  # the old copy stops being a checkpoint (manifest first), then its files go
        remove_checkpoint_objects(dest, replaced)
    files = listed_files(meta, str(local / METADATA_FILE))
    if local_fs:
        for folder in sorted({rel.rsplit("/", 1)[0] for rel in files if "/" in rel}):
            fs.makedirs(f"{inner}/{folder}", exist_ok=True)
    if files:
        fs.put([str(local / rel) for rel in files], [f"{inner}/{rel}" for rel in files])
    fs.put_file(str(local / METADATA_FILE), f"{inner}/{METADATA_FILE}")  # from here on it is a checkpoint
    if update_latest:
        root_inner = inner.rsplit("/", 1)[0]
        fs.pipe_file(f"{root_inner}/{LATEST_FILE}", (dest.name + "\n").encode("utf-8"))
    fs.rm_file(f"{inner}/{MARKER}")


class RemoteCheckpointWriter:
    """``io.CheckpointWriter``'s interface for a URL: the writer writes into local staging, ``finalize``
    commits there and uploads (module docstring). Created on every rank with the same URL."""

    def __init__(
        self,
        url: Union[str, RemotePath],
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Optional[Callable[[], Any]] = None,
        kind: Optional[str] = None,
    ) -> None:
        self.final_dir = RemotePath(url)
        self.root = self.final_dir.parent
        check_name(self.final_dir.name)
        if world_size > 1:
            _refuse_several_nodes(self.final_dir, world_size)
        self._replaced = claim(self.final_dir, kind)  # every rank: the same objects, the same answer
        self._barrier_fn = barrier
        local_final = staging_root(self.root) / self.final_dir.name
        try:
            self._local = CheckpointWriter(local_final, rank=rank, world_size=world_size, barrier=barrier, kind=None)
        except CheckpointError as e:
            raise CheckpointError(
                f"{self.final_dir.url}: checkpoints in object storage are staged in {local_final.parent} on local "
                f"disk, which every rank must see; it is not shared here ({e}). Run the ranks of one save on one "
                "node, or save to a shared filesystem"
            ) from None
        self.tmp_dir, self.rank, self.world_size = self._local.tmp_dir, rank, world_size
        self.save_id = self._local.save_id

    def track(self, rel: str) -> None:
        self._local.track(rel)

    def deferred_engine(self, engine: Any) -> ContextManager[None]:
        return self._local.deferred_engine(engine)

    def save_sharded(self, state: Dict[str, Any], rel: str) -> None:
        self._local.save_sharded(state, rel)

    def save_tensors(self, name: str, state_dict: Mapping[str, Any], max_shard_size: Any = None) -> List[str]:
        if max_shard_size is None:
            return self._local.save_tensors(name, state_dict)
        return self._local.save_tensors(name, state_dict, max_shard_size=max_shard_size)

    def save_object(self, name: str, obj: Any) -> str:
        return self._local.save_object(check_rel(name), obj)

    def finalize(self, metadata: Optional[Mapping[str, Any]] = None, *, update_latest: bool = True) -> RemotePath:
        """Every rank: commit locally, rank 0 uploads, then every rank checks the store holds this save."""
        local = self._local.finalize(metadata, update_latest=False)
        error: Optional[BaseException] = None
        if self.rank == 0:
            try:
                upload(local, self.final_dir, update_latest, self._replaced)
            except Exception as e:  # the other ranks are released below, then this rank raises
                error = e
        if self._barrier_fn is not None and self.world_size > 1:
            self._barrier_fn()
        if self.rank == 0:
            shutil.rmtree(local, ignore_errors=True)
            if error is not None:
                raise CheckpointError(
                    f"upload of {self.final_dir.url} failed ({type(error).__name__}: {str(error).strip()[:500]}); "
                    f"it is not a checkpoint (no manifest was uploaded) and {self.root / LATEST_FILE} still names "
                    "the previous one. Check the store (bucket, credentials, endpoint, quota) and save again"
                ) from error
        else:
            try:
                committed = read_remote_metadata(self.final_dir).get("save_id")
            except CheckpointError:
                committed = None
            if committed != self.save_id:
                raise CheckpointError(f"{self.final_dir.url}: rank 0 did not upload this checkpoint; see its error")
        return self.final_dir


def _refuse_several_nodes(url: RemotePath, world_size: int) -> None:
    """Every rank, before any collective: the staging directory is on local disk, which ranks on other nodes
    do not see (each node uploading its own files is not implemented yet)."""
    try:
        env = detect_environment()
    except ConfigurationError:
        return
    if env.world_size == world_size and env.local_world_size < world_size:
        nodes = -(-world_size // env.local_world_size)
        raise ConfigurationError(
            f"saving {url.url} from {world_size} processes on {nodes} nodes ({env.kind}: {env.local_world_size} per "
            "node): checkpoints in object storage are staged on local disk and uploaded by rank 0, which does not "
            "see the other nodes' files. Save to a filesystem every node mounts (ModelCheckpoint(dirpath=...) or "
            "default_root_dir) and copy it to the bucket, or train on one node"
        )


def open_writer(
    path: Union[PathLike, RemotePath],
    *,
    rank: int,
    world_size: int,
    barrier: Optional[Callable[[], Any]],
    kind: Optional[str] = None,
) -> Any:
    """A ``CheckpointWriter`` for a local path (today's path, untouched), a ``RemoteCheckpointWriter`` for a URL."""
    if is_remote(path):
        return RemoteCheckpointWriter(
            path if isinstance(path, RemotePath) else str(path),
            rank=rank,
            world_size=world_size,
            barrier=barrier,
            kind=kind,
        )
    return CheckpointWriter(cast(PathLike, path), rank=rank, world_size=world_size, barrier=barrier, kind=kind)
