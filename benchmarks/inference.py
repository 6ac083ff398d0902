"""Big-model inference benchmark: trainforge next to Accelerate (when installed), same model, same
map, same run; figures printed, never asserted.

    python benchmarks/inference.py                 # 192 MiB fp32 model, 48 Linear layers, cpu cap 64 MiB
    python benchmarks/inference.py --tiny          # seconds: smoke mode
    python benchmarks/inference.py --device cuda   # execution on GPU 0 (cpu_offload rows)

Each row runs in its own child process (clean figures): load time, peak anonymous memory
(RssAnon, sampled every 0.5 ms; memory-mapped file pages are not anonymous) above the child's
baseline during the load, RssAnon after the forwards, median forward time and rows/s. Paths:
  dispatch_cap  load_checkpoint_and_dispatch, device_map="auto", max_memory={"cpu": cap}
  disk_offload  trainforge: from the safetensors checkpoint, on meta; Accelerate: from the loaded model
  cpu_offload   the model loaded in memory, weights visiting the execution device per block
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
PATHS = ("dispatch_cap", "disk_offload", "cpu_offload")


def build(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Peak(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = anon(), False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, anon())
            time.sleep(0.0005)


def child(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    ckpt, off, dev = Path(a.dir) / "model.safetensors", Path(a.dir) / f"off-{a.lib}-{a.path}", a.device
    exec_dev = 0 if dev == "cuda" else "cpu"
    if a.lib == "trainforge":
        from trainforge.trainer.inference import (
            cpu_offload,
            disk_offload,
            init_empty_weights,
            load_checkpoint_and_dispatch,
        )
    else:
        from accelerate import (
            cpu_offload,
            disk_offload,
            infer_auto_device_map,
            init_empty_weights,
            load_checkpoint_and_dispatch,
        )
    from safetensors.torch import load_file

    x = torch.randn(a.batch, a.width, device=dev)
    nn.Linear(4, 4)(torch.randn(1, 4))
    base = anon()
    sampler = Peak()
    sampler.start()
    t0 = time.perf_counter()
    if a.path == "dispatch_cap" or (a.path == "disk_offload" and a.lib == "trainforge"):
        with init_empty_weights():
            model = build(a.width, a.layers)
        if a.path == "disk_offload":
            model = disk_offload(model, Path(a.dir), execution_device=exec_dev)
        elif a.lib == "trainforge":
            model = load_checkpoint_and_dispatch(
                model, ckpt, device_map="auto", offload_folder=off, max_memory={"cpu": a.cap_mb * 2**20}
            )
        else:
            dm = infer_auto_device_map(model, max_memory={"cpu": a.cap_mb * 2**20})
            model = load_checkpoint_and_dispatch(model, str(ckpt), device_map=dm, offload_folder=str(off))
    else:
        model = build(a.width, a.layers)
        model.load_state_dict(load_file(str(ckpt)))
        if a.path == "cpu_offload":
            model = cpu_offload(
                model,
                execution_device=exec_dev
                if a.lib == "trainforge"
                else torch.device("cuda" if dev == "cuda" else "cpu", 0 if dev == "cuda" else None),
            )
        else:
            model = disk_offload(model, str(off), execution_device=torch.device(dev))
    load_s = time.perf_counter() - t0
    sampler.stop = True
    sampler.join()
    times = []
    with torch.no_grad():
        for _ in range(a.forwards):
            t = time.perf_counter()
            model(x)
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    written = sum(p.stat().st_size for p in off.rglob("*") if p.is_file()) if off.exists() else 0
    fwd = statistics.median(times[1:] or times)
    print(
        json.dumps(
            {
                "load_s": load_s,
                "peak_load": sampler.peak - base,
                "after": anon() - base,
                "fwd_s": fwd,
                "rows_s": a.batch / fwd,
                "written": written,
            }
        )
    )


def run_row(a: argparse.Namespace, lib: str, path: str, work: str):
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--lib",
        lib,
        "--path",
        path,
        "--dir",
        work,
        "--width",
        str(a.width),
        "--layers",
        str(a.layers),
        "--cap-mb",
        str(a.cap_mb),
        "--forwards",
        str(a.forwards),
        "--batch",
        str(a.batch),
        "--device",
        a.device,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:100]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="8 layers of 256 (2 MiB), cap 1 MiB, 3 forwards")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--cap-mb", type=int, default=64)
    ap.add_argument("--forwards", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lib", default="trainforge", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="dispatch_cap", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    if a.tiny:
        a.width, a.layers, a.cap_mb, a.forwards = 256, 8, 1, 3
    try:
        import accelerate  # noqa: F401

        libs = ["trainforge", "accelerate"]
    except ImportError:
        libs = ["trainforge"]
        print("accelerate is not installed: trainforge rows only")
    work = tempfile.mkdtemp(prefix="tf-bench-inference-")
    try:
        from safetensors.torch import save_file

        torch.manual_seed(0)
        save_file(build(a.width, a.layers).state_dict(), os.path.join(work, "model.safetensors"))
        mib = lambda b: b / 2**20  # noqa: E731
        block = (a.width * a.width + a.width) * 4
        print(
            f"model {a.layers} x Linear({a.width}) = {mib(block * a.layers):.1f} MiB fp32, cpu cap {a.cap_mb} MiB, "
            f"largest block {mib(block):.2f} MiB, device {a.device}, batch {a.batch}, {a.forwards} forwards"
        )
        print(
            f"{'path':<13} {'lib':<11} {'load s':>8} {'peak anon MiB':>14} {'anon after MiB':>15} "
            f"{'written MiB':>12} {'fwd ms':>8} {'rows/s':>9}"
        )
        for path in a.paths:
            rows = {lib: run_row(a, lib, path, work) for lib in libs}
            for lib, r in rows.items():
                if "error" in r:
                    print(f"{path:<13} {lib:<11} error: {r['error']}")
                    continue
                print(
                    f"{path:<13} {lib:<11} {r['load_s']:8.3f} {mib(r['peak_load']):14.1f} {mib(r['after']):15.1f} "
                    f"{mib(r['written']):12.1f} {r['fwd_s'] * 1e3:8.2f} {r['rows_s']:9.0f}"
                )
            tf, ac = rows.get("trainforge", {}), rows.get("accelerate", {})
            if "fwd_s" in tf and "fwd_s" in ac:
                print(
                    f"{path:<13} ratio (trainforge/accelerate): load time {tf['load_s'] / ac['load_s']:.2f}x, "
                    f"peak anon {(tf['peak_load'] + 1) / (ac['peak_load'] + 1):.2f}x, "
                    f"throughput {tf['rows_s'] / ac['rows_s']:.2f}x"
                )
            if path == "dispatch_cap" and "peak_load" in tf:
                bound = a.cap_mb * 2**20 + block
                print(f"{path:<13} trainforge peak anon / (cap + largest block) = {tf['peak_load'] / bound:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
