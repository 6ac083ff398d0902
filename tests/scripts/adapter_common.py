"""A tiny Llama (transformers) with a LoRA adapter (peft), its data and a TrainingModule, shared by
tests/trainer/test_adapter_checkpoints.py and tests/scripts/adapter_run.py. About 107K parameters,
1.8K of them trainable; fp32 on CPU, so resumed runs are bit-identical.

peft and transformers are imported where a model is built: the test module imports this one at
collection, which would otherwise import both (seconds) in every pytest worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import TrainingModule

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import LlamaForCausalLM

VOCAB, SEQ, SAMPLES = 256, 16, 64


def tiny_base(seed: int = 0, intermediate_size: int = 128) -> LlamaForCausalLM:
    """The "pretrained" base: the same weights for the same seed, in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def lora_config() -> LoraConfig:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)


def lora_model(seed: int = 0, **base_kwargs: Any) -> nn.Module:
    from peft import get_peft_model

    model = get_peft_model(tiny_base(seed, **base_kwargs), lora_config())
    torch.manual_seed(100)  # LoRA's B starts at zero: give it weights, so outputs depend on both matrices
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def tokens(n: int = SAMPLES) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1234))


def loader(batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(tokens()), batch_size=batch_size, shuffle=True)


def lm_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    (x,) = batch
    return net(input_ids=x, labels=x).loss


class LitLora(TrainingModule):
    """``net``: the PEFT model (or any causal LM); AdamW over every parameter, as users write it (the
    frozen ones get no gradient, so no optimizer state)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.losses: List[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
