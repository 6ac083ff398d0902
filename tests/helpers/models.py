"""Small models and data shared by the tests (real torch, no mocks)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from trainforge import TrainingModule


def regression_data(n: int = 64, dim: int = 8, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_net(dim: int = 8, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 1))


class Regressor(TrainingModule):
    """MSE regression; optimizer AdamW, optional StepLR stepped per optimizer step."""

    def __init__(self, net: nn.Module, lr: float = 1e-2, step_lr: bool = False) -> None:
        super().__init__()
        self.net, self.lr, self.step_lr = net, lr, step_lr
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.step_lr:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
