"""DeepSpeed ZeRO vs DDP through ``Trainer.fit`` (for tests/strategies/test_deepspeed.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/ds_parity.py OUT
    python -m torch.distributed.run --standalone --nproc-per-node 1 tests/scripts/ds_parity.py OUT --memory-only

One launch runs everything (DeepSpeed's import costs ~15 s per process): per stage 1/2/3 a plain
run ("A": accumulation 1) and a run with accumulation 2, clipping and a StepLR ("B"), each against
the DDP run with the same seed and data; a resume of "B" from a mid-epoch checkpoint; consolidated
weights through ``Trainer.save_weights``; ``load_module_state_dict``; and the ZeRO-3 per-rank
model+optimizer state bytes. Writes ``OUT/rank{r}.json`` and ``OUT/weights/<run>/``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from trainforge import Trainer, TrainingModule
from trainforge.strategies.deepspeed import DeepSpeedStrategy, local_state_bytes
from trainforge.strategies.errors import CheckpointError

STEPS = 20


class Tiny(TrainingModule):
    def __init__(self, scheduler: bool, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
        self.use_scheduler = scheduler
        self.losses, self.lrs = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        self.lrs.append(float(self.trainer.optimizer.param_groups[0]["lr"]))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        if not self.use_scheduler:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5), "interval": "step"},
        }


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(80, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(80, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)


def fit(strategy, config: str, root: Path, max_steps: int = STEPS, ckpt=None, model_seed: int = 0):
    torch.manual_seed(model_seed)
    module = Tiny(scheduler=config == "B")
    trainer = Trainer(
        strategy=strategy,
        precision="32",
        max_steps=max_steps,
        seed=0,
        accumulate_grad_batches=2 if config == "B" else 1,
        gradient_clip_val=0.05 if config == "B" else None,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
        log_every_n_steps=1000,
    )
    trainer.fit(module, loader(), ckpt_path=ckpt)
    return trainer, module


def zero3_state_bytes(trainer) -> int:
    """Bytes of this rank's model parameters + optimizer state, read from the partitioned tensors."""
    state = local_state_bytes(trainer.model)
    return state["params"] + state["optimizer"]


class Payload:
    """A pickle that runs a shell command when loaded without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def safety_checks(out: Path, trainer, ckpt: Path, rank: int) -> dict:
    """DeepSpeed's loader refuses a code-carrying pickle; a tampered shard is caught by the manifest."""
    evil, marker = out / f"evil{rank}.pt", out / f"executed{rank}"
    torch.save({"state": Payload(marker)}, evil)
    try:
        trainer.model.checkpoint_engine.load(str(evil), map_location="cpu")
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    tampered = out / "tampered"
    if rank == 0:
        shutil.copytree(ckpt, tampered)
        shard = tampered / "deepspeed" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.write_bytes(shard.read_bytes() + b"x")
    trainer.strategy.barrier()
    try:
        trainer.strategy.load_checkpoint(tampered, trainer.model, trainer.optimizers)
        tamper_error = ""
    except CheckpointError as e:
        tamper_error = str(e)
    return {"refused": refused, "executed": marker.exists(), "tamper_error": tamper_error}


def memory_run(root: Path) -> dict:
    torch.manual_seed(0)
    module = Tiny(scheduler=False, width=512)
    trainer = Trainer(
        strategy=DeepSpeedStrategy(stage=3),
        precision="32",
        max_steps=2,
        seed=0,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, loader())
    auto = DeepSpeedStrategy(stage="auto")
    auto_trainer = Trainer(
        strategy=auto,
        precision="32",
        max_steps=2,
        seed=0,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    auto_trainer.fit(Tiny(scheduler=False), loader())
    return {
        "zero3_bytes": zero3_state_bytes(trainer),
        "params": sum(p.ds_numel for p in module.parameters()),
        "auto_stage": auto.config["zero_optimization"]["stage"],
        "auto_report": auto.auto_report,
    }


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    root = out / "runs"
    result: dict = {"runs": {}, "timings": {}}
    if "--memory-only" in sys.argv:
        result.update(memory_run(root))
        (out / f"memory_world{os.environ['WORLD_SIZE']}.json").write_text(json.dumps(result))
        return
    for config in ("A", "B"):
        start = time.time()
        trainer, module = fit("ddp", config, root)
        result["runs"][f"ddp-{config}"] = {"losses": module.losses, "lrs": module.lrs}
        trainer.save_weights(str(out / "weights" / f"ddp-{config}"))
        result["timings"][f"ddp-{config}"] = time.time() - start
    for stage in (1, 2, 3):
        for config in ("A", "B"):
            start = time.time()
            trainer, module = fit(DeepSpeedStrategy(stage=stage), config, root)
            name = f"zero{stage}-{config}"
            result["runs"][name] = {"losses": module.losses, "lrs": module.lrs}
            trainer.save_weights(str(out / "weights" / name))
            if config == "A":  # load DDP's final weights into the partitioned engine and read them back
                from trainforge.strategies.checkpoint.io import load_tensors

                ddp = load_tensors(out / "weights" / "ddp-A")
                trainer.strategy.load_module_state_dict(trainer.model, ddp)
                back = trainer.strategy.module_state_dict(trainer.model)
                result["runs"][name]["reload_max_diff"] = max(float((back[k] - v).abs().max()) for k, v in ddp.items())
            result["timings"][name] = time.time() - start
        # resume: 7 optimizer steps (14 micro-batches: mid-epoch), save, continue in a new Trainer
        start = time.time()
        first, _ = fit(DeepSpeedStrategy(stage=stage), "B", root, max_steps=7)
        ckpt = first.save_checkpoint(str(out / "ckpt" / f"zero{stage}"))
        resumed, module = fit(DeepSpeedStrategy(stage=stage), "B", root, ckpt=str(ckpt), model_seed=99)
        result["runs"][f"zero{stage}-B-resumed"] = {
            "losses": module.losses,
            "lrs": module.lrs,
            "files": sorted(p.relative_to(ckpt).as_posix() for p in Path(ckpt).rglob("*") if p.is_file()),
        }
        resumed.save_weights(str(out / "weights" / f"zero{stage}-B-resumed"))
        result["timings"][f"zero{stage}-resume"] = time.time() - start
    result["safety"] = safety_checks(out, resumed, Path(ckpt), rank)
    for name, kwargs in (
        ("zero2-offload", {"stage": 2, "offload_optimizer": True}),
        ("zero3-offload-all", {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    ):
        trainer, module = fit(DeepSpeedStrategy(**kwargs), "B", root)
        zero = trainer.strategy.config["zero_optimization"]
        result["runs"][f"{name}-B"] = {
            "losses": module.losses,
            "lrs": module.lrs,
            "offload": [zero.get(k, {}).get("device") for k in ("offload_optimizer", "offload_param")],
        }
    trainer, module = fit(DeepSpeedStrategy(stage=3, activation_checkpointing={nn.Linear}), "A", root)
    wrapped = sum(type(m).__name__ == "CheckpointWrapper" for m in module.modules())
    result["runs"]["zero3-A-checkpointed"] = {"losses": module.losses, "wrapped": wrapped}
    result.update(memory_run(root))
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
