"""A tiny transformers Llama (tied embeddings) fine-tuned from pretrained weights, built either whole and
loaded with load_state_dict ("eager", what users do today) or on the meta device with
trainer.init_module(empty_init=True) + trainforge.load_pretrained ("empty"). Writes
<out>/<strategy>-<mode>.rank<r>.json: the losses, the final weights' checksum, the peak RSS growth."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Trainer, TrainingModule, load_pretrained
from trainforge.strategies import DeepSpeedStrategy, MegatronStrategy

CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


class FineTune(TrainingModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out: Path, pretrained: Path, strategy: str, mode: str) -> None:
    import transformers  # here, not at the top: test_empty_init.py imports CONFIG at collection

    config = transformers.LlamaConfig(**CONFIG)
    trainer = Trainer(
        strategy={"tp": MegatronStrategy(tensor_parallel_size=2), "deepspeed": DeepSpeedStrategy(stage=2)}.get(
            strategy, strategy
        ),
        max_steps=4,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(out / "run"),
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "eager":
        model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(load_file(pretrained / "model.safetensors"), strict=False)
        model.tie_weights()
    else:
        with trainer.init_module(empty_init=True):
            model = transformers.LlamaForCausalLM(config)
        assert all(p.is_meta for p in model.parameters())
        load_pretrained(model, pretrained)
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(1))
    module = FineTune(model)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    state = trainer.strategy.module_state_dict(trainer.model)
    rank = trainer.global_rank
    record = {
        "losses": module.losses,
        "checksum": sum(float(v.double().abs().sum()) for v in state.values()) if state else None,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "rss_growth_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base,
    }
    (out / f"{strategy}-{mode}.rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4])
