"""Zero-copy views of safetensors files.

``mmap_safetensors(path)`` maps the file privately (``MAP_PRIVATE`` through
``torch.UntypedStorage.from_file(shared=False)``) and returns ``{name: tensor}`` whose storages are
slices of that mapping: pages are file-backed (RssFile, not RssAnon) and read on first touch, so a
model far larger than RAM can be "loaded" for free. Only the header is parsed here.
"""

from __future__ import annotations

import json
import os
import struct
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
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); check the path") from None
    meta = header.pop("__metadata__", None) or {}
    for name, entry in header.items():
        if entry.get("dtype") not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, not one of {', '.join(SAFETENSORS_DTYPES)}"
            )
    return header, meta, 8 + n


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
