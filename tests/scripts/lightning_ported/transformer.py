"""Lightning's language-model example on its demo Transformer (``examples/pytorch/basics/transformer.py``, the
model built in ``configure_model``), imports changed only; ``run(root, data_dir, max_epochs)`` as its ``main()``
with the text, the trainer's directory and the epochs given (it downloaded WikiText-2 and trained 20 epochs;
its splits of 2000 blocks are 4 here, and the batches 4 instead of 20, for a tiny text)."""

import torch
from torch.utils.data import DataLoader, random_split

import trainforge.lightning as L  # was: import lightning as L
from trainforge.lightning.demos import Transformer, WikiText2  # was: from lightning.pytorch.demos import ...


class LanguageModel(L.LightningModule):
    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.model = None

    def configure_model(self):
        if self.model is None:
            self.model = Transformer(vocab_size=self.vocab_size)

    def training_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = torch.nn.functional.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = torch.nn.functional.nll_loss(output, target.view(-1))
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = torch.nn.functional.nll_loss(output, target.view(-1))
        self.log("test_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(root, data_dir, max_epochs=2):
    L.seed_everything(42)

    # Data
    dataset = WikiText2(data_dir=data_dir, download=False)

    # Split data in to train, val, test
    n = len(dataset)
    train_dataset, val_dataset, test_dataset = random_split(dataset, [n - 8, 4, 4])
    train_dataloader = DataLoader(train_dataset, batch_size=4, shuffle=True)
    val_dataloader = DataLoader(val_dataset, batch_size=4, shuffle=False)
    test_dataloader = DataLoader(test_dataset, batch_size=4, shuffle=False)

    # Model
    model = LanguageModel(vocab_size=dataset.vocab_size)

    # Trainer
    trainer = L.Trainer(gradient_clip_val=0.25, max_epochs=max_epochs, default_root_dir=root, logger=False)
    trainer.fit(model, train_dataloader, val_dataloader)
    results = trainer.test(model, test_dataloader)
    return trainer, model, results
