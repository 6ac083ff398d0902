"""Lightning's step-hook recipes (the LightningModule docs and the UvA transformer tutorial), imports
changed only: each ``run(name, root)`` trains 2 epochs of 8 batches and returns the final weights and the
learning rate seen at every step. tests/trainer/test_hook_coverage.py compares them with Lightning 2.6."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainforge.lightning as L  # was: import lightning as L


class Recipe(L.LightningModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.lrs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class WarmUp(Recipe):
    """The LightningModule docs' warm-up: the learning rate set after each step from global_step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < 10:
            lr_scale = min(1.0, float(self.trainer.global_step + 1) / 10.0)
            for pg in optimizer.param_groups:
                pg["lr"] = lr_scale * self.hparams.lr


class PerIterationScheduler(Recipe):
    """The UvA transformer tutorial: a scheduler kept on the module, stepped in optimizer_step."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 5))
        return optimizer

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.lr_scheduler.step()


class ZeroEveryOther(Recipe):
    """optimizer_zero_grad that zeroes only at even batches: gradients of two batches add up."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 2 == 0:
            optimizer.zero_grad()


class HalfBackward(Recipe):
    def backward(self, loss, *args, **kwargs):
        (loss * 0.5).backward(*args, **kwargs)


class TwiceScheduler(Recipe):
    """lr_scheduler_step called per interval; this one steps the scheduler twice."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step()
        scheduler.step()


class SkipRest(Recipe):
    """on_train_batch_start returning -1 ends the epoch at batch 5."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 5 else None


class DoubledInputs(Recipe):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x * 2, y

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x, y + 1


class SkipOddSteps(Recipe):
    """optimizer_step that runs the closure but steps only at even batches."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % 2 == 0:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


RECIPES = {
    "warm_up": (WarmUp, {}),
    "per_iteration_scheduler": (PerIterationScheduler, {}),
    "zero_every_other": (ZeroEveryOther, {}),
    "half_backward": (HalfBackward, {}),
    "twice_scheduler": (TwiceScheduler, {}),
    "skip_rest": (SkipRest, {}),
    "doubled_inputs": (DoubledInputs, {}),
    "skip_odd_steps": (SkipOddSteps, {}),
    "warm_up_accumulate_clip": (WarmUp, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}),
}


def run(name, root):
    cls, trainer_args = RECIPES[name]
    torch.manual_seed(0)
    model = cls()
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = L.Trainer(
        max_epochs=2,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return weights, model.lrs, trainer.global_step


if __name__ == "__main__":
    import json
    import sys
    import tempfile

    out = {}
    for recipe in RECIPES:
        weights, lrs, steps = run(recipe, tempfile.mkdtemp())
        out[recipe] = {"weights": weights.tolist(), "lrs": lrs, "global_step": steps}
    json.dump(out, open(sys.argv[1], "w"))
