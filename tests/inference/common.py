"""Small models for the inference tests, built from configs (nothing downloaded)."""

from __future__ import annotations

import torch
from torch import nn


def plain(width: int = 32, depth: int = 6) -> nn.Module:
    """Linear blocks (with a BatchNorm so buffers are covered) and a head."""
    blocks = [nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 4)).eval()


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=1, pad_token_id=0
    )


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )


def quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def greedy(model, ids: torch.Tensor, n: int = 8) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


def storages(*tensors: torch.Tensor) -> int:
    return len({t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size() for t in tensors})
