"""Writing a checkpoint to object storage (the design is in ``remote.py``): ``RemoteCheckpointWriter`` and
``open_writer``, which gives today's ``CheckpointWriter`` for a local path.

One save, every rank (``n`` nodes of ``l`` processes each, from the launcher's environment; one node when it
says nothing):

1. every rank checks the prefix may be written (``claim``); barrier; rank 0 marks it ours and deletes the
   checkpoint it replaces, manifest first (before the writer's first barrier, so no node uploads into a live
   checkpoint);
2. each node writes through an unchanged ``CheckpointWriter`` (its ranks as one world) into its staging dir
   ``<staging>/node<k>/<name>`` and commits there: that node's manifest holds every file its ranks wrote,
   tracked or not (DCP shards), or the commit fails;
3. each node's local rank 0 uploads the files of its node manifest, then ``<url>/.node-<k>.json`` (that
   manifest); barrier;
4. global rank 0 reads the ``n`` node lists (a missing one: that node failed, nothing is committed), checks each
   listed object is in the store with its size, writes ``metadata.json`` (all files, ``world_size``, every node's
   save id), then ``latest``, and removes the node lists and the marker; barrier;
5. every other rank checks that the manifest in the store carries its node's save id, else CheckpointError.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple, Union, cast

from trainforge.strategies.checkpoint.io import CheckpointWriter
from trainforge.strategies.checkpoint.remote import (
    MARKER,
    RemotePath,
    claim,
    is_remote,
    listed_files,
    read_remote_metadata,
    remove_checkpoint_objects,
    staging_root,
)
from trainforge.strategies.checkpoint.verify import LATEST_FILE, METADATA_FILE, PathLike, check_name, metadata_checksum
from trainforge.strategies.environment import detect_environment
from trainforge.strategies.errors import CheckpointError, ConfigurationError

NODE_LIST = ".node-{:05d}.json"  # a node's file list, under the checkpoint's prefix until the commit


def placement(rank: int, world_size: int) -> Tuple[int, int, int]:
    """(node index, rank on the node, processes per node) from the launcher's environment; one node when it
    does not describe this world (a single process, or ranks given by hand)."""
    if world_size == 1:
        return 0, 0, 1
    try:
        env = detect_environment()
    except ConfigurationError:
        return 0, rank, world_size
    per_node = env.local_world_size
    if env.world_size != world_size or env.rank != rank or per_node >= world_size:
        return 0, rank, world_size
    if world_size % per_node or env.local_rank != rank % per_node:
        raise ConfigurationError(
            f"checkpoints in object storage: {world_size} processes with {per_node} per node ({env.kind}) and "
            f"rank {rank} as local rank {env.local_rank}; staging needs the same number of processes on every node, "
            "numbered node by node (as torchrun does)"
        )
    return rank // per_node, rank % per_node, per_node


def _is_local_fs(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def prepare_prefix(dest: RemotePath, replaced: Optional[Mapping[str, Any]], token: str) -> None:
    """Rank 0, before any node uploads: mark the prefix ours and delete what the save replaces (the old
    checkpoint's manifest first, so it stops being one before any of its files change)."""
    fs, inner = dest.fs()
    if replaced is None:  # claim() found nothing there, or a killed upload of ours
        remove_checkpoint_objects(dest, None)
    if _is_local_fs(fs):
        fs.makedirs(inner, exist_ok=True)
    fs.pipe_file(f"{inner}/{MARKER}", token.encode("utf-8"))
    if replaced is not None:
        remove_checkpoint_objects(dest, replaced)


def upload_node(local: Path, dest: RemotePath, node: int) -> None:
    """A node's local rank 0: the files of its committed staging copy, then its file list."""
    meta = json.loads((local / METADATA_FILE).read_text(encoding="utf-8"))
    fs, inner = dest.fs()
    files = listed_files(meta, str(local / METADATA_FILE))
    if _is_local_fs(fs):
        for folder in sorted({f"{inner}/{rel}".rsplit("/", 1)[0] for rel in files}):
            fs.makedirs(folder, exist_ok=True)
    if files:
        fs.put([str(local / rel) for rel in files], [f"{inner}/{rel}" for rel in files])
    body = {"save_id": meta["save_id"], "files": meta["files"]}
    body["meta"] = {k: v for k, v in meta.items() if k not in ("files", "checksum")}
    fs.pipe_file(f"{inner}/{NODE_LIST.format(node)}", json.dumps(body).encode("utf-8"))


def commit(dest: RemotePath, nodes: int, world_size: int, update_latest: bool) -> None:
    """Global rank 0, after every node uploaded: the manifest of all nodes' files, then ``latest``."""
    fs, inner = dest.fs()
    lists: List[Dict[str, Any]] = []
    for k in range(nodes):
        try:
            lists.append(json.loads(fs.cat_file(f"{inner}/{NODE_LIST.format(k)}")))
        except FileNotFoundError:
            raise CheckpointError(f"{dest}: node {k} uploaded no file list; see that node's error") from None
    files: Dict[str, Any] = {}
    owner: Dict[str, int] = {}
    for k, node_list in enumerate(lists):
        for rel, entry in node_list["files"].items():
            if rel in files and files[rel] != entry:
                raise CheckpointError(
                    f"{dest}/{rel}: written on node {owner[rel]} and on node {k}; give each rank its own file name, "
                    "e.g. f'rng/rank-{rank:05d}'"
                )
            files[rel], owner[rel] = entry, k
    stored = {path[len(inner) + 1 :]: info.get("size") for path, info in fs.find(inner, detail=True).items()}
    for rel, entry in files.items():
        if stored.get(rel) != entry["size"]:
            raise CheckpointError(
                f"{dest}/{rel}: {'missing' if rel not in stored else 'of another size'} in the store after node "
                f"{owner[rel]} uploaded it ({stored.get(rel)} bytes, {entry['size']} written); not committed"
            )
    meta = dict(lists[0]["meta"])
    meta.update(world_size=world_size, node_save_ids=[node_list["save_id"] for node_list in lists])
    meta["files"] = dict(sorted(files.items()))
    meta["checksum"] = metadata_checksum(meta)
    fs.pipe_file(f"{inner}/{METADATA_FILE}", json.dumps(meta, indent=2, sort_keys=True).encode("utf-8"))
    if update_latest:  # from here on it is a checkpoint; latest names it only after that
        fs.pipe_file(f"{inner.rsplit('/', 1)[0]}/{LATEST_FILE}", (dest.name + "\n").encode("utf-8"))
    fs.rm([f"{inner}/{NODE_LIST.format(k)}" for k in range(nodes)] + [f"{inner}/{MARKER}"])


class RemoteCheckpointWriter:
    """``io.CheckpointWriter``'s interface for a URL (this module's docstring); every rank, the same URL."""

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
        if world_size > 1 and barrier is None:
            raise ConfigurationError(f"world_size={world_size} needs barrier=<the strategy's barrier callable>")
        self.rank, self.world_size, self._barrier_fn = rank, world_size, barrier
        self.node, self.local_rank, per_node = placement(rank, world_size)
        self.nodes = world_size // per_node
        replaced = claim(self.final_dir, kind)  # every rank: the same objects, the same answer
        self._barrier()  # ... so every rank looks before rank 0 changes them
        self._failed: Optional[BaseException] = None  # rank 0's, raised in finalize: the barriers stay in step
        if rank == 0:
            try:
                prepare_prefix(self.final_dir, replaced, f"{world_size} processes")
            except Exception as e:
                self._failed = e
        local_final = staging_root(self.root) / f"node{self.node}" / self.final_dir.name
        try:  # its first barrier also orders every node's uploads after prepare_prefix
            self._local = CheckpointWriter(
                local_final, rank=self.local_rank, world_size=per_node, barrier=barrier, kind=None
            )
        except CheckpointError as e:
            raise CheckpointError(
                f"{self.final_dir.url}: checkpoints in object storage are staged in {local_final.parent} on local "
                f"disk, which every rank of a node must see ({e})"
            ) from None
        self.tmp_dir, self.save_id = self._local.tmp_dir, self._local.save_id

    def _barrier(self) -> None:
        if self._barrier_fn is not None:
            self._barrier_fn()

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
        return self._local.save_object(name, obj)

    def finalize(self, metadata: Optional[Mapping[str, Any]] = None, *, update_latest: bool = True) -> RemotePath:
        """Every rank: commit on the node, upload the node's files, rank 0 commits in the store, all check."""
        local = self._local.finalize(metadata, update_latest=False)
        error = self._failed
        if self.local_rank == 0 and error is None:
            try:
                upload_node(local, self.final_dir, self.node)
            except Exception as e:  # released at the barrier below; rank 0 then finds no list from this node
                error = e
        self._barrier()
        if self.rank == 0 and error is None:
            try:
                commit(self.final_dir, self.nodes, self.world_size, update_latest)
            except Exception as e:
                error = e
        self._barrier()
        if self.local_rank == 0:
            shutil.rmtree(local, ignore_errors=True)
        if error is not None:
            raise CheckpointError(
                f"upload of {self.final_dir.url} failed ({type(error).__name__}: {str(error).strip()[:500]}); it is "
                f"not a checkpoint (no manifest was uploaded) and {self.root / LATEST_FILE} still names the "
                "previous one. Check the store (bucket, credentials, endpoint, quota) and save again"
            ) from error
        if self.rank != 0:
            try:
                meta = read_remote_metadata(self.final_dir)
                ids = meta.get("node_save_ids") or [meta.get("save_id")]
            except CheckpointError:
                ids = []
            if self.save_id not in ids:
                raise CheckpointError(f"{self.final_dir.url}: rank 0 did not commit this checkpoint; see its error")
        return self.final_dir


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
