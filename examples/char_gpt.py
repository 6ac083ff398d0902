"""Train a character-level GPT on text that ships with Python (no download), with the Trainer.

    python examples/char_gpt.py                                      # one process
    trainforge launch --nproc-per-node 2 examples/char_gpt.py        # two processes, DDP ("auto")
    python examples/char_gpt.py --resume                             # continue from runs/char_gpt
    python examples/char_gpt.py --resume auto                        # ... if there is a checkpoint there

This is the shape docs/guides/training-module.md asks of a training script: a ``TrainingModule`` with
``training_step``/``validation_step``/``configure_optimizers``, standard DataLoaders, and
``Trainer(...).fit(...)``. Metrics go to MLflow (a local SQLite store ``<root-dir>/mlflow.db``) when mlflow is
installed, checkpoints to ``<root-dir>/checkpoints``; else (``--tracker csv``) both to the CSV logger's version
folder, as Lightning lays them out: ``<root-dir>/lightning_logs/version_<N>/metrics.csv`` and ``checkpoints/``
(``--resume`` continues the newest version).
At the end the main process prints the validation loss before and after training and a sample.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

import torch
from char_gpt_model import CharGPT, CharTokenizer, GPTConfig, generate, load_corpus, split_datasets
from torch.utils.data import DataLoader

from trainforge import ConfigurationError, Trainer, TrainingModule, seed_everything
from trainforge.callbacks import Callback, ModelCheckpoint


class LitCharGPT(TrainingModule):
    """The model, its steps and its optimizer. ``val_history`` keeps ``(step, val/loss)`` pairs."""

    def __init__(
        self, cfg: GPTConfig, lr: float = 2e-3, weight_decay: float = 0.1, warmup_steps: int = 40, max_steps: int = 400
    ) -> None:
        super().__init__()
        self.save_hyperparameters("lr", "weight_decay", "warmup_steps", "max_steps", **asdict(cfg))
        self.net = CharGPT(cfg)
        self.lr, self.weight_decay, self.warmup_steps, self.max_steps = lr, weight_decay, warmup_steps, max_steps
        self.val_history: List[Tuple[int, float]] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for ``idx`` (used for sampling)."""
        logits, _ = self.net(idx)
        return logits

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.net(x, y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.net(x, y)
        self.log("val/loss", loss, sync_dist=True)  # mean over every rank's batches

    def configure_optimizers(self) -> Dict[str, Any]:
        # GPT-2 practice: weight decay on matrices (linear weights, embeddings), not on biases or
        # LayerNorm gains.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        warmup, total = max(1, self.warmup_steps), max(self.max_steps, self.warmup_steps + 1)

        def lr_factor(step: int) -> float:  # linear warmup, then cosine decay to 10 %
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_validation_end(self) -> None:
        if self.trainer.stage == "fit":
            self.val_history.append((self.trainer.global_step, float(self.trainer.callback_metrics["val/loss"])))


@torch.no_grad()
def evaluate(net: CharGPT, loader: DataLoader) -> float:
    """Mean validation loss over every sample of ``loader`` (used for the untrained model)."""
    was_training = net.training
    net.eval()
    total, count = 0.0, 0
    for x, y in loader:
        _, loss = net(x, y)
        total, count = total + float(loss) * len(x), count + len(x)
    net.train(was_training)
    return total / count


def make_tracker(choice: str) -> Callback:
    """MLflow with its default local SQLite store when mlflow imports, otherwise the CSV tracker."""
    from trainforge.callbacks import CSVLogger

    if choice == "csv":
        return CSVLogger()
    try:
        from trainforge.callbacks import MLflowLogger

        return MLflowLogger(experiment_name="char_gpt")
    except (ImportError, ConfigurationError) as err:  # mlflow missing: ConfigurationError from MLflowLogger
        if choice == "mlflow":
            raise
        print(f"char_gpt: MLflow unavailable ({err}); logging to CSV instead")
        return CSVLogger()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--max-steps", type=int, default=400, help="optimizer steps (default: about 2 min on 2 CPU processes)"
    )
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument(
        "--precision",
        default=None,
        help="32, bf16-mixed, 16-mixed (GPU), bf16-true ... (default: the launch config's, else 32)",
    )
    p.add_argument("--strategy", default=None, help="auto, single, ddp, fsdp, deepspeed (default: auto)")
    p.add_argument("--root-dir", default="runs/char_gpt", help="checkpoints and logs go here")
    p.add_argument(
        "--resume",
        nargs="?",
        const="last",
        choices=("last", "auto"),
        help="continue from the last checkpoint under --root-dir; '--resume auto': when there is one, else start "
        "fresh (a cluster job's command, the same at its first start and at every restart)",
    )
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: max_steps // 10")
    p.add_argument("--eval-every", type=int, default=None, help="validate every N steps (default: max_steps // 4)")
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every N steps (default: --eval-every)")
    p.add_argument("--log-every", type=int, default=10, help="progress line and metrics every N steps")
    p.add_argument("--tracker", choices=("auto", "mlflow", "csv"), default="auto")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--sample-chars", type=int, default=300, help="length of the generated sample (0: none)")
    p.add_argument("--prompt", default="def ")
    args = p.parse_args(argv)
    for name in ("max_steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    args.eval_every = args.eval_every or max(1, args.max_steps // 4)
    args.ckpt_every = args.ckpt_every or args.eval_every
    args.warmup_steps = args.max_steps // 10 if args.warmup_steps is None else args.warmup_steps
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    args = parse_args(argv)
    started = time.perf_counter()
    trainer = Trainer(
        strategy=args.strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=args.eval_every,
        log_every_n_steps=args.log_every,
        gradient_clip_val=1.0,
        default_root_dir=args.root_dir,
        resume="auto" if args.resume == "auto" else None,
        seed=args.seed,
        callbacks=[
            ModelCheckpoint(every_n_steps=args.ckpt_every, save_last=True, keep_last_k=2),
            make_tracker(args.tracker),
        ],
    )

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    train_set, val_set = split_datasets(tokenizer.encode(text), args.block_size)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)

    seed_everything(args.seed)  # the same initial weights on every process
    cfg = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
    module = LitCharGPT(cfg, lr=args.lr, warmup_steps=args.warmup_steps, max_steps=args.max_steps)
    initial = evaluate(module.net, val_loader) if trainer.is_global_zero and not args.resume else float("nan")

    trainer.fit(module, train_loader, val_loader, ckpt_path="last" if args.resume == "last" else None)

    result = {
        "initial_val_loss": initial,
        "uniform_loss": math.log(tokenizer.vocab_size),
        "final_val_loss": float("nan"),
        "final_step": float(trainer.global_step),
    }
    if module.val_history:
        step, loss = module.val_history[-1]
        result.update(final_val_loss=loss, final_val_step=float(step))
    # Every process generates (the same seeded text) through the module's own forward: with sharded
    # strategies (fsdp, deepspeed stage 3) a forward pass needs all processes and the outer module.
    text = sample(module, tokenizer, args.prompt, args.sample_chars, args.seed) if args.sample_chars > 0 else ""
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in module.parameters())
        print(
            f"char_gpt: {n_params / 1e6:.2f}M parameters, vocab {tokenizer.vocab_size}, "
            f"{trainer.world_size} process(es), {time.perf_counter() - started:.1f} s"
        )
        before = "not measured (resumed run)" if args.resume else f"{initial:.4f}"
        print(f"char_gpt: initial val loss {before} (uniform guess ln(vocab) = {result['uniform_loss']:.4f})")
        if module.val_history:
            print(f"char_gpt: final val loss {result['final_val_loss']:.4f} at step {int(result['final_val_step'])}")
        else:
            print(f"char_gpt: no validation ran (training was already complete at step {trainer.global_step})")
        if text:
            print("char_gpt: sample:\n" + text)
    trainer.accelerator.end_training()  # leave the process group (a no-op on one process)
    return result


def sample(module: LitCharGPT, tokenizer: CharTokenizer, prompt: str, length: int, seed: int) -> str:
    """``length`` characters after ``prompt``, top-k sampled with a seeded generator."""
    module.eval()
    generator = torch.Generator().manual_seed(seed)
    idx = tokenizer.encode(prompt).unsqueeze(0).to(module.device)
    out = generate(module, idx, length, module.net.cfg.block_size, temperature=0.8, top_k=10, generator=generator)
    return tokenizer.decode(out[0].tolist())


if __name__ == "__main__":
    main()
