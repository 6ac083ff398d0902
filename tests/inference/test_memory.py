"""Anonymous memory (RssAnon: memory-mapped file pages are not counted) of loading and running a
16 MiB model in a child process, so the figure is clean of the test runner's own memory."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.helpers import procs

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inference_mem.py"
MiB = 2**20
CAP, BLOCK, SLACK = 4 * MiB, (512 * 512 + 512) * 4, 4 * MiB


def _checkpoint(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import inference_mem
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    save_file(inference_mem.build().state_dict(), str(tmp_path / "model.safetensors"))  # ~16 MiB > CAP
    return tmp_path


def _child(tmp_path, mode):
    out = procs.run([sys.executable, SCRIPT, tmp_path, tmp_path / "offload", mode], timeout=240).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_load_above_cpu_cap_grows_anon_by_at_most_cap_plus_block(tmp_path):
    ckpt = _checkpoint(tmp_path)
    got = _child(ckpt, "dispatch_cap")
    assert set(got["map"].values()) == {"cpu", "disk"}, got  # the cap really split the model
    assert got["peak_load"] <= CAP + BLOCK + SLACK, got
    assert max(got["forwards"]) <= CAP + BLOCK + SLACK, got
    assert not (tmp_path / "offload").exists() or not any((tmp_path / "offload").iterdir())  # zero bytes written


def test_disk_offload_stays_flat_over_ten_forwards(tmp_path):
    ckpt = _checkpoint(tmp_path)
    got = _child(ckpt, "disk_offload")
    assert got["peak_load"] <= SLACK, got
    f = got["forwards"]
    assert max(f) - min(f) <= 1 * MiB and max(f) <= BLOCK + SLACK, got
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
