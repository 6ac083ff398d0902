"""Reading, listing and pruning checkpoints in object storage (the design is in ``remote.py``), and the
functions callers use for a path that may be local or a URL: a local path takes exactly the local code
(``verify.py``), a URL this module's.

    list_checkpoints_at(root)                 -> [Path | RemotePath], oldest first, complete ones only
    remote_name_taken(url, run_id)            -> whether a save of this run may not use that name
    delete_checkpoint_at(path, root)          -> pruning: only complete trainforge checkpoints inside root
    check_writable_at(folder, where, fix)     -> ConfigurationError before training
    resolve_on_ranks(root, ckpt_path, ...)    -> the local directory to load (rank 0 chooses, verified)
"""

from __future__ import annotations

import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from trainforge.strategies.checkpoint.remote import (
    MARKER,
    RemotePath,
    access_errors,
    access_hint,
    cache_dir,
    is_remote,
    listed_files,
    location,
    read_remote_metadata,
    remove_checkpoint_objects,
)
from trainforge.strategies.checkpoint.remote_write import placement
from trainforge.strategies.checkpoint.verify import (
    LATEST_FILE,
    METADATA_FILE,
    delete_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
)
from trainforge.strategies.checkpoint.write_errors import check_writable
from trainforge.strategies.errors import CheckpointError, ConfigurationError

Location = Union[Path, RemotePath]


# ----------------------------------------------------------------------------- object storage
def read_remote_latest(root: RemotePath) -> Optional[str]:
    fs, inner = root.fs()
    try:
        with access_errors(root.url, "read its latest pointer"):
            name = fs.cat_file(f"{inner}/{LATEST_FILE}").decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name or None


def list_remote(root: RemotePath) -> List[Tuple[RemotePath, Dict[str, Any]]]:
    """Complete checkpoints under ``root`` (a readable manifest) with their manifests, oldest first by
    (step, created). Prefixes without a manifest (uploads in progress or killed, a user's folders) are not
    listed."""
    fs, inner = root.fs()
    try:
        with access_errors(root.url, "list its checkpoints"):
            found = fs.glob(f"{inner}/*/{METADATA_FILE}")
    except FileNotFoundError:
        return []
    out = []
    for item in sorted(found):
        path = root / item[len(inner) + 1 :].split("/", 1)[0]
        try:
            out.append((path, read_remote_metadata(path)))
        except CheckpointError:
            continue

    def key(entry: Tuple[RemotePath, Dict[str, Any]]) -> Tuple[int, str]:
        step = entry[1].get("step")
        return (step if isinstance(step, int) else -1, str(entry[1].get("created", "")))

    return sorted(out, key=key)


def fetch(path: RemotePath, dest_root: Path) -> Path:
    """Download the checkpoint at ``path`` (its manifest and the files it lists) to ``dest_root/<name>``
    and verify it there (sizes, crc32); the verified local directory."""
    meta = read_remote_metadata(path)
    files = listed_files(meta, f"{path.url}/{METADATA_FILE}")
    dest = dest_root / path.name
    if dest_root.exists():  # earlier downloads of this rank: one at a time is kept
        shutil.rmtree(dest_root)
    dest.mkdir(parents=True)
    fs, inner = path.fs()
    try:
        with access_errors(path.url, "download it"):
            if files:
                for folder in {rel.rsplit("/", 1)[0] for rel in files if "/" in rel}:
                    (dest / folder).mkdir(parents=True, exist_ok=True)
                fs.get([f"{inner}/{rel}" for rel in files], [str(dest / rel) for rel in files])
            fs.get_file(f"{inner}/{METADATA_FILE}", str(dest / METADATA_FILE))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path.url}: a file its manifest lists is missing ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path.url}: download failed ({type(e).__name__}: {e})") from None
    try:
        verify_checkpoint(dest)
    except CheckpointError as e:
        raise CheckpointError(f"{path.url} (downloaded to {dest}): {e}") from None
    return dest


def resolve_remote(
    root: RemotePath, ckpt_path: Union[str, RemotePath], dest_root: Path, missing_ok: bool = False
) -> Tuple[Optional[Path], Optional[RemotePath]]:
    """``resolve_checkpoint`` for object storage: (verified local copy, its URL), or (None, None) with nothing
    there and ``missing_ok``. ``"last"``: the one ``latest`` names if it verifies, else the newest that does
    (a warning names what was skipped and why); any other value must verify: no silent substitution."""
    if str(ckpt_path) != "last":
        path = RemotePath(ckpt_path) if is_remote(ckpt_path) else root / str(ckpt_path)
        return fetch(path, dest_root), path
    name = read_remote_latest(root)
    listed = list_remote(root)
    order = [p for p, _ in reversed(listed)]
    skipped: List[Tuple[str, str]] = []
    if name is not None:
        pointed = root / name
        if pointed in order:
            order.remove(pointed)
            order.insert(0, pointed)
        else:
            skipped.append((pointed.url, f"{root / LATEST_FILE} names {name!r}, which has no manifest (not uploaded)"))
    for path in order:
        try:
            local = fetch(path, dest_root)
        except CheckpointError as e:
            skipped.append((path.url, str(e)))
            continue
        if skipped:
            lines = "\n".join(f"  {p}: {why}" for p, why in skipped)
            warnings.warn(f"resuming from {path.url}; skipped checkpoints that do not verify:\n{lines}", stacklevel=3)
        return local, path
    if skipped and order:
        lines = "\n".join(f"  {p}: {why}" for p, why in skipped)
        raise CheckpointError(f"no checkpoint under {root.url} verifies; skipped:\n{lines}")
    if not missing_ok:
        raise CheckpointError(f"ckpt_path='last': no checkpoint under {root.url}; pass missing_ok=True to start fresh")
    return None, None


def resolve_on_ranks(  # noqa: C901 - rank 0 chooses, node leaders fetch, all agree: one protocol in one place
    root: Location,
    ckpt_path: Any,
    *,
    rank: int,
    broadcast: Callable[[Any, int], Any],
    missing_ok: bool = False,
    world_size: int = 1,
    barrier: Optional[Callable[[], Any]] = None,
) -> Optional[Path]:
    """The local directory to load. A local ``root`` and ``ckpt_path``: ``resolve_checkpoint`` as always. With
    a URL, rank 0 chooses (and verifies) the checkpoint into its node's cache directory; on every other node the
    local rank 0 downloads and verifies the same one into that node's, and after ``barrier`` every rank reads its
    node's copy: all ranks load the same step, and each node downloads it once."""
    if not is_remote(ckpt_path):
        if isinstance(root, Path):
            return resolve_checkpoint(root, ckpt_path, missing_ok=missing_ok)
        if str(ckpt_path) != "last" and Path(str(ckpt_path)).is_dir():  # a local checkpoint, named by its path
            return resolve_checkpoint(Path(str(ckpt_path)).parent, ckpt_path, missing_ok=missing_ok)
    remote_root = root if isinstance(root, RemotePath) else RemotePath(str(ckpt_path)).parent
    node, local_rank, _ = placement(rank, world_size)
    cache = cache_dir(remote_root, f"node{node}")  # shared by the ranks of a node
    chosen, error, local = "", "", None
    if rank == 0:
        try:
            local, url = resolve_remote(remote_root, ckpt_path, cache, missing_ok)
            chosen = url.url if url is not None else ""
        except Exception as e:  # said on every rank (raised below), never left for the others to wait on
            error = f"{type(e).__name__}: {e}"
    chosen, error = broadcast((chosen, error), 0)
    if error:
        kind, _, message = error.partition(": ")
        raise (ConfigurationError if kind == "ConfigurationError" else CheckpointError)(
            message if kind in ("ConfigurationError", "CheckpointError") else error
        )
    if not chosen:
        return None
    failed: Optional[Exception] = None
    if rank != 0 and local_rank == 0:
        try:
            local = fetch(RemotePath(chosen), cache)
        except Exception as e:  # the node's other ranks are released below, then find no copy
            failed = e if isinstance(e, (CheckpointError, ConfigurationError)) else CheckpointError(f"{chosen}: {e}")
    if barrier is not None and world_size > 1:
        barrier()
    if failed is not None:
        raise failed
    local = cache / RemotePath(chosen).name
    if not (local / METADATA_FILE).is_file():
        raise CheckpointError(f"{chosen}: the download of this node's local rank 0 failed; see its error")
    return local


def remote_name_taken(path: RemotePath, run_id: Optional[str]) -> bool:
    """Whether saving this run's checkpoint as ``path`` would replace something else: a checkpoint of another
    run or objects that are not a checkpoint. Our killed upload (marker, no manifest) is not: it is replaced."""
    fs, inner = path.fs()
    with access_errors(path.url, "list it"):
        found = [p[len(inner) + 1 :] for p in fs.find(inner) if p.startswith(inner + "/")]
    if not found or (MARKER in found and METADATA_FILE not in found):
        return False
    try:
        return run_id is None or read_remote_metadata(path).get("run_id") != run_id
    except CheckpointError:
        return True


# ----------------------------------------------------------------------------- either kind of path
def list_checkpoints_at(root: Location) -> List[Location]:
    if isinstance(root, RemotePath):
        return [p for p, _ in list_remote(root)]
    return list(list_checkpoints(root))


def delete_checkpoint_at(path: Union[str, Location], root: Location) -> bool:
    """``delete_checkpoint`` for either kind of path. In object storage: only a complete trainforge
    checkpoint directly under ``root`` and not the one ``latest`` names; its manifest goes first, then the
    files it lists (nothing else under the prefix)."""
    if not isinstance(root, RemotePath):
        return delete_checkpoint(Path(str(path)), root=root)
    target = location(path)
    if not isinstance(target, RemotePath) or target.parent != root:
        raise CheckpointError(f"{path}: not inside the checkpoint directory {root}; refusing to delete it")
    try:
        meta = read_remote_metadata(target)
    except CheckpointError as e:
        if "missing object" in str(e) and not target.exists():
            return False  # already gone
        raise CheckpointError(f"{target}: not a trainforge checkpoint ({e}); refusing to delete it") from None
    if read_remote_latest(root) == target.name:
        warnings.warn(f"not deleting {target}: {root / LATEST_FILE} names it (it is the resume point)", stacklevel=2)
        return False
    remove_checkpoint_objects(target, meta)
    return True


def check_writable_at(folder: Union[str, Location], where: str, fix: str) -> None:
    """``check_writable`` for a local folder; for a URL: write and delete a small object under it now, so that
    a missing bucket, missing credentials or a read-only store is an error before training."""
    target = location(folder)
    if not isinstance(target, RemotePath):
        check_writable(target, where, fix)
        return
    probe = f".trainforge-write-test-{uuid.uuid4().hex}"
    try:
        fs, inner = target.fs()
        fs.pipe_file(f"{inner}/{probe}", b"")
        fs.rm_file(f"{inner}/{probe}")
    except ConfigurationError:
        raise
    except Exception as e:
        raise ConfigurationError(
            f"{where}: cannot write to {target.url} ({type(e).__name__}: {str(e).strip()[:300]}); no checkpoint "
            f"could be saved there: {access_hint(target.url)}; or {fix[0].lower()}{fix[1:]} naming a location this process "
            "can write"
        ) from None
