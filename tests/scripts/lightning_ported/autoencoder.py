"""Lightning's README autoencoder, imports changed only; MNIST replaced by 8x8 synthetic images (no
download), the layers shrunk to match, and the trainer's directory given."""

import torch
from torch import nn, optim, utils

import trainforge.lightning as L  # was: import lightning as L

# define any number of nn.Modules (or use your current ones)
encoder = nn.Sequential(nn.Linear(8 * 8, 16), nn.ReLU(), nn.Linear(16, 3))
decoder = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 8 * 8))


# define the LightningModule
class LitAutoEncoder(L.LightningModule):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        # training_step defines the train loop.
        # it is independent of forward
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        # Logging to TensorBoard (if installed) by default
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = optim.Adam(self.parameters(), lr=1e-3)
        # Lightning's example as its users wrote it
        return optimizer  # noqa: RET504


def run(root):
    # init the autoencoder
    autoencoder = LitAutoEncoder(encoder, decoder)

    # setup data
    dataset = utils.data.TensorDataset(torch.rand(120, 1, 8, 8), torch.zeros(120))
    train_loader = utils.data.DataLoader(dataset)

    # train the model (hint: here are some helpful Trainer arguments for rapid idea iteration)
    trainer = L.Trainer(limit_train_batches=100, max_epochs=1, default_root_dir=root)
    trainer.fit(model=autoencoder, train_dataloaders=train_loader)

    # choose your trained nn.Module
    encoder.eval()

    # embed 4 fake images!
    fake_image_batch = torch.rand(4, 8 * 8, device=autoencoder.device)
    embeddings = encoder(fake_image_batch)
    return trainer, autoencoder, embeddings
