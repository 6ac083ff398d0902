"""Model, data and helpers shared by the FSDP test scripts (tests/scripts/fsdp_*.py).

A small transformer-like language model: embedding, a ``ModuleList`` of identical blocks (what
auto-wrap shards as units), final norm and head. fp32 on CPU so parity is exact up to the order of
floating-point sums.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule

VOCAB, DIM, SEQ, N_BLOCKS, SAMPLES = 32, 16, 8, 3, 160
BLOCK_NAMES = [f"net.blocks.{i}" for i in range(N_BLOCKS)]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.ln1(x)).cumsum(dim=1) / (1 + torch.arange(x.shape[1], device=x.device))[:, None]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(N_BLOCKS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())


class LitLM(TrainingModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in every run
        self.net = TinyLM()
        self.lr = lr
        self.losses: List[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def loader(batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size, shuffle=False)


def make_trainer(strategy: Any, root: Path, max_steps: int, **kwargs: Any) -> Trainer:
    kwargs.setdefault("gradient_clip_val", 0.5)  # small enough to clip: exercises the sharded norm
    return Trainer(
        strategy=strategy,
        max_steps=max_steps,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
        seed=0,
        **kwargs,
    )


def fit(
    strategy: Any, root: Path, max_steps: int = 20, ckpt_path: Any = None, batch_size: int = 4, **kwargs: Any
) -> tuple[Trainer, LitLM]:
    module = LitLM()
    trainer = make_trainer(strategy, root, max_steps, **kwargs)
    trainer.fit(module, loader(batch_size), ckpt_path=ckpt_path)
    return trainer, module


def full_state(trainer: Trainer) -> Dict[str, torch.Tensor]:
    """The consolidated weights (rank 0; {} elsewhere for FSDP), cloned to CPU."""
    return {k: v.detach().cpu().clone() for k, v in trainer.strategy.module_state_dict(trainer.model).items()}


def write_json(path: Path, obj: Any) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
