"""Checkpoints in object storage: what the staging and the ordered upload cost, measured side by side in one run
and printed, never asserted.

    python benchmarks/checkpoint_remote.py --size-mb 200 --repeats 3

The store is moto's S3 server on 127.0.0.1 (``moto[server]``, in this process): the network is loopback, so the
figures are the overhead of trainforge's path over the bytes, not a cloud's bandwidth. Side by side, interleaved,
medians:
  local save          CheckpointWriter into a local directory (checksums, fsync, rename)
  s3fs put            the same files uploaded with one ``fs.put`` (the floor of any upload)
  remote save         RemoteCheckpointWriter: the local save into staging, then the upload in commit order
  local verify+load   verify_checkpoint + load_tensors/load_object
  remote load         resolve_remote (list, download, verify) + the same loads
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# beside this script
from checkpoint import make_state

from tests.helpers.s3server import S3Server
from trainforge.strategies.checkpoint.io import CheckpointWriter, load_object, load_tensors, verify_checkpoint
from trainforge.strategies.checkpoint.remote import RemotePath
from trainforge.strategies.checkpoint.remote_read import resolve_remote
from trainforge.strategies.checkpoint.remote_write import RemoteCheckpointWriter


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:  # noqa: PLR0915 - one benchmark run, read top to bottom
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=200)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    server = S3Server()
    os.environ.update(server.env)
    bucket = server.bucket()
    fs = server.fs()
    work = Path(tempfile.mkdtemp(prefix="ckpt-remote-bench-"))
    model, optim = make_state(args.size_mb)
    total = sum(t.numel() * t.element_size() for t in model.values()) * 3

    def write(writer) -> None:
        writer.save_tensors("model", model)
        writer.save_object("optimizer", optim)
        writer.finalize({"step": 1})

    def local_save() -> None:
        write(CheckpointWriter(work / "local" / "step-1"))

    def s3fs_put() -> None:
        files = sorted(q for q in (work / "local" / "step-1").rglob("*") if q.is_file())
        prefix = f"{bucket}/put-{uuid.uuid4().hex[:8]}"
        fs.put([str(q) for q in files], [f"{prefix}/{q.name}" for q in files])

    def remote_save() -> None:
        write(RemoteCheckpointWriter(f"s3://{bucket}/run/step-1"))

    def local_load() -> None:
        verify_checkpoint(work / "local" / "step-1")
        load_tensors(work / "local" / "step-1", "model")
        load_object(work / "local" / "step-1", "optimizer")

    def remote_load() -> None:
        local, _ = resolve_remote(RemotePath(f"s3://{bucket}/run"), "last", work / "cache")
        assert local is not None
        load_tensors(local, "model")
        load_object(local, "optimizer")

    parts: Dict[str, Callable[[], None]] = {
        "local save": local_save,
        "s3fs put": s3fs_put,
        "remote save": remote_save,
        "local verify+load": local_load,
        "remote load": remote_load,
    }
    times: Dict[str, List[float]] = {name: [] for name in parts}
    print(f"== {len(model)} weight tensors + Adam moments = {total / 2**20:.0f} MiB, {args.repeats} repeats ==")
    try:
        for r in range(args.repeats):
            shutil.rmtree(work / "local", ignore_errors=True)
            for name in (
                ("local save", "remote save", "s3fs put") if r % 2 == 0 else ("remote save", "local save", "s3fs put")
            ):
                if name == "local save":
                    shutil.rmtree(work / "local", ignore_errors=True)
                times[name].append(_time(parts[name]))
            for name in ("local verify+load", "remote load") if r % 2 == 0 else ("remote load", "local verify+load"):
                times[name].append(_time(parts[name]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.stop()
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, value in med.items():
        runs = ", ".join(f"{t:.3f}" for t in times[name])
        print(f"  {name:18s} median {value:7.3f} s  {total / 2**30 / value:6.2f} GiB/s   runs: {runs}")
    print(f"  ratio remote save / local save       = {med['remote save'] / med['local save']:.2f}")
    print(
        f"  ratio remote save / (local save + put) = {med['remote save'] / (med['local save'] + med['s3fs put']):.2f}"
    )
    print(f"  ratio remote load / local verify+load = {med['remote load'] / med['local verify+load']:.2f}")


if __name__ == "__main__":
    main()
