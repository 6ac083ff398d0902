"""Zero-copy views of safetensors files.

``mmap_safetensors(path)`` maps the file privately (``MAP_PRIVATE`` through
``torch.UntypedStorage.from_file(shared=False)``) and returns ``{name: tensor}`` whose storages are
slices of that mapping: pages are file-backed (RssFile, not RssAnon) and read on first touch, so a
model far larger than RAM can be "loaded" for free. Only the header is parsed here.

A page of a mapping is read from the file when it is touched, so a file truncated while mapped (a
checkpoint re-saved in place) kills the process with SIGBUS ("Bus error") at the next touch, and one
rewritten in place silently changes the weights. ``MappedFile`` remembers a mapped file's size and
modification time through an open descriptor (the same inode even if the name is replaced) and
``check()`` raises a ``CheckpointError`` instead; inference checks before every forward.
"""

from __future__ import annotations

import json
import os
import struct
import weakref
from pathlib import Path
from typing import Any, Dict, Tuple, Union, cast

import torch

from trainforge.strategies.errors import CheckpointError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 2**20


def read_header(path: Union[str, Path]) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, str], int]:
    """(tensor entries, ``__metadata__``, byte offset where the data starts) of a safetensors file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise ValueError(f"header of {n} bytes")
            size = os.fstat(f.fileno()).st_size
            if 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated: its header is {n} bytes long, the file has {size}; it was cut short "
                    f"while being written or copied: write or copy it again"
                )
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); check the path") from None
    meta = header.pop("__metadata__", None) or {}
    data_end = 0
    for name, entry in header.items():
        if entry.get("dtype") not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, not one of {', '.join(SAFETENSORS_DTYPES)}"
            )
        try:
            data_end = max(data_end, int(entry["data_offsets"][1]))
        except (KeyError, IndexError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has no valid data_offsets; the file is corrupted") from None
    if 8 + n + data_end > size:
        raise CheckpointError(
            f"{path}: truncated: its header describes {8 + n + data_end} bytes, the file has {size}; it was "
            f"cut short while being written or copied: write or copy it again"
        )
    return header, meta, 8 + n


class MappedFile:
    """A file some tensors are memory-mapped views of: ``check()`` raises a ``CheckpointError`` if it
    was truncated or rewritten since (touching the mapping then would crash the process with SIGBUS
    or read other weights)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDONLY)  # fstat(fd) follows this inode even if the name is replaced
        weakref.finalize(self, os.close, fd)
        self.fd = fd
        st = os.fstat(fd)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns

    def check(self) -> None:
        st = os.fstat(self.fd)
        if st.st_size != self.size or st.st_mtime_ns != self.mtime_ns:
            change = f"truncated to {st.st_size} of {self.size} bytes" if st.st_size < self.size else "rewritten"
            raise CheckpointError(
                f"{self.path} was {change} while this model uses it memory-mapped (weights on 'cpu' or "
                f"'disk' are views of the file, read when touched); using them now would crash the process "
                f"(SIGBUS) or compute with other weights. Load the model again; save new checkpoints to a "
                f"new path (or to a temporary name, then os.replace), never over a file in use"
            )


def mmap_safetensors(path: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """Every tensor of ``path`` as a view of one private memory map of the file (no copy)."""
    entries, _, start = read_header(path)
    size = os.path.getsize(path)
    if not entries:
        return {}
    # from_file returns an UntypedStorage (torch's stub says _StorageBase | TypedStorage)
    storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size))
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
    out: Dict[str, torch.Tensor] = {}
    for name, e in entries.items():
        dtype, shape = SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"])
        begin, end = e["data_offsets"]
        raw = whole[start + begin : start + end]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if (start + begin) % itemsize:  # unaligned data (old writers): one copy of this tensor only
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
    return out
