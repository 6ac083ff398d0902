"""Child process of tests/inference/test_gpu.py (the test process itself may hide CUDA): CUDA
paths, offloaded blocks copied through reused pinned buffers, next block prefetched on a side
stream; outputs equal to the model run eagerly on the GPU.

    python tests/scripts/inference_gpu.py HOW TMP_DIR   # HOW: cpu_offload disk_offload mixed_map no_prefetch
"""

import sys
from pathlib import Path

import torch

from tests.inference.common import gpt2_config, greedy, quiet_transformers
from trainforge.trainer.inference import cpu_offload, disk_offload, init_empty_weights, load_checkpoint_and_dispatch


def _gpt2():
    quiet_transformers()
    from transformers import GPT2LMHeadModel

    torch.manual_seed(5)
    return GPT2LMHeadModel(gpt2_config()).eval()


def check(tmp_path: Path, how: str) -> None:
    model = _gpt2()
    ids = torch.tensor([[3, 5, 7, 9]], device="cuda")
    ref_model = _gpt2().cuda()
    ref_tokens, ref_logits = greedy(ref_model, ids), ref_model(ids).logits
    if how in ("cpu_offload", "no_prefetch"):
        cpu_offload(model, execution_device=0, prefetch=how != "no_prefetch")
    elif how == "disk_offload":
        disk_offload(model, tmp_path / "off", execution_device="cuda:0")
    else:
        model.save_pretrained(tmp_path / "ckpt")
        with init_empty_weights():
            model = type(model)(gpt2_config()).eval()
        model = load_checkpoint_and_dispatch(
            model,
            tmp_path / "ckpt",
            offload_folder=tmp_path / "off",
            device_map={
                "transformer.wte": 0,
                "transformer.wpe": 0,
                "transformer.drop": 0,
                "transformer.h.0": "cpu",
                "transformer.h.1": "disk",
                "transformer.h.2": 0,
                "transformer.ln_f": "cpu",
                "lm_head": 0,
            },
        )
        assert model.transformer.h[2].attn.c_attn.weight.is_cuda
    out = model(ids).logits
    assert out.device.type == "cuda"
    torch.testing.assert_close(out, ref_logits, rtol=0, atol=1e-5)
    assert torch.equal(greedy(model, ids), ref_tokens)
    runner = model._trainforge_runner
    offloaded = [p for p in model.parameters() if p.device.type == "cpu"]
    assert offloaded, "weights must stay off the GPU between forwards"
    if runner.blocks:
        assert len(runner._buffers) == 2 and all(b.is_pinned() for b in runner._buffers)  # reused pinned buffers
        assert (runner.stream is not None) == (how != "no_prefetch")
        assert len(runner.order) == len(runner.blocks) and not runner.recording  # the order is known: prefetching


if __name__ == "__main__":
    check(Path(sys.argv[2]), sys.argv[1])
    print("OK", sys.argv[1])
