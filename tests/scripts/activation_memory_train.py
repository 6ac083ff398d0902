"""2 gloo ranks: every activation_checkpointing mode under DDP and FSDP2 against the mode off, and
exact resume with a mode on; the modes DeepSpeed (ZeRO-3: full, selective; ZeRO-2: op) and Megatron
tensor parallelism (tp=2) and pipeline stages (pp=2, each rank checking its own blocks) apply, against
their own mode-off runs (tests/strategies/test_activation_memory.py reads results.json).

Each run trains fsdp_common's LitLM for STEPS optimizer steps from the same seed; rank 0 compares
the consolidated weights with the mode-off run of the same strategy (exact equality: recomputation
replays the same CPU kernels, and offload on the CPU moves nothing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from fsdp_common import fit, full_state, write_json
from megatron_pp import fit as pipeline_fit

from trainforge.callbacks.base import Callback
from trainforge.strategies import DDPStrategy, FSDPStrategy
from trainforge.strategies.deepspeed import DeepSpeedStrategy
from trainforge.strategies.megatron import MegatronStrategy

STEPS = 4
MODES = (None, "full", "selective:2", "op", "offload")
STRATEGIES = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}
TP_PLAN = {"net.blocks.*.mlp.0": "colwise", "net.blocks.*.mlp.2": "rowwise"}
OTHERS = {  # name: (strategy builder, modes; the first is the reference). ZeRO-3 last: it replaces
    # F.linear for the rest of the process, with a function that "op" refuses (it adds the bias in place)
    "megatron_tp2": (
        lambda mode: MegatronStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, activation_checkpointing=mode),
        (None, "selective:2", "op"),
    ),
    "deepspeed2": (lambda mode: DeepSpeedStrategy(stage=2, activation_checkpointing=mode), (None, "op")),
    "deepspeed3": (
        lambda mode: DeepSpeedStrategy(stage=3, activation_checkpointing=mode),
        (None, "full", "selective:2"),
    ),
}


class SaveAt(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(str(self.path))


def gathered_pp(results: Dict[str, Any], rank: int) -> list:
    """Every rank's pipeline results (each holds its own stage's blocks)."""
    mine = {k: v for k, v in results.items() if k.startswith("megatron_pp2/") and k.endswith(f"rank{rank}")}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    results: Dict[str, Any] = {}
    for kind, cls in STRATEGIES.items():
        reference: Dict[str, torch.Tensor] = {}
        for mode in MODES:
            trainer, module = fit(cls(activation_checkpointing=mode), out / f"{kind}-{mode}", max_steps=STEPS)
            state = full_state(trainer)
            reference = reference or state
            results[f"{kind}/{mode}"] = {
                "losses": module.losses,
                "same_weights": same(state, reference),
                "checkpointed": trainer.strategy.checkpointed_modules,
            }
        # exact resume with a mode on: save at step 2 of the uninterrupted run, resume in a fresh fit
        saver = SaveAt(STEPS // 2, out / f"{kind}-ckpt")
        trainer, module = fit(
            cls(activation_checkpointing="op"), out / f"{kind}-whole", max_steps=STEPS, callbacks=[saver]
        )
        whole = full_state(trainer)
        trainer, resumed = fit(
            cls(activation_checkpointing="op"), out / f"{kind}-resumed", max_steps=STEPS, ckpt_path=str(saver.path)
        )
        results[f"{kind}/resume"] = {
            "losses": resumed.losses,
            "whole_losses": module.losses[STEPS // 2 :],
            "same_weights": same(full_state(trainer), whole),
        }
    first = None  # pipeline stages (pp=2): "every n-th" counts the model's blocks across the stages
    for mode in (None, "selective:2", "op"):
        strategy = MegatronStrategy(pipeline_parallel_size=2, activation_checkpointing=mode)
        _, _, losses = pipeline_fit(strategy, out / f"pp2-{mode}", STEPS)
        first = first or losses
        results[f"megatron_pp2/{mode}/rank{rank}"] = {"losses": losses, "reference": first}
        results[f"megatron_pp2/{mode}/rank{rank}"]["checkpointed"] = strategy.checkpointed_modules
    results.update({k: v for d in gathered_pp(results, rank) for k, v in d.items()})
    for name, (build, modes) in OTHERS.items():
        first: Any = None
        for mode in modes:
            trainer, module = fit(build(mode), out / f"{name}-{mode}", max_steps=STEPS)
            first = first or module.losses
            results[f"{name}/{mode}"] = {"losses": module.losses, "reference": first}
    if rank == 0:
        write_json(out / "results.json", results)
    dist.barrier()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
