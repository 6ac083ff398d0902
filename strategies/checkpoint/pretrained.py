"""Pretrained weights read slice by slice: each rank reads only what it keeps.

Sources: a ``.safetensors`` file, a directory holding ``model.safetensors`` or transformers'
sharded layout (``model.safetensors.index.json`` naming a file per tensor), or a trainforge
checkpoint directory (its ``model.safetensors``). safetensors memory-maps the files and
``get_slice`` reads just the requested rows and columns, so a parameter sharded by FSDP2 or tensor
parallelism (a DTensor) costs each rank the bytes of its own shard: its global shape, mesh and
placements give the slice (torch's ``compute_local_shape_and_global_offset``, the function DTensor
itself uses to lay shards out). A plain tensor is read whole.

Names: the module's parameter and persistent buffer names, with ``prefix`` put in front
(``load_pretrained(model.backbone, path, prefix="model.")``). A name the file does not hold is
reported to the caller (strategies/materialize.py decides whether its module can initialise it); a
tensor of another shape is an error naming both shapes before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from trainforge.strategies.errors import CheckpointError, ConfigurationError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def weight_files(path: Path | str) -> Dict[str, Path]:
    """``{tensor name: file}`` of a pretrained source (see the module docstring); errors name the
    path, what was expected there and the fix."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(
                f"pretrained weights {path}: not a .safetensors file; give a .safetensors file or a directory "
                f"holding {SINGLE_NAME} or {INDEX_NAME} (transformers' save_pretrained layout)"
            )
        return dict.fromkeys(_keys(path), path)
    if not path.is_dir():
        raise CheckpointError(f"pretrained weights {path}: no such file or directory")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index (a 'weight_map' of name -> file): {exc}")
        files = {name: path / str(file) for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"{index} names files that are not there: {missing[:3]}")
        return files
    single = path / SINGLE_NAME
    if single.is_file():
        return dict.fromkeys(_keys(single), single)
    hint = " (a sharded dcp/ checkpoint: `trainforge merge-weights` writes one)" if (path / "dcp").is_dir() else ""
    raise CheckpointError(
        f"pretrained weights {path}: holds neither {SINGLE_NAME} nor {INDEX_NAME}{hint}; give a .safetensors "
        "file or a directory in transformers' save_pretrained layout"
    )


def check_prefix_matches(module: nn.Module, path: Path | str, prefix: str) -> None:
    """A ConfigurationError when none of ``module``'s tensors is in ``path`` under ``prefix`` (a wrong prefix
    would load nothing), naming the prefix and how the file's names begin."""
    files = weight_files(path)
    names = [n for n, _ in named_targets(module)]
    if not names or any(prefix + n in files for n in _all_names(module)):
        return
    sample = sorted(files)[:3]
    raise ConfigurationError(
        f"load_pretrained: {len(names)} tensor(s) of the model are not in {path} under prefix {prefix!r}: none of "
        f"{type(module).__name__}'s tensors is there (its names begin {names[:2]}, the file's {sample}); check the "
        "prefix (the file's names are the model's names with it in front)"
    )


def warn_unused(module: nn.Module, path: Path | str, prefix: str) -> None:
    """Warn (as transformers does) naming the tensors of ``path`` under ``prefix`` that ``module`` has no
    tensor for: they were not loaded anywhere."""
    wanted = {prefix + n for n in _all_names(module)}
    unused = sorted(k for k in weight_files(path) if k.startswith(prefix) and k not in wanted)
    if unused:
        more = f" and {len(unused) - 10} more" if len(unused) > 10 else ""
        warnings.warn(
            f"load_pretrained: {len(unused)} tensor(s) of {path} under prefix {prefix!r} were not used: "
            f"{type(module).__name__} has no tensor of that name: {unused[:10]}{more}. Expected when the file holds "
            "parts the model does not have (another head); otherwise check the model's configuration and the prefix",
            UserWarning,
            stacklevel=3,
        )


def _all_names(module: nn.Module) -> Set[str]:
    # every name a file may hold for the module, tied names included (state_dict lists each of them)
    return set(module.state_dict(keep_vars=True))


def _keys(file: Path) -> Iterable[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def named_targets(module: nn.Module, names: Optional[Set[str]] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Parameters (each tied tensor once) and persistent buffers of ``module``."""
    yield from ((n, p) for n, p in module.named_parameters() if names is None or n in names)
    for mod_name, mod in module.named_modules():
        for leaf, buf in mod._buffers.items():
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            if buf is not None and leaf not in mod._non_persistent_buffers_set and (names is None or name in names):
                yield name, buf


@torch.no_grad()
def load_slices(
    module: nn.Module,
    path: Path | str,
    prefix: str = "",
    names: Optional[Set[str]] = None,
    aliases: Optional[Dict[str, List[str]]] = None,
) -> Set[str]:
    """Copy the pretrained values into ``module``'s tensors (only those in ``names`` when given),
    each rank reading its own slice; returns the names loaded. Shapes are all checked first.
    ``aliases``: names tied to a name (a file holds one name of a tied group: transformers drops
    ``lm_head.weight`` when it is the embedding), read under another of them when absent."""
    from safetensors import safe_open

    files = weight_files(path)
    targets = []  # (name, tensor, the file's key for it)
    for name, tensor in named_targets(module, names):
        found = [k for k in (prefix + n for n in (name, *(aliases or {}).get(name, []))) if k in files]
        if found:
            targets.append((name, tensor, found[0]))
    with contextlib.ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for f in {files[key] for _, _, key in targets}
        }
        for name, tensor, key in targets:
            stored = tuple(handles[files[key]].get_slice(key).get_shape())
            if stored != tuple(tensor.shape):
                raise CheckpointError(
                    f"pretrained weights {path}: {key} has shape {list(stored)} in the file, the model's "
                    f"{name} has {list(tensor.shape)}; build the model with the configuration the weights were "
                    "saved with"
                )
        for name, tensor, key in targets:
            tensor_slice = handles[files[key]].get_slice(key)
            local, index = _local_part(tensor)
            if local.numel():
                local.copy_(tensor_slice[index] if index else tensor_slice[:])
    return {n for n, _, _ in targets}


def _local_part(tensor: torch.Tensor) -> Tuple[torch.Tensor, Optional[tuple]]:
    """(this rank's part of ``tensor``, the global index of that part or None for all of it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise CheckpointError(
            f"a {type(tensor).__name__} of shape {list(tensor.shape)} holds a local part of {list(local.shape)} where "
            f"its placements {tensor.placements} give {list(shape)}: cannot tell which slice to read"
        )
    return local, tuple(slice(o, o + s) for o, s in zip(offset, shape)) or None
