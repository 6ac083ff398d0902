"""Two ranks (gloo, fp32): adapter-only checkpoints of a LoRA tiny Llama under DDP and FSDP2, for
tests/trainer/test_adapter_checkpoints.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/adapter_run.py OUT

For each strategy (DDP, FSDP2 with sharded and with full state dicts; one launch, fresh Trainers on the
same process group):

- the Trainer: 8 optimizer steps with ModelCheckpoint every 4, once adapter-only (the default for a
  PEFT model) and once whole (``trainable_only=False``) for the sizes; then a fresh model resumes the
  step-4 adapter-only checkpoint to step 8 (``OUT/<strategy>/trainer.safetensors``: both final adapters);
- the Accelerator: 3 steps, ``save_state``, 3 more; a fresh model ``load_state``s and runs the same 3;
  then ``save_model`` writes the adapter in PEFT's format (``OUT/<strategy>/peft``) and rank 0 records
  the model's logits on fixed tokens (``OUT/<strategy>/logits.safetensors``) for PeftModel.from_pretrained.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict

import torch
from adapter_common import LitLora, lm_loss, loader, lora_model, tokens
from safetensors.torch import save_file

from trainforge import Accelerator, Trainer
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies import DDPStrategy, FSDPStrategy

STEPS, ACC_STEPS = 8, 3


def adapter(strategy: Any, model: Any) -> Dict[str, torch.Tensor]:
    """The trainable tensors, gathered (every rank calls; rank 0 gets them)."""
    return {k: v.detach().cpu().clone() for k, v in strategy.trainable_state_dict(model).items() if "lora" in k}


def trainer_runs(make: Any, out: Path) -> Dict[str, Any]:
    module = LitLora(lora_model())
    checkpoints = [
        ModelCheckpoint(dirpath=str(out / "adapter_ckpt"), every_n_steps=STEPS // 2, save_top_k=-1),
        ModelCheckpoint(dirpath=str(out / "full_ckpt"), every_n_steps=STEPS // 2, save_top_k=-1, trainable_only=False),
    ]
    trainer = Trainer(
        strategy=make(), max_steps=STEPS, callbacks=checkpoints, default_root_dir=str(out), enable_progress_bar=False
    )
    trainer.fit(module, loader())
    whole = adapter(trainer.strategy, trainer.model)
    resumed_module = LitLora(lora_model())
    resumed = Trainer(strategy=make(), max_steps=STEPS, default_root_dir=str(out), enable_progress_bar=False)
    resumed.fit(resumed_module, loader(), ckpt_path=str(out / "adapter_ckpt" / f"epoch=0-step={STEPS // 2}"))
    again = adapter(resumed.strategy, resumed.model)
    if trainer.is_global_zero:
        save_file(
            {**{f"whole/{k}": v for k, v in whole.items()}, **{f"resumed/{k}": v for k, v in again.items()}},
            str(out / "trainer.safetensors"),
        )
    return {"losses": module.losses, "resumed_losses": resumed_module.losses}


def accelerator_steps(acc: Accelerator, model: Any, opt: Any, batches: Any, n: int) -> list:
    losses = []
    for _, batch in zip(range(n), batches):
        loss = lm_loss(model, batch)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def accelerator_runs(make: Any, out: Path) -> Dict[str, Any]:
    acc = Accelerator(strategy=make())
    net = lora_model()
    model, opt, dl = acc.prepare(
        net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2), loader()
    )
    batches = iter(dl)
    first = accelerator_steps(acc, model, opt, batches, ACC_STEPS)
    acc.save_state(str(out / "acc_state"))
    after = accelerator_steps(acc, model, opt, batches, ACC_STEPS)
    whole = adapter(acc.strategy, model)
    acc.save_model(model, str(out / "peft"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens(4)).logits.detach().cpu().clone()
    acc2 = Accelerator(strategy=make())
    net2 = lora_model()
    model2, opt2, dl2 = acc2.prepare(
        net2, torch.optim.AdamW([p for p in net2.parameters() if p.requires_grad], lr=1e-2), loader()
    )
    acc2.load_state(str(out / "acc_state"))
    resumed = accelerator_steps(acc2, model2, opt2, iter(dl2), ACC_STEPS)
    again = adapter(acc2.strategy, model2)
    if acc.is_main_process:
        save_file({"logits": logits}, str(out / "logits.safetensors"))
        save_file(
            {**{f"whole/{k}": v for k, v in whole.items()}, **{f"resumed/{k}": v for k, v in again.items()}},
            str(out / "accelerator.safetensors"),
        )
    return {"first": first, "after": after, "resumed": resumed}


def main() -> None:
    root = Path(sys.argv[1])
    results: Dict[str, Any] = {}
    for name, make in (
        ("ddp", DDPStrategy),
        ("fsdp", FSDPStrategy),
        ("fsdp_full", lambda: FSDPStrategy(state_dict_type="full")),
    ):
        out = root / name
        results[name] = {"trainer": trainer_runs(make, out), "accelerator": accelerator_runs(make, out)}
    if torch.distributed.get_rank() == 0:
        (root / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
