"""Child process for the memory tests: RssAnon (anonymous memory; memory-mapped file pages do not
count) above the baseline, while loading a checkpoint and over 10 forwards. Prints one JSON line.

    python inference_mem.py CKPT_DIR OFFLOAD_DIR MODE   # MODE: dispatch_cap | disk_offload
"""

import json
import sys
import threading
import time

import torch
from torch import nn

from trainforge.trainer.inference import disk_offload, init_empty_weights, load_checkpoint_and_dispatch

WIDTH, DEPTH = 512, 16


def build() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(DEPTH)])


def anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = anon(), False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, anon())
            time.sleep(0.0005)


def main() -> None:
    ckpt, offload, mode = sys.argv[1:4]
    torch.set_num_threads(1)
    x = torch.randn(2, WIDTH)
    with init_empty_weights():
        model = build()
    nn.Sequential(nn.Linear(4, 4))(torch.randn(1, 4))  # warm the allocator and kernels outside the figure
    base = anon()
    sampler = Peak()
    sampler.start()
    if mode == "dispatch_cap":
        model = load_checkpoint_and_dispatch(
            model, ckpt, device_map="auto", max_memory={"cpu": "4MiB"}, offload_folder=offload
        )
    else:
        model = disk_offload(model, ckpt, execution_device="cpu")
    sampler.stop = True
    sampler.join()
    after_load = anon()
    per_forward = []
    with torch.no_grad():
        for _ in range(10):
            model(x)
            per_forward.append(anon() - base)
    print(
        json.dumps(
            {
                "peak_load": sampler.peak - base,
                "after_load": after_load - base,
                "forwards": per_forward,
                "map": {k: str(v) for k, v in model.hf_device_map.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
