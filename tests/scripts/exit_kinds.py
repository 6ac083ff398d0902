"""One short 2-process run of one kind, which must exit 0 (tests/test_clean_exit.py, scripts/exit_stress.py).

    torchrun --nproc-per-node 2 exit_kinds.py KIND ROOT

KIND: trainer-ddp, fsdp, megatron-pp, deepspeed, accelerator. Each trains a few steps and returns
without any teardown call, as users' scripts do: the process must still end with exit code 0
(strategies/clean_exit.py says why that needs care).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from fsdp_common import LitLM, loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainforge import Accelerator, Trainer

KINDS = ("trainer-ddp", "fsdp", "megatron-pp", "deepspeed", "accelerator")


def fit(strategy, root: Path, module=None) -> None:
    trainer = Trainer(
        strategy=strategy,
        max_steps=4,
        default_root_dir=str(root),
        enable_progress_bar=False,
        enable_checkpointing=False,
        seed=0,
    )
    trainer.fit(module or LitLM(), loader())


def accelerator_script() -> None:
    """Several Accelerators, sharded and shuffled loaders over uneven data, gathers, as in the issue:
    one evaluates with even_batches=False, then one trains; the last collective is a backward's."""
    data = TensorDataset(torch.randn(13, 4), torch.randn(13, 1))
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    evaluator = Accelerator(even_batches=False)
    with torch.no_grad():
        for x, _ in evaluator.prepare(DataLoader(data, batch_size=4)):
            evaluator.gather(evaluator.pad_across_processes(model(x)))
    acc = Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, dl = acc.prepare(model, opt, DataLoader(data, batch_size=3, shuffle=True))
    acc.gather(torch.ones(2))
    for x, y in dl:
        acc.gather_for_metrics(x)
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


def main(kind: str, root: Path) -> None:
    if kind == "trainer-ddp":
        fit("ddp", root)
    elif kind == "fsdp":
        fit("fsdp", root)
    elif kind == "megatron-pp":
        from megatron_pp import LitGPT

        from trainforge.strategies.megatron import MegatronStrategy

        fit(MegatronStrategy(pipeline_parallel_size=2), root, LitGPT())
    elif kind == "deepspeed":
        from trainforge.strategies.deepspeed import DeepSpeedStrategy

        fit(DeepSpeedStrategy(stage=2), root)
    elif kind == "accelerator":
        accelerator_script()
    else:
        raise SystemExit(f"kind={kind!r} is not one of: {', '.join(KINDS)}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
