"""Where a checkpoint's tensors are: a safetensors file, a sharded HF index (safetensors or .bin
shards), or a trainforge checkpoint directory. Only headers are read here; tensors are memory-mapped
one shard at a time by the caller.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Tuple, Union

import torch
from safetensors.torch import save_file

from trainforge.strategies.checkpoint.io import refuse_sharded, refused_load
from trainforge.strategies.checkpoint.safetensors_mmap import SAFETENSORS_DTYPES, mmap_safetensors, read_header
from trainforge.strategies.checkpoint.verify import METADATA_FILE, verify_checkpoint
from trainforge.strategies.errors import CheckpointError, ConfigurationError

OFFLOAD_TAG = "trainforge_offload"  # in the header of every file trainforge writes to an offload folder


class Source:
    """``shards``: files in order; ``entries``: {name: (file, dtype, shape)}; ``aliases``: {alias: kept}."""

    def __init__(
        self, shards: List[Path], entries: Dict[str, Tuple[Path, torch.dtype, Tuple[int, ...]]], aliases: Dict[str, str]
    ) -> None:
        self.shards, self.entries, self.aliases = shards, entries, aliases

    @property
    def is_safetensors(self) -> bool:
        return all(p.suffix == ".safetensors" for p in self.shards)

    def tensors(self) -> Iterator[Tuple[Path, Dict[str, torch.Tensor]]]:
        """(shard, {name: tensor}) one shard at a time: safetensors memory-mapped, .bin through
        ``torch.load(weights_only=True, mmap=True)``."""
        for shard in self.shards:
            if shard.suffix == ".safetensors":
                yield shard, mmap_safetensors(shard)
            else:
                yield shard, load_bin(shard)


def load_bin(path: Path) -> Dict[str, torch.Tensor]:
    """A ``.bin`` shard memory-mapped through ``torch.load(weights_only=True)``; a pickled reference to
    code is refused with a CheckpointError saying so (never torch's advice to disable weights_only)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise refused_load(path, e, "a weights file holds only tensors") from None


def _index_source(index: Path) -> Source:
    try:
        idx = json.loads(index.read_text(encoding="utf-8"))
        weight_map: Dict[str, str] = dict(idx["weight_map"])
        aliases = dict((idx.get("metadata") or {}).get("trainforge_aliases", {}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: unparsable index ({e!r})") from None
    files = list(dict.fromkeys(weight_map.values()))
    for f in files:
        if not isinstance(f, str) or Path(f).name != f or f in (".", ".."):
            raise CheckpointError(
                f"{index}: weight_map names the shard {f!r}; an index names files next to it (a bare "
                f"file name): the index is corrupted or not for these shards"
            )
        if not (index.parent / f).is_file():
            present = sorted(p.name for p in index.parent.iterdir() if p.suffix in (".safetensors", ".bin"))
            raise CheckpointError(
                f"{index}: shard {f!r} is missing from {index.parent} (weight files there: {present[:8]}); "
                f"copy the missing shard, or pass the index written with these shards"
            )
    shards = [index.parent / f for f in files]
    entries: Dict[str, Tuple[Path, torch.dtype, Tuple[int, ...]]] = {}
    for s in shards:
        if s.suffix == ".safetensors":
            header, _, _ = read_header(s)
            for k, entry in header.items():
                entries[k] = (s, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]))
        else:  # .bin: the shapes come from a memory-mapped load (no copy)
            for k, t in load_bin(s).items():
                entries[k] = (s, t.dtype, tuple(t.shape))
    wrong = [(k, f) for k, f in weight_map.items() if k not in entries]  # (one in another shard is read there)
    if wrong:
        raise CheckpointError(
            f"{index}: weight_map puts {wrong[0][0]!r} in shard {wrong[0][1]!r}, but no shard holds it ({len(wrong)} "
            f"such entries); the index was not written with these shards: pass the index saved with them"
        )
    return Source(shards, entries, aliases)


def _verify_if_ours(path: Path) -> None:
    """A trainforge checkpoint directory (its metadata.json has a manifest): the weight files are checked
    against it (sizes, crc32) before anything is read, as a resume does: otherwise a flipped bit would load
    without complaint (tests/inference/test_bad_input.py,
    ``test_a_corrupted_trainforge_checkpoint_is_refused_for_inference_too``). Other folders (a Hugging Face
    model directory) have no manifest to check."""
    folder = path if path.is_dir() else path.parent
    try:
        meta = json.loads((folder / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if isinstance(meta, dict) and "files" in meta and "format_version" in meta:
        verify_checkpoint(folder, only=lambda rel: "/" not in rel and rel.startswith("model"))


def open_source(checkpoint: Union[str, os.PathLike]) -> Source:
    path = Path(checkpoint)
    if not path.exists():
        near = next(p for p in path.absolute().parents if p.exists())
        found = sorted(p.name for p in near.iterdir())[:8] if near.is_dir() else []
        raise CheckpointError(
            f"checkpoint={str(checkpoint)!r} does not exist ({near} holds {found}); pass a .safetensors file, "
            f"an *.index.json or a directory holding model.safetensors"
        )
    _verify_if_ours(path)
    if path.is_dir():
        for name in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json"):
            if (path / name).is_file():
                path = path / name
                break
        else:
            refuse_sharded(path)  # an FSDP/Megatron/DeepSpeed checkpoint: say so, and what reads it
            raise CheckpointError(
                f"checkpoint={str(checkpoint)!r}: a directory without model.safetensors, "
                f"model.safetensors.index.json or pytorch_model.bin.index.json (found "
                f"{sorted(p.name for p in path.iterdir())[:8]}); pass the weights file itself"
            )
    if path.name.endswith(".index.json"):
        return _index_source(path)
    if path.suffix == ".safetensors" and path.is_file():
        header, meta, _ = read_header(path)
        try:
            aliases = json.loads(meta.get("trainforge_aliases", "{}"))
        except ValueError:
            raise CheckpointError(f"{path}: unparsable trainforge_aliases in the header") from None
        return Source(
            [path], {k: (path, SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"])) for k, e in header.items()}, aliases
        )
    raise CheckpointError(
        f"checkpoint={str(checkpoint)!r} is not a .safetensors file, an *.index.json or a directory "
        f"holding one; check the path"
    )


def check_writable(folder: Union[str, os.PathLike, None], why: str) -> Path:
    if folder is None:
        raise ConfigurationError(f"offload_folder=None but {why}; pass offload_folder='some/dir' (it is created)")
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".trainforge-write-test"):
            pass
    except OSError as e:
        raise ConfigurationError(
            f"offload_folder={str(folder)!r} is not writable ({e.strerror or e}); pass a directory you can write to"
        ) from None
    return folder


def write_offload(folder: Path, name: str, tensors: Mapping[str, torch.Tensor]) -> Path:
    """``folder/name.safetensors`` holding ``tensors`` (contiguous copies only where needed); refuses to
    overwrite a file trainforge did not write there."""
    path = folder / f"{name}.safetensors"
    if path.exists():
        try:
            ours = OFFLOAD_TAG in read_header(path)[1]
        except CheckpointError:
            ours = False
        if not ours:
            raise ConfigurationError(
                f"offload_folder={str(folder)!r} already holds {path.name}, which trainforge did "
                f"not write; use an empty folder"
            )
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
        str(tmp),
        metadata={"format": "pt", OFFLOAD_TAG: "1"},
    )
    os.replace(tmp, path)
    return path
