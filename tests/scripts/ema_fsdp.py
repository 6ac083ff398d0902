"""Two ranks (gloo, fp32), FSDP2: EMAWeightAveraging averages each rank's shard, for
tests/callbacks/test_weight_averaging.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/ema_fsdp.py OUT

An uninterrupted run of STEPS steps, then one cut at CUT (a checkpoint: the average as the sharded model,
the gathered current weights in the callback state) resumed to STEPS. Checks, on every rank: the gathered
average equals an EMA computed by hand on the gathered weights of every step; each rank holds only its
shard of the average; the resumed run ends bit-identical to the uninterrupted one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List

import torch
import torch.distributed as dist
from fsdp_common import LitLM, loader
from torch.distributed.tensor import DTensor

from trainforge import Trainer
from trainforge.callbacks import EMAWeightAveraging, ModelCheckpoint
from trainforge.strategies import FSDPStrategy
from trainforge.strategies.errors import CheckpointError

STEPS, CUT, DECAY = 8, 4, 0.8


def full(module: Any) -> List[torch.Tensor]:
    return [
        p.detach().full_tensor().clone() if isinstance(p, DTensor) else p.detach().clone() for p in module.parameters()
    ]


class Recorded(LitLM):
    def __init__(self) -> None:
        super().__init__()
        self.after_step: List[List[torch.Tensor]] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after_step.append(full(self))  # a collective: every rank records


def fit(
    root: Path, max_steps: int, ckpt_path: Any = None, averaging: bool = True, **kwargs: Any
) -> tuple[Recorded, EMAWeightAveraging]:
    module, ema = Recorded(), EMAWeightAveraging(decay=DECAY)
    trainer = Trainer(
        strategy=FSDPStrategy(),
        max_steps=max_steps,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=0.5,
        seed=0,
        logger=False,  # checkpoints in <root>/checkpoints (a logger's would be in its version folder)
        callbacks=[ema, ModelCheckpoint(every_n_steps=CUT)] if averaging else [ModelCheckpoint(every_n_steps=CUT)],
        **kwargs,
    )
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return module, ema


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(__import__("os").environ["RANK"])
    whole, ema = fit(out / "whole", STEPS)
    avg = None
    for weights in whole.after_step:
        avg = [w.clone() for w in weights] if avg is None else [a.lerp(w, 1 - DECAY) for a, w in zip(avg, weights)]
    assert avg is not None and len(whole.after_step) == STEPS
    got = full(whole)  # after fit the module holds the average
    worst = max(float((g - a).abs().max()) for g, a in zip(got, avg))
    assert worst <= 1e-6, worst
    local = sum(p.to_local().numel() for p in whole.parameters())
    total = sum(p.numel() for p in whole.parameters())
    assert ema.local_numel == local < total, (ema.local_numel, local, total)
    assert all(isinstance(p, DTensor) for p in whole.parameters())

    cut = out / "cut"
    fit(cut, CUT)
    resumed, _ = fit(cut, STEPS, ckpt_path="last")
    assert all(torch.equal(a, b) for a, b in zip(full(resumed), got)), "resumed average differs"
    for x, y in zip(resumed.after_step, whole.after_step[CUT:]):
        assert all(torch.equal(a, b) for a, b in zip(x, y)), "resumed current weights differ"
    # the same checkpoint resumed without the callback would train on from the average: refused on every rank
    refused = ""
    try:
        fit(cut, STEPS, ckpt_path=str(cut / "checkpoints" / f"epoch=0-step={CUT}"), averaging=False)
    except CheckpointError as e:
        refused = str(e)
    assert "without the callback EMAWeightAveraging" in refused, f"resume without the callback: {refused!r}"
    print(f"rank {rank} ok: max |average - hand EMA| = {worst:.2e}, local {local} of {total} elements", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
