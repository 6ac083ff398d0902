"""A small character-level GPT and its data, for ``examples/char_gpt.py``.

The model is a plain decoder-only transformer written with ``torch.nn`` (token + position
embeddings, pre-norm blocks of causal self-attention via ``F.scaled_dot_product_attention`` and a
GELU MLP, a final LayerNorm, and an output head tied to the token embedding), initialised as GPT-2 is.

The text ships with Python itself, so the example needs no download: the Zen of Python (``this.py``,
stored rot13-encoded) and the sources of a fixed, sorted list of standard-library modules.
"""

from __future__ import annotations

import ast
import codecs
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

# Fixed and sorted, so every process and every run builds the same corpus (and vocabulary).
CORPUS_FILES: Tuple[str, ...] = ("argparse.py", "heapq.py", "textwrap.py", "this.py")


# ---- data -----------------------------------------------------------------------------------------
def _zen_of_python(source: str) -> str:
    """``this.py`` keeps the Zen rot13-encoded in its variable ``s``; read it without importing
    ``this`` (which would print it)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "s" for t in node.targets):
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    raise ValueError("this.py has no assignment to 's'; cannot recover the Zen of Python")


def load_corpus(files: Sequence[str] = CORPUS_FILES) -> str:
    """The training text: each stdlib file (``this.py`` decoded to the Zen) in the order given."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: List[str] = []
    for name in files:
        path = stdlib / name
        if not path.is_file():
            raise FileNotFoundError(
                f"standard-library file {path} not found (this Python installation has no "
                f"{name}); pass other files from {stdlib} to load_corpus"
            )
        text = path.read_text(encoding="utf-8")
        parts.append(_zen_of_python(text) if name == "this.py" else text)
    return "\n\n".join(parts)


class CharTokenizer:
    """Characters to ids; the vocabulary is the sorted set of characters of the corpus."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters {unknown[:10]} are not in the vocabulary of {self.vocab_size} characters")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CharWindows(Dataset):
    """Map-style dataset of fixed-length windows: item ``i`` is ``(x, y)`` where ``x`` is
    ``block_size`` ids starting at ``i * stride`` and ``y`` is ``x`` shifted by one character."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int = 1) -> None:
        if data.dim() != 1 or len(data) < block_size + 1:
            raise ValueError(
                f"need a 1-d tensor of at least block_size + 1 = {block_size + 1} ids, got shape {tuple(data.shape)}"
            )
        if stride < 1:
            raise ValueError(f"stride={stride!r} must be >= 1")
        self.data, self.block_size, self.stride = data, block_size, stride

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        chunk = self.data[i * self.stride : i * self.stride + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def split_datasets(ids: torch.Tensor, block_size: int, val_fraction: float = 0.1) -> Tuple[CharWindows, CharWindows]:
    """Train on the first ``1 - val_fraction`` of the text (every offset), validate on the rest
    (non-overlapping windows), so no validation character is ever trained on."""
    cut = int(len(ids) * (1.0 - val_fraction))
    return CharWindows(ids[:cut], block_size, stride=1), CharWindows(ids[cut:], block_size, stride=block_size)


# ---- model ----------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """``forward(idx, targets=None) -> (logits, loss)``; ``loss`` is the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied input/output embedding
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` sampled ids to ``idx`` (``[B, T]``); ``temperature=0`` is greedy.

    ``model(ids)`` returns logits ``[B, T, V]`` (or a tuple that starts with them). Call it with the
    outermost module a strategy prepared, so that sharded parameters (FSDP) are gathered first."""
    for _ in range(max_new_tokens):
        out = model(idx[:, -block_size:])
        logits = (out[0] if isinstance(out, tuple) else out)[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
