"""Two ranks (gloo, fp32): FSDP runs next to DDP, for tests/strategies/test_fsdp.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/fsdp_train.py OUT

One launch, many runs (each a fresh Trainer on the same process group): DDP and FSDP with every
sharding strategy, activation checkpointing, accumulation, save at step 10 of a running fit ->
a fresh run resumes (sharded and full state dicts), and the Accelerator with an optimizer created
before ``prepare``. Rank 0 writes ``OUT/results.json`` (losses of both ranks, wrapping, memory)
and safetensors of consolidated weights; ``OUT/ckpt/step-10`` (sharded) is left for
tests/scripts/fsdp_one.py (one process) and ``trainforge merge-weights``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from fsdp_common import BLOCK_NAMES, TinyLM, fit, full_state, lm_loss, loader, write_json
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainforge import Accelerator
from trainforge.callbacks.base import Callback
from trainforge.strategies import DDPStrategy, FSDPStrategy
from trainforge.strategies.fsdp import local_state_bytes

STEPS = 20  # the full runs; the Accelerator runs STEPS // 2 (compared with the step-10 weights)
SHORT = 6  # hybrid/no_shard/activation checkpointing/accumulation (optimizer steps)


def gathered(obj: Any) -> Any:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def wrapping_report(trainer: Any) -> Dict[str, Any]:
    model = trainer.model
    return {
        "wrapped": trainer.strategy.wrapped_modules,
        "checkpointed": trainer.strategy.checkpointed_modules,
        "units_are_fsdp": [isinstance(model.get_submodule(n), FSDPModule) for n in BLOCK_NAMES],
        "root_is_fsdp": isinstance(model, FSDPModule),
        "other_fsdp": sorted(
            n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n and n not in BLOCK_NAMES
        ),
        "params_are_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "placements": [str(p.placements) for p in model.net.blocks[0].parameters()][:1],
        "state_keys": sorted(trainer.strategy.module_state_dict(model)),
    }


def accelerator_run(out: Path, results: Dict[str, Any]) -> None:
    """The thin API: optimizer built on the unsharded parameters, then prepared with the model. Its loader is
    laid out as the Trainer's (one sample at a time), so each rank's losses compare with the Trainer's run."""
    acc = Accelerator(strategy=FSDPStrategy(), data_sharding="samples")
    torch.manual_seed(0)
    net = TinyLM()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    net, opt, dl = acc.prepare(net, opt, loader())
    results["acc_remapped"] = all(a is b for a, b in zip(opt.param_groups[0]["params"], net.parameters())) and all(
        isinstance(p, DTensor) for p in opt.param_groups[0]["params"]
    )
    losses, norms = [], []
    for _, batch in zip(range(STEPS // 2), dl):
        with acc.accumulate(net):
            loss = lm_loss(net, batch)
            acc.backward(loss)
            full = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.full_tensor()) for p in net.parameters()])
            )
            norm = acc.clip_grad_norm_(net.parameters(), 0.5)
            norms.append([float(norm), float(full), type(norm).__name__])
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    results["accelerator"] = gathered(losses)
    results["acc_norms"] = norms
    state = acc.strategy.module_state_dict(net)
    if dist.get_rank() == 0:
        save_file({f"net.{k}": v.contiguous() for k, v in state.items()}, str(out / "acc_final.safetensors"))


def no_sync_check(results: Dict[str, Any]) -> None:
    """Inside an accumulation window the reduce-scatter is skipped: no sharded gradient appears
    until the window's last backward."""
    acc = Accelerator(strategy=FSDPStrategy(), gradient_accumulation_steps=2)
    torch.manual_seed(0)
    net = acc.prepare(TinyLM())
    seen = []
    for _, batch in zip(range(2), acc.prepare_data_loader(loader())):
        with acc.accumulate(net):
            acc.backward(lm_loss(net, batch))
        seen.append([acc.sync_gradients, any(p.grad is not None for p in net.parameters())])
    results["no_sync"] = seen


class SaveAt(Callback):
    """Saves a checkpoint (and the gathered weights) after optimizer step ``step`` of a running fit."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path, self.state = step, path, None

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.state is None:
            trainer.save_checkpoint(str(self.path))
            self.state = full_state(trainer)


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    results: Dict[str, Any] = {}
    states: Dict[str, Dict[str, torch.Tensor]] = {}

    trainer, module = fit(DDPStrategy(), out / "ddp")
    results["ddp"], states["ddp"] = gathered(module.losses), full_state(trainer)

    # the uninterrupted runs save at step 10; fresh runs resume from there (sharded, then full)
    for kind, sharding, ckpt in (("sharded", "full_shard", "ckpt"), ("full", "shard_grad_op", "ckpt_full")):
        saver = SaveAt(STEPS // 2, out / ckpt / "step-10")
        trainer, module = fit(
            FSDPStrategy(sharding_strategy=sharding, state_dict_type=kind), out / sharding, callbacks=[saver]
        )
        results[sharding], states[sharding] = gathered(module.losses), full_state(trainer)
        if kind == "sharded":
            results["wrap"] = wrapping_report(trainer)
            results["memory"] = local_state_bytes(trainer.model, trainer.optimizers)
            states["gathered_step10"] = saver.state
        trainer, module = fit(FSDPStrategy(state_dict_type=kind), out / f"resumed_{kind}", ckpt_path=str(saver.path))
        results[f"resumed_{kind}"], states[f"resumed_{kind}"] = gathered(module.losses), full_state(trainer)
        results[f"resumed_{kind}_files"] = sorted(
            p.relative_to(saver.path).as_posix() for p in saver.path.rglob("*") if p.is_file()
        )

    for kind, options in (
        ("hybrid_shard", {"sharding_strategy": "hybrid_shard"}),
        ("no_shard", {"sharding_strategy": "no_shard"}),
        ("offload", {"cpu_offload": True}),
    ):
        trainer, module = fit(FSDPStrategy(**options), out / kind, max_steps=SHORT)
        results[kind] = gathered(module.losses)
        results[f"{kind}_placements"] = str(next(trainer.model.parameters()).placements)

    trainer, module = fit(FSDPStrategy(activation_checkpointing=True), out / "ac", max_steps=SHORT)
    results["ac"], results["ac_wrap"] = gathered(module.losses), wrapping_report(trainer)

    for name, strategy in (("ddp_accum", DDPStrategy()), ("fsdp_accum", FSDPStrategy())):
        trainer, module = fit(strategy, out / name, max_steps=SHORT, accumulate_grad_batches=2)
        results[name], states[name] = gathered(module.losses), full_state(trainer)

    accelerator_run(out, results)
    no_sync_check(results)
    if rank == 0:
        for name, state in states.items():
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"{name}.safetensors"))
        write_json(out / "results.json", results)
    dist.barrier()
    print(f"rank {rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
