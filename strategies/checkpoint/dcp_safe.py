"""Reading torch.distributed.checkpoint (DCP) directories without executing anything in them.

torch's ``FileSystemReader.read_metadata`` reads ``.metadata`` with a bare ``pickle.load`` and its
``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry with ``torch.load(weights_only=False)``:
a crafted file runs code on load, even inside a checkpoint whose manifest verifies (crc32s can be
recomputed). Every trainforge path that reads DCP (FSDP resume, ``Accelerator.load_state`` through
the strategy, ``trainforge merge-weights``) goes through ``safe_reader``/``safe_planner`` here:

- ``.metadata`` is unpickled with an allowlist: DCP's own metadata classes, ``torch.Size``, dtypes,
  layouts and memory formats, paths; any other global is refused before it is imported.
- non-tensor entries load with ``torch.load(weights_only=True)``.

Refusals raise CheckpointError saying nothing in the file was executed.
"""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from trainforge.strategies.errors import CheckpointError

DCP_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes next to its shards
_ALLOWED = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # "torch.strided" -> layout
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("pathlib", "Path"): pathlib.Path,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}
DCP_ERRORS = (Exception, CheckpointException)
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def _refused(path: Any, what: str) -> CheckpointError:
    return CheckpointError(
        f"refused to load {path}: it contains a pickled object that would import {what} when "
        f"loaded; checkpoints written by torch.distributed.checkpoint never do; do not load files "
        f"from untrusted sources. Nothing in it was executed"
    )


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Any) -> None:
        super().__init__(file)
        self._where = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == dcp_metadata.__name__ and "." not in name:
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:  # the dataclasses/enums defined there
                return obj
        if module == "torch" and "." not in name:
            obj = getattr(torch, name, None)
            if isinstance(obj, _TORCH_VALUES):  # torch.float32, torch.strided, torch.contiguous_format
                return obj
        raise _refused(self._where, f"{module}.{name}")


def load_metadata(path: Any) -> dcp_metadata.Metadata:
    """The ``Metadata`` in the DCP ``.metadata`` file at ``path``, unpickled with the allowlist."""
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated, not a pickle
        raise CheckpointError(
            f"{path}: unreadable torch.distributed.checkpoint metadata ({type(e).__name__}: "
            f"{str(e)[:200]}); the file is truncated or corrupted"
        ) from None
    if not isinstance(meta, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: holds a {type(meta).__name__}, not torch.distributed.checkpoint Metadata")
    return meta


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the restricted unpickler."""

    refusal = None  # the refusal of a hostile metadata file, which torch's loader may swallow

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            meta = load_metadata(path)
        except CheckpointError as e:  # torch swallows it and tries the other metadata file: keep it to re-raise
            if "Nothing in it was executed" in str(e):
                self.refusal = e
            raise
        storage_meta = getattr(meta, "storage_meta", None)
        if storage_meta is None:
            storage_meta = meta.storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise _refused(
                f"entry {read_item.dest_index.fqn!r}",
                str(e).split("GLOBAL ")[-1].split()[0]
                if "GLOBAL " in str(e)
                else f"something weights_only refuses ({type(e).__name__})",
            )
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: Any, folder: Any, **kwargs: Any) -> None:
    """``dcp.load(state, ...)`` from ``folder`` through the safe reader and planner. Our refusals
    surface as CheckpointError even when DCP wrapped them in its ``CheckpointException`` (a
    BaseException, which ``except Exception`` misses: callers catch ``DCP_ERRORS``)."""
    reader = SafeFileSystemReader(str(folder))
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), **kwargs)
    except CheckpointError:
        raise
    except DCP_ERRORS as e:  # CheckpointException wraps each rank's error
        inner = reader.refusal or _ours_inside(e)
        if inner is not None:
            raise inner from None
        raise


def _ours_inside(e: BaseException) -> Any:
    """Our CheckpointError when DCP wrapped it in a CheckpointException (per-rank failures)."""
    failures = getattr(e, "failures", None) or {}
    for failure in failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        while exc is not None:
            if isinstance(exc, CheckpointError):
                return exc
            exc = getattr(exc, "__cause__", None) or getattr(exc, "__context__", None)
    return None


def flat_optimizer_state(folder: Any) -> bool:
    """Whether a DCP checkpoint's optimizer state is flat (``flatten_optimizer_state_dict``: settings
    keyed per parameter name, as MegatronStrategy writes) rather than nested (``param_groups.<i>.params``
    lists, as FSDPStrategy writes). Read through the restricted unpickler."""
    import re

    nested = re.compile(r"^optimizers\.\d+\.param_groups\.\d+\.params$")
    keys = list(SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    return any(k.startswith("optimizers.") for k in keys) and not any(nested.match(k) for k in keys)
