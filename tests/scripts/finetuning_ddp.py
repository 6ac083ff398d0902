"""BaseFinetuning on `trainforge launch --nproc-per-node N` (or a plain `python`: one process), run as
`finetuning_ddp.py OUT BATCH`: a backbone frozen at setup and unfrozen at epoch 1 (tests/callbacks/test_finetuning.py).
Each rank writes its final weights to OUT/rank-<r>.pt. The data is split between ranks by the sampler; with
BATCH per rank the global batch is BATCH * N, so 2 ranks of 4 see the samples 1 rank of 8 sees."""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import trainforge.lightning as L
from trainforge.callbacks import BaseFinetuning


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)


class Unfreeze(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.1)


out, batch = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
x = torch.randn(32, 4)
data = TensorDataset(x, x.sum(1, keepdim=True).sin())
model = Net()
trainer = L.Trainer(
    max_epochs=3,
    accelerator="cpu",
    callbacks=[Unfreeze()],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=str(out),
)
trainer.fit(model, DataLoader(data, batch_size=batch))
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"rank-{trainer.global_rank}.pt")
