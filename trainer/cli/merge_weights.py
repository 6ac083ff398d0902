"""Consolidate the model weights of a sharded FSDP checkpoint into safetensors.

    trainforge merge-weights CKPT_DIR OUT [--max-shard-size 5GB] [--prefix model]

CKPT_DIR is a trainforge checkpoint written with FSDPStrategy(state_dict_type="sharded") (its
``dcp/`` sub-directory), a checkpoint root (its ``latest`` one is used), or a bare
torch.distributed.checkpoint directory. No process group is needed: the shards are read on this
one process (``torch.distributed.checkpoint.load(..., no_dist=True)``), only the model's tensors,
never the optimizer state. OUT receives ``model.safetensors`` (or shards + an HF index), readable
by ``safetensors.torch.load_file`` and ``transformers``, plus the usual ``metadata.json``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import warnings
from pathlib import Path
from typing import Dict, Union

import torch

from trainforge.strategies.checkpoint.io import (
    METADATA_FILE,
    CheckpointWriter,
    parse_size,
    read_metadata,
    resolve_checkpoint,
    verify_checkpoint,
)
from trainforge.strategies.errors import CheckpointError, ConfigurationError

DCP_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes next to its shards
HELP = "consolidate a sharded FSDP checkpoint into safetensors weights (no processes needed)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT_DIR", help="checkpoint directory (or a root holding 'latest')")
    parser.add_argument("output", metavar="OUT", help="directory to write the weights into (created)")
    parser.add_argument(
        "--max-shard-size", default="5GB", help="split into files of at most this size, e.g. 5GB, 500MB (default: 5GB)"
    )
    parser.add_argument(
        "--prefix",
        default="model",
        help="top-level key of the model state in the checkpoint (default: model; '' for a "
        "checkpoint whose keys are the parameter names themselves)",
    )


def run(args: argparse.Namespace) -> int:
    out = merge_weights(args.checkpoint, args.output, max_shard_size=args.max_shard_size, prefix=args.prefix)
    print(f"wrote {out}")
    return 0


def find_dcp_dir(checkpoint: Union[str, os.PathLike]) -> Path:
    """The torch.distributed.checkpoint directory of ``checkpoint`` (verified when it is ours)."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(
            f"CKPT_DIR={str(checkpoint)!r} is not a directory; give a checkpoint directory "
            "written with FSDPStrategy(state_dict_type='sharded')"
        )
    if (path / DCP_METADATA).is_file():
        return path
    if not (path / METADATA_FILE).is_file() and (path / "latest").is_file():
        path = resolve_checkpoint(path, "last")
    if (path / METADATA_FILE).is_file():
        verify_checkpoint(path)  # sizes and checksums first: never merge a damaged checkpoint
        if (path / "dcp" / DCP_METADATA).is_file():
            return path / "dcp"
        if any(path.glob("model*.safetensors")):
            raise CheckpointError(
                f"{path} already holds consolidated weights (model*.safetensors): there is nothing "
                "to merge; load them with safetensors.torch.load_file"
            )
    raise CheckpointError(
        f"{path}: no sharded checkpoint here (expected {path / 'dcp' / DCP_METADATA} or "
        f"{path / DCP_METADATA}); was it saved with FSDPStrategy(state_dict_type='sharded')?"
    )


def read_model_weights(dcp_dir: Path, prefix: str = "model") -> Dict[str, torch.Tensor]:
    """Full (unsharded) tensors under ``prefix`` in a DCP checkpoint, read without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainforge.strategies.checkpoint.dcp_safe import load_metadata, safe_load  # never torch's bare pickle.load

    meta = load_metadata(dcp_dir / DCP_METADATA)  # restricted unpickling: a crafted file executes nothing
    paths = meta.planner_data or {}
    state: Dict[str, torch.Tensor] = {}
    tops = set()
    for key, info in meta.state_dict_metadata.items():
        path = tuple(paths.get(key, (key,)))
        tops.add(str(path[0]))
        inside = path[1:] if prefix else path
        if (prefix and str(path[0]) != prefix) or not inside or not isinstance(info, TensorStorageMetadata):
            continue
        state[".".join(str(p) for p in inside)] = torch.empty(info.size, dtype=info.properties.dtype)
    if not state:
        raise CheckpointError(
            f"{dcp_dir}: no tensors under prefix {prefix!r}; its top-level keys are "
            f"{sorted(tops)[:10]}; pass --prefix with one of them ('' for none)"
        )
    # no_dist: read on this process only, even inside a job with a process group (older torch
    # without the argument infers it when no process group exists, and warns that it did)
    no_dist = {"no_dist": True} if "no_dist" in inspect.signature(dcp.load).parameters else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        safe_load({prefix: state} if prefix else state, dcp_dir, **no_dist)
    return state


def merge_weights(
    checkpoint: Union[str, os.PathLike],
    output: Union[str, os.PathLike],
    max_shard_size: Union[int, str] = "5GB",
    prefix: str = "model",
) -> Path:
    """Write the consolidated model weights of ``checkpoint`` to ``output``; returns ``output``."""
    limit = parse_size(max_shard_size, "--max-shard-size")
    out = Path(output).absolute()
    _check_output(out)
    dcp_dir = find_dcp_dir(checkpoint)
    weights = read_model_weights(dcp_dir, prefix)
    source = dcp_dir.parent if dcp_dir.name == "dcp" else dcp_dir
    step = read_metadata(source).get("step", 0) if (source / METADATA_FILE).is_file() else 0
    writer = CheckpointWriter(out, kind="weights")
    writer.save_tensors("model", weights, max_shard_size=limit)
    return writer.finalize(
        {
            "step": int(step or 0),
            "strategy": "fsdp",
            "kind": "weights",
            "merged_from": str(Path(checkpoint).absolute()),
        },
        update_latest=False,
    )


def _check_output(out: Path) -> None:
    """OUT may be new, empty, or earlier weights written by trainforge (replaced atomically); never
    anything else, since replacing a directory deletes what was in it."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigurationError(f"OUT={str(out)!r} exists and is not a directory; give a new directory name")
    if not any(out.iterdir()):
        out.rmdir()  # the writer creates it by renaming its temporary directory into place
        return
    kind = None
    if (out / METADATA_FILE).is_file():
        try:
            kind = read_metadata(out).get("kind")
        except CheckpointError:
            kind = None
    if kind != "weights":
        raise ConfigurationError(
            f"OUT={str(out)!r} exists and does not hold weights written by trainforge; it would "
            "be replaced, so give a new (or empty) directory"
        )
