"""Token-weighted loss (trainer/accelerator/token_loss.py): a tiny language model on variable-length padded
sequences, shared by tests/trainer/test_token_loss.py (in process) and run by it on 2 processes:

    trainforge launch --nproc-per-node 2 tests/scripts/token_loss_run.py OUT.pt [STRATEGY]

trains one optimizer step (batch 2 per rank, 4 accumulation steps: all 16 sequences) with the loss
summed over tokens and ``num_items``, and rank 0 saves the gradients seen before the optimizer step."""

from __future__ import annotations

import sys
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule
from trainforge.callbacks import Callback

VOCAB, DIM, MAX_LEN, N_SEQ, IGNORE = 11, 8, 7, 16, -100
LENGTHS = [1, 7, 2, 6, 1, 5, 7, 3, 2, 7, 1, 4, 6, 1, 7, 2]  # tokens per sequence: very uneven batches


def sequences() -> TensorDataset:
    """``(index, tokens, labels)``, padded to MAX_LEN; padding labels are IGNORE."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (N_SEQ, MAX_LEN), generator=g)
    labels = torch.randint(0, VOCAB, (N_SEQ, MAX_LEN), generator=g)
    for i, n in enumerate(LENGTHS):
        tokens[i, n:], labels[i, n:] = 0, IGNORE
    return TensorDataset(torch.arange(N_SEQ), tokens, labels)


class TokenLM(TrainingModule):
    """``summed=True``: returns the loss summed over tokens with ``num_items``; else the token mean
    of each micro-batch (the mean of means under accumulation). ``lr=0``: the weights stay."""

    def __init__(self, summed: bool = True, lr: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.summed, self.lr = summed, lr

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tokens)))

    def token_loss(self, tokens: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction=reduction)

    def training_step(self, batch, batch_idx):
        _, tokens, labels = batch
        if not self.summed:
            return self.token_loss(tokens, labels, "mean")
        return {"loss": self.token_loss(tokens, labels, "sum"), "num_items": (labels != IGNORE).sum()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class GradsBeforeStep(Callback):
    """The gradients the optimizer is about to use, per step."""

    def __init__(self) -> None:
        self.grads: list = []

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.grads.append({n: _full(p.grad).detach().clone() for n, p in module.named_parameters()})


def _full(grad: torch.Tensor) -> torch.Tensor:
    """FSDP2's gradients are DTensor shards: the whole gradient (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def reference_grads(indices) -> Dict[str, torch.Tensor]:
    """One backward of the token-mean loss over the concatenated sequences ``indices``."""
    _, tokens, labels = sequences()[list(indices)]
    module = TokenLM()
    module.token_loss(tokens, labels, "mean").backward()
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def main(out: str, strategy: str = "auto") -> None:
    grads = GradsBeforeStep()
    trainer = Trainer(
        strategy=strategy,
        max_steps=1,
        accumulate_grad_batches=4,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[grads],
    )
    trainer.fit(TokenLM(), DataLoader(sequences(), batch_size=2))
    if trainer.is_global_zero:
        torch.save(grads.grads[0], out)


if __name__ == "__main__":
    main(*sys.argv[1:])
