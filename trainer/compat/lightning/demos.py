"""The demo language model programs import from ``lightning.pytorch.demos``: ``Transformer``, ``WikiText2`` and
``LightningTransformer``, written for trainforge with the same constructor arguments, module order (so one
seed gives the same initial weights), tokenization and batches as Lightning 2.6's.

``WikiText2(data_dir, block_size=35, download=True)`` reads ``<data_dir>/wikitext-2.txt``; ``download=True``
fetches PyTorch's example copy of WikiText-2's training text once when the file is absent (any local text
works: tests write a small one and pass ``download=False``).
"""

from __future__ import annotations

import math
import os
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.module.training_module import TrainingModule

WIKITEXT2_URL = "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/train.txt"
EOS = "<eos>"


def causal_mask(size: int) -> Tensor:
    """``-inf`` above the diagonal, 0 elsewhere: position i sees positions <= i."""
    return torch.full((size, size), float("-inf")).triu(diagonal=1)


class PositionalEncoding(nn.Module):
    """Adds a sinusoidal position code, then dropout. As in Lightning's demo (and PyTorch's word language
    model it adapts), every position gets the code of position ``x.size(1)``, the sequence length."""

    def __init__(self, dim: int, dropout: float = 0.1, max_len: int = 5000) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.dim, self.max_len = dim, max_len
        self.pe: Optional[Tensor] = None  # built at the first forward, on the input's device (not a buffer)

    def forward(self, x: Tensor) -> Tensor:
        if self.pe is None:
            self.pe = self._table(x.device)
        return self.dropout(x + self.pe[:, x.size(1)])

    def _table(self, device: torch.device) -> Tensor:
        position = torch.arange(0, self.max_len, dtype=torch.float, device=device).unsqueeze(1)
        rate = torch.exp(torch.arange(0, self.dim, 2, device=device).float() * (-math.log(10000.0) / self.dim))
        table = torch.zeros(self.max_len, self.dim, device=device)
        table[:, 0::2] = torch.sin(position * rate)
        table[:, 1::2] = torch.cos(position * rate)
        return table.unsqueeze(0)


class Transformer(nn.Module):
    """An encoder-decoder ``nn.Transformer`` language model returning log-probabilities, one row per token
    (``(batch * length, vocab_size)``)."""

    def __init__(
        self,
        vocab_size: int = 33278,
        ninp: int = 200,
        nhead: int = 2,
        nhid: int = 200,
        nlayers: int = 2,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        # created in this order, so that a seed draws the same initial weights as Lightning's demo
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.transformer = nn.Transformer(
            d_model=ninp,
            nhead=nhead,
            num_encoder_layers=nlayers,
            num_decoder_layers=nlayers,
            dim_feedforward=nhid,
            dropout=dropout,
            batch_first=True,
        )
        self.decoder = nn.Linear(ninp, vocab_size)
        self.ninp, self.vocab_size = ninp, vocab_size
        self.src_mask: Optional[Tensor] = None

    def generate_square_subsequent_mask(self, size: int) -> Tensor:
        return causal_mask(size)

    def forward(self, inputs: Tensor, target: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        length = inputs.shape[1]
        if self.src_mask is None or self.src_mask.size(0) != length:
            self.src_mask = causal_mask(length).to(inputs.device)  # kept, as the demo keeps it (unused)
        if mask is None:
            mask = causal_mask(length).to(inputs.device)
        scale = math.sqrt(self.ninp)
        src = self.pos_encoder(self.embedding(inputs) * scale)
        tgt = self.pos_encoder(self.embedding(target) * scale)
        out = self.decoder(self.transformer(src, tgt, tgt_mask=mask))
        return F.log_softmax(out, dim=-1).view(-1, self.vocab_size)


class Dictionary:
    """Words to ids in the order they are first seen."""

    def __init__(self) -> None:
        self.word2idx: Dict[str, int] = {}
        self.idx2word: List[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


def tokenize(path: Path) -> Tuple[Tensor, Dictionary]:
    """Every line's whitespace-separated words plus ``<eos>``, as one int64 tensor of ids."""
    if not os.path.exists(path):
        raise ConfigurationError(f"WikiText2: {path} does not exist; pass download=True or write a text file there")
    dictionary, ids = Dictionary(), []  # type: Dictionary, List[int]
    with open(path, encoding="utf8") as f:
        for line in f:
            ids.extend(dictionary.add_word(word) for word in [*line.split(), EOS])
    return torch.tensor(ids, dtype=torch.int64), dictionary


class WikiText2(Dataset):
    """Blocks of ``block_size`` token ids and the same block shifted by one (the targets)."""

    def __init__(self, data_dir: Path = Path("./data"), block_size: int = 35, download: bool = True) -> None:
        super().__init__()
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigurationError(f"WikiText2(block_size={block_size!r}) must be an int >= 1 (tokens per sample)")
        self.path = Path(data_dir) / "wikitext-2.txt"
        if download:
            self.download(self.path)
        self.data, self.dictionary = tokenize(self.path)
        self.block_size = block_size

    @property
    def vocab_size(self) -> int:
        return len(self.dictionary)

    def __len__(self) -> int:
        return len(self.data) // self.block_size - 1

    def __getitem__(self, index: int) -> Tuple[Tensor, Tensor]:
        start = index * self.block_size
        return self.data[start : start + self.block_size], self.data[start + 1 : start + self.block_size + 1]

    @staticmethod
    def download(destination: Path) -> None:
        """Fetches the text once (nothing when ``destination`` exists)."""
        if os.path.exists(destination):
            return
        os.makedirs(Path(destination).parent, exist_ok=True)
        with urllib.request.urlopen(WIKITEXT2_URL, timeout=60) as response:
            text = response.read().decode("utf8")
        with open(destination, "w", encoding="utf8") as f:
            f.write(text)


class LightningTransformer(TrainingModule):
    """``Transformer`` trained with SGD (lr 0.1) on ``WikiText2`` blocks, one per batch; the loss is not logged."""

    def __init__(self, vocab_size: int = 33278) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size)

    def forward(self, inputs: Tensor, target: Tensor) -> Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        return F.nll_loss(self(inputs, target), target.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def prepare_data(self) -> None:
        WikiText2(download=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(WikiText2())
