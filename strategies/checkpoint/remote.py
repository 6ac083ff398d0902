"""Checkpoints in object storage: any fsspec URL (``s3://bucket/run``, ``gs://``, ``az://``, ``memory://``)
with the guarantees of a local checkpoint directory. This module: URLs, the filesystem, manifests in the store,
replacing and deleting; ``remote_write.py`` writes, ``remote_read.py`` lists, loads and prunes.

Design. Object stores have no atomic rename, so visibility comes from the order of the uploads:

- Writing: the existing writer (``io.CheckpointWriter``, and with it every strategy's format, DCP
  shards included) writes the checkpoint unchanged into a local *staging* directory
  (``<tmp>/trainforge-<user>/staging/<hash of the URL's parent>/node<k>/``: the same path on every rank of
  node k, so its ranks share it as they share a checkpoint directory) and commits there (checksums, a
  manifest of every file the node's ranks wrote, rename). Each node's local rank 0 uploads its files under
  ``<url>/`` and then its file list; after a barrier global rank 0 checks every node's list is there and
  every listed object has its size, uploads the manifest ``metadata.json`` (all files), then
  ``<parent>/latest``. A checkpoint is a prefix holding ``metadata.json``: until it is uploaded nothing lists,
  loads or prunes it; a failed or killed upload leaves the previous checkpoint the one ``latest`` names.
  The other ranks check that the manifest in the store carries their node's save id (else CheckpointError).
  A rank's file cannot be missing from the manifest: its node's commit refuses a manifest without it, and
  rank 0 refuses to commit without every node's list.
- Replacing ``<url>`` (``last``): refused unless the prefix holds a trainforge checkpoint (readable
  manifest) of the same kind, our marker ``.trainforge-upload`` of a killed upload, or nothing; rank 0
  deletes the old manifest first (the old copy stops being a checkpoint before any of its files change),
  then the files it listed. While ``last`` is re-uploaded, readers fall back to the newest other checkpoint.
- Reading (``remote_read.py``): list ``<root>/*/metadata.json``; take the one ``latest`` names, else
  the newest by (step, created); download the files its manifest lists into a per-rank cache
  directory and verify them with ``verify_checkpoint`` (sizes and crc32); on failure warn with the
  reason and try the next newest. Rank 0 chooses, the others download the same one.
- Pruning deletes only a prefix directly under the checkpoint root whose manifest reads, the
  manifest first, then exactly the files that manifest lists: a user's object under the prefix, or
  in a checkpoint's folder, is never deleted; the checkpoint ``latest`` names is never deleted.
- Asynchronous saves: ``async_save.AsyncCheckpointer`` opens the remote writer instead of the local one;
  the uploads are part of its background job (the exit hook waits for it).

Local paths never reach fsspec: ``is_remote`` is a string test, and fsspec is imported only for URLs.
Credentials and endpoints come from fsspec's usual sources (for S3 the AWS environment or profile,
``AWS_ENDPOINT_URL`` for another endpoint, or fsspec's configuration).
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from trainforge.strategies.checkpoint.verify import (
    METADATA_FILE,
    parse_metadata,
)
from trainforge.strategies.errors import CheckpointError, ConfigurationError, TrainforgeError

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

    def __init__(self, url: Union[str, RemotePath]) -> None:
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
    def parent(self) -> RemotePath:
        protocol, rest = self.url.split("://", 1)
        return RemotePath(f"{protocol}://{rest.rsplit('/', 1)[0]}") if "/" in rest else self

    def __truediv__(self, rel: str) -> RemotePath:
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


_MANGLED_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/[^/]")


def check_not_mangled(path: Any, what: str) -> None:
    """``pathlib.Path("s3://bucket/run")`` is ``s3:/bucket/run``: refuse it (ConfigurationError) instead of
    writing a local folder named ``s3:``."""
    if not is_remote(path) and path is not None and _MANGLED_RE.match(str(path)):
        raise ConfigurationError(
            f"{what}={str(path)!r} looks like a URL that pathlib.Path collapsed ('//' became '/'); pass the URL as "
            f"a string, e.g. {str(path).replace(':/', '://', 1)!r}"
        )


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


def cache_dir(root: RemotePath, who: str) -> Path:
    """Where checkpoints of ``root`` are downloaded to be loaded, by ``who`` (``node<k>``: the ranks of a node)."""
    return _cache_base() / "cache" / _digest(root.url) / who


ACCESS_HINT = (
    "check that the bucket exists, the credentials (for S3: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) "
    "and the endpoint (AWS_ENDPOINT_URL)"
)
# file:// is a local folder reached through fsspec: buckets and credentials are not its problem
LOCAL_HINT = (
    "file:// is a local path: check that the folder exists (or can be created) and that this process may write it"
)


def access_hint(url: str) -> str:
    """What to check when the store at ``url`` refuses us: a local folder's own advice for ``file://``."""
    protocol = str(url).split("://", 1)[0].lower() if "://" in str(url) else "file"
    return LOCAL_HINT if protocol in ("file", "local") else ACCESS_HINT


@contextlib.contextmanager
def access_errors(url: str, doing: str) -> Iterator[None]:
    """A store that refuses us (no credentials, access denied, a malformed request) is a ConfigurationError
    naming the URL and what to check; a missing object or an I/O failure passes through for the caller."""
    try:
        yield
    except (TrainforgeError, FileNotFoundError):
        raise
    except Exception as e:
        if isinstance(e, OSError) and not isinstance(e, PermissionError):
            raise
        raise ConfigurationError(
            f"{url}: cannot {doing} ({type(e).__name__}: {str(e).strip()[:300]}); {access_hint(url)}"
        ) from None


def read_remote_metadata(path: RemotePath) -> Dict[str, Any]:
    """The checked manifest of the checkpoint at ``path`` (CheckpointError when there is none or it is bad)."""
    fs, inner = path.fs()
    where = f"{path.url}/{METADATA_FILE}"
    try:
        with access_errors(path.url, "read its manifest"):
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
    with access_errors(path.url, "list it"):
        found = fs.find(inner)
    names = sorted(p[len(inner) + 1 :] for p in found if p.startswith(inner + "/"))
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
