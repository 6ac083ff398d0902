"""Records every hook call of a fit, validate, test, predict, save, resume and a failing fit, with a module
and a callback that override every Lightning 2.6 hook (``python hook_order.py lightning|trainforge OUT ROOT``).
Lightning's run (``import lightning as L``; with ``lightning`` it also writes the hook lists) is recorded in
lightning26_hooks.json beside this file; tests/trainer/test_hook_coverage.py runs the trainforge side."""

import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if sys.argv[1] == "lightning":
    import lightning as L
    from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

    MODULE_HOOKS = [n for c in (ModelHooks, DataHooks, CheckpointHooks) for n, f in vars(c).items() if callable(f)]
    MODULE_HOOKS = [n for n in MODULE_HOOKS if not n.startswith("_")]
    MODULE_HOOKS += [
        "optimizer_step",
        "optimizer_zero_grad",
        "backward",
        "lr_scheduler_step",
        "configure_gradient_clipping",
        "configure_callbacks",
    ]
    CALLBACK_HOOKS = [n for n, f in vars(L.Callback).items() if callable(f) and not n.startswith("_")]
else:
    import trainforge.lightning as L

    HOOKS = json.load(open(sys.argv[4]))
    MODULE_HOOKS, CALLBACK_HOOKS = HOOKS["module_hooks"], HOOKS["callback_hooks"]

OUT, ROOT = sys.argv[2], sys.argv[3]
calls = []
# hooks that return the stage's loaders, and Lightning's deprecated twin of configure_model
NOT_RECORDED = {
    "configure_sharded_model",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
}


class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        calls.append("m:training_step")
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        calls.append("m:validation_step")
        self.log("val", nn.functional.mse_loss(self(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        calls.append("m:test_step")
        self.log("test", nn.functional.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        calls.append("m:predict_step")
        return self(batch[0])

    def configure_optimizers(self):
        calls.append("m:configure_optimizers")
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


def recorder(prefix, name, base):
    def hook(self, *args, **kwargs):
        calls.append(f"{prefix}:{name}")
        return getattr(base, name)(self, *args, **kwargs)

    return hook


for name in MODULE_HOOKS:
    if name not in NOT_RECORDED:
        setattr(M, name, recorder("m", name, L.LightningModule))


class C(L.Callback):
    pass


for name in CALLBACK_HOOKS:
    setattr(C, name, recorder("c", name, L.Callback))


def trainer(**kwargs):
    kwargs = {"max_epochs": 1, "num_sanity_val_steps": 1, "limit_val_batches": 1, **kwargs}
    return L.Trainer(
        callbacks=[C()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=ROOT,
        log_every_n_steps=1,
        **kwargs,
    )


class Boom(M):
    def training_step(self, batch, batch_idx):
        raise ValueError("boom")


torch.manual_seed(0)
data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
fit, model = trainer(), M()
calls.append("=fit")
fit.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
calls.append("=validate")
fit.validate(model, DataLoader(data, batch_size=8), verbose=False)
calls.append("=test")
fit.test(model, DataLoader(data, batch_size=8), verbose=False)
calls.append("=predict")
fit.predict(model, DataLoader(data, batch_size=8))
calls.append("=save")
fit.save_checkpoint(f"{ROOT}/saved")
calls.append("=resume")
trainer(max_epochs=2, num_sanity_val_steps=0).fit(
    model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4), ckpt_path=f"{ROOT}/saved"
)
calls.append("=exception")
try:
    trainer(num_sanity_val_steps=0).fit(Boom(), DataLoader(data, batch_size=4))
except ValueError:
    pass
record = {"order": calls}
if sys.argv[1] == "lightning":
    record.update(module_hooks=MODULE_HOOKS, callback_hooks=CALLBACK_HOOKS)
json.dump(record, open(OUT, "w"), indent=0)
