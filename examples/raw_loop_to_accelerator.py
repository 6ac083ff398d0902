"""A plain PyTorch training loop converted to the Accelerator: the changed lines say what they were.

    python examples/raw_loop_to_accelerator.py                                  # one process
    trainforge launch --nproc-per-node 2 examples/raw_loop_to_accelerator.py    # two, DDP
    python examples/raw_loop_to_accelerator.py --precision bf16-mixed --grad-accum 4

The model and data are the character-level GPT of ``char_gpt_model.py``. Everything marked
``# CHANGED`` or ``# ADDED`` is the conversion (about five lines); the rest is the user's own loop,
untouched. What the Accelerator then does: picks the device, wraps the model for DDP when launched
on several processes, shards the data per process, runs autocast/grad scaling for ``--precision``,
skips gradient sync inside accumulation windows, and saves a resumable state directory.
"""

from __future__ import annotations

import argparse
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from char_gpt_model import CharGPT, CharTokenizer, GPTConfig, load_corpus, split_datasets
from torch.utils.data import DataLoader

from trainforge import Accelerator, seed_everything  # ADDED


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--precision", default=None, help="32, bf16-mixed, 16-mixed (GPU)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--save-dir", default=None, help="write Accelerator.save_state here at the end")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> float:
    args = parse_args(argv)
    seed_everything(args.seed)
    # device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    accelerator = Accelerator(precision=args.precision, gradient_accumulation_steps=args.grad_accum)  # CHANGED

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    train_set, val_set = split_datasets(tokenizer.encode(text), block_size=64)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)
    model = CharGPT(GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd))
    # model.to(device)                                                       # REMOVED: prepare() places it
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(  # ADDED
        model, optimizer, train_loader, val_loader, scheduler
    )

    def evaluate() -> float:
        model.eval()
        losses = []
        with torch.no_grad():
            for x, y in val_loader:
                # x, y = x.to(device), y.to(device)                          # REMOVED: batches arrive placed
                with accelerator.autocast():  # ADDED (a no-op in fp32)
                    logits, _ = model(x)
                per_sample = F.cross_entropy(logits.transpose(1, 2).float(), y, reduction="none").mean(dim=1)
                losses.append(accelerator.gather_for_metrics(per_sample))  # ADDED: every rank's samples, once
        model.train()
        return float(torch.cat(losses).mean())

    initial = evaluate()
    step, epoch = 0, 0
    while step < args.steps:
        for x, y in train_loader:  # set_epoch(epoch) for the sampler is done by the prepared loader
            # x, y = x.to(device), y.to(device)                              # REMOVED
            with accelerator.accumulate(model):  # ADDED: no gradient sync until the window's last batch
                with accelerator.autocast():  # ADDED
                    _, loss = model(x, y)
                # loss.backward()
                accelerator.backward(loss)  # CHANGED: scaled for accumulation and fp16
                optimizer.step()  # steps only at the end of each accumulation window
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 50 == 0:
                    accelerator.print(f"step {step} loss {loss.item():.4f}")  # CHANGED from print: rank 0 only
                if step >= args.steps:
                    break
        epoch += 1

    final = evaluate()
    accelerator.print(
        f"raw_loop_to_accelerator: {accelerator.num_processes} process(es), val loss "
        f"{initial:.4f} -> {final:.4f} after {step} steps "
        f"(uniform guess {math.log(tokenizer.vocab_size):.4f})"
    )
    if args.save_dir:
        accelerator.save_state(args.save_dir)  # ADDED: model, optimizer, scheduler, RNG, data position
        accelerator.print(f"raw_loop_to_accelerator: state saved to {args.save_dir}")
    accelerator.end_training()
    return final


if __name__ == "__main__":
    main()
