"""precision="fp8" under FSDP2 (torchao float8 training) on 2 gloo ranks: the same fit with the Float8Linear
weights all-gathered in float8 (FSDPStrategy's default under fp8) and in the parameter dtype, and on one
process without FSDP. Writes <out>/rank<r>.json: per variant the losses, the final weights' checksum and
the class of a Float8Linear weight's local shard."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule
from trainforge.strategies import FSDPStrategy

DIM, VOCAB, SEQ = 32, 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class LM(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        loss = nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


GATHERED = {"bytes": 0}


def _count_gathered_bytes() -> None:
    """Instrument (not replace) the all-gather FSDP2 calls (its name differs between torch releases):
    the bytes each rank contributes, the figure fp8 all-gather halves."""
    for name in ("all_gather_single", "all_gather_into_tensor"):
        real = getattr(torch.distributed, name, None)
        if real is None:
            continue

        def counted(output, input, *args, _real=real, **kwargs):
            GATHERED["bytes"] += input.numel() * input.element_size()
            return _real(output, input, *args, **kwargs)

        setattr(torch.distributed, name, counted)


def fit(strategy) -> dict:
    GATHERED["bytes"] = 0
    torch.manual_seed(0)
    module = LM()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            strategy=strategy,
            precision="fp8",
            max_steps=6,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            default_root_dir=str(OUT / "run"),
        )
        trainer.fit(module, DataLoader(data, batch_size=4))
    weight = module.blocks[0].up.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    state = trainer.strategy.module_state_dict(module) if hasattr(trainer.strategy, "mesh") else module.state_dict()
    return {
        "losses": module.losses,
        "layer": type(module.blocks[0].up).__name__,
        "shard": type(local).__name__,
        "checksum": sum(float(v.double().abs().sum()) for v in state.values()) if state else None,
        "gathered_bytes": GATHERED["bytes"],
        "cpu_warning": any("fp8' on CPU" in str(w.message) for w in caught),
    }


OUT = Path(sys.argv[1])
if __name__ == "__main__":
    _count_gathered_bytes()
    bf16_gather = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results = {
        "fp8_gather": fit(FSDPStrategy()),
        "param_gather": fit(FSDPStrategy(fp8_all_gather=False, mixed_precision=bf16_gather)),
        "fp8_gather_fp32_params": fit(FSDPStrategy(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float32))),
        "fp32_gather": fit(
            FSDPStrategy(fp8_all_gather=False, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float32))
        ),
    }
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(__import__("os").environ["RANK"])
    (OUT / f"rank{rank}.json").write_text(json.dumps(results))
    print(f"rank {rank} ok", flush=True)
