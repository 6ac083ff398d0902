"""Reading a checkpoint directory: weights with safetensors (never pickle), everything else with
``torch.load(weights_only=True)``, each file checked against the manifest first. Re-exported by
``strategies/checkpoint/io.py``, the module the rest of trainforge imports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Tuple, Union

import torch
from safetensors import safe_open

from trainforge.strategies.checkpoint.verify import PART_RE, PathLike, check_rel, read_metadata
from trainforge.strategies.errors import CheckpointError

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")  # the global a weights_only unpickler refused


def _read_safetensors(path: Path, device: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            # safetensors' safe_open handle has keys() but is not iterable
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
    except Exception as e:  # SafetensorError (bad header), OSError, ValueError: all mean "unreadable"
        raise CheckpointError(
            f"{path}: cannot be read as safetensors ({e}); the file is truncated or corrupted"
        ) from None


# Which strategies read a sharded checkpoint a whole-model reader (single device, DDP, inference) cannot.
_SHARDED_READERS = {
    "fsdp": "FSDPStrategy or MegatronStrategy (any layout), or make one model.safetensors with "
    "`trainforge merge-weights CKPT OUT`",
    "megatron": "MegatronStrategy or FSDPStrategy (any layout), or make one model.safetensors with "
    "`trainforge merge-weights CKPT OUT`",
    "deepspeed": "DeepSpeedStrategy (any ZeRO stage)",
}


def refuse_sharded(ckpt_dir: Path) -> None:
    """A sharded checkpoint given to a reader of whole-model files (single device, DDP, inference): say
    what it is and who reads it, instead of 'model.safetensors missing', which hid the cause
    (tests/strategies/test_checkpoint_io.py,
    ``test_a_sharded_checkpoint_given_to_a_whole_model_reader_says_what_it_is``)."""
    try:
        strategy = read_metadata(ckpt_dir).get("strategy")
    except CheckpointError:
        return  # not a complete trainforge checkpoint: the missing-file error says enough
    if strategy in _SHARDED_READERS:
        raise CheckpointError(
            f"{ckpt_dir} is a sharded checkpoint written by strategy={strategy!r} (no "
            f"model.safetensors); load it with {_SHARDED_READERS[strategy]}"
        )


def load_tensors(
    ckpt_dir: PathLike, name: str = "model", device: Union[str, torch.device] = "cpu"
) -> Dict[str, torch.Tensor]:
    """Tensors saved by ``save_tensors(name, ...)`` (single file or sharded), aliases restored.
    Does not re-check checksums: ``verify_checkpoint``/``resolve_checkpoint`` do that."""
    ckpt_dir, base = Path(ckpt_dir), check_rel(name)
    single, index = ckpt_dir / f"{base}.safetensors", ckpt_dir / f"{base}.safetensors.index.json"
    device = str(device)
    if index.is_file():
        try:
            idx = json.loads(index.read_text(encoding="utf-8"))
            weight_map: Dict[str, str] = dict(idx["weight_map"])
            aliases = dict(idx.get("metadata", {}).get("trainforge_aliases", {}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: unparsable safetensors index ({e!r}); the file is corrupted") from None
        out: Dict[str, torch.Tensor] = {}
        for file in dict.fromkeys(weight_map.values()):
            if not isinstance(file, str) or not PART_RE.match(file):
                raise CheckpointError(f"{index}: invalid shard file name {file!r} in weight_map")
            out.update(_read_safetensors(ckpt_dir / file, device)[0])
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise CheckpointError(f"{index}: tensors {missing[:5]} listed in weight_map are missing from their shards")
    elif single.is_file():
        out, header = _read_safetensors(single, device)
        try:
            aliases = json.loads(header.get("trainforge_aliases", "{}"))
        except ValueError:
            raise CheckpointError(f"{single}: unparsable trainforge_aliases in the safetensors header") from None
    else:
        refuse_sharded(ckpt_dir)
        present = sorted(p.name for p in ckpt_dir.glob("*.safetensors*")) if ckpt_dir.is_dir() else []
        raise CheckpointError(
            f"{single}: missing file (and no {index.name}); safetensors files in {ckpt_dir}: {present}"
        )
    for alias, kept in aliases.items():
        if kept not in out:
            raise CheckpointError(
                f"{single if not index.is_file() else index}: alias {alias!r} -> {kept!r}, "
                f"which is not in the file; the checkpoint is corrupted"
            )
        out[alias] = out[kept]
    return out


def load_object(ckpt_dir: PathLike, name: str, map_location: Any = "cpu") -> Any:
    """``torch.load(<name>.pt, weights_only=True)``; any pickled code reference is refused."""
    path = Path(ckpt_dir) / f"{check_rel(name)}.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing file")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise refused_load(path, e, "checkpoints written by trainforge never do") from None


def refused_load(path: Any, error: Exception, expected: str) -> CheckpointError:
    """The error for a failed ``torch.load(path, weights_only=True)``: a pickled reference to code is
    named and said to be refused (nothing was executed); anything else is a truncated or corrupted file.
    Never torch's own advice to retry with weights_only disabled, which would run that code.
    ``expected``: why the file should not hold code, e.g. "checkpoints written by trainforge never do"."""
    text = str(error)
    found = _GLOBAL_RE.search(text)
    if found is not None:
        return CheckpointError(
            f"refused to load {path}: it contains a pickled object that would import {found.group(1)} when "
            f"loaded; {expected}; do not load files from untrusted sources. Nothing in it was executed"
        )
    # torch's first paragraph is its advice; the reason is in the paragraphs after it
    reasons = [p.strip() for p in text.split("\n\n") if p.strip()]
    if text.startswith("Weights only load failed"):
        kept = [p for p in reasons[1:] if not p.startswith("Check the documentation")]
        return CheckpointError(
            f"refused to load {path}: it holds something a weights-only load does not accept "
            f"({(kept or ['no reason given'])[0].splitlines()[0][:300]}); {expected}; do not load files from "
            f"untrusted sources. Nothing in it was executed"
        )
    first = (reasons or [""])[0].splitlines()[0][:300]
    return CheckpointError(
        f"{path}: cannot be read ({type(error).__name__}: {first}); the file is truncated or corrupted"
    )


def to_plain(obj: Any) -> Any:
    """A copy of ``obj`` with numpy arrays as ``{"__ndarray__": ..}`` dicts and numpy scalars as
    Python numbers, so it survives ``torch.load(weights_only=True)``. Dicts, lists, tuples recurse."""
    kind = type(obj)
    if kind.__module__.split(".")[0] == "numpy":
        if kind.__name__ == "ndarray":
            return {"__ndarray__": obj.ravel().tolist(), "dtype": str(obj.dtype), "shape": list(obj.shape)}
        if hasattr(obj, "item"):
            return obj.item()
    if isinstance(obj, dict):
        return {to_plain(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return kind(to_plain(v) for v in obj) if kind in (list, tuple) else [to_plain(v) for v in obj]
    return obj


def from_plain(obj: Any) -> Any:
    """Inverse of ``to_plain``: the ``{"__ndarray__": ..}`` dicts become numpy arrays again."""
    if isinstance(obj, dict):
        if set(obj) == {"__ndarray__", "dtype", "shape"}:
            import numpy  # only needed when numpy state was saved, so only imported then

            return numpy.asarray(obj["__ndarray__"], dtype=obj["dtype"]).reshape(obj["shape"])
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_plain(v) for v in obj)
    return obj
