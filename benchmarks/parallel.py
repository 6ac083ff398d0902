"""Per-rank training-state bytes and step time of MegatronStrategy layouts on one model.

    python benchmarks/parallel.py                 # re-launches itself on 4 CPU processes (gloo)
    python benchmarks/parallel.py --steps 3 --dim 64 --processes 2

Layouts on 4 processes: dp4 (FSDP2 only), tp2 x dp2, tp4, pp2 x dp2, tp2 x pp2 (those that divide
the number of processes). Each row: the bytes each rank holds for parameters + AdamW state
(measured from the local shards, ``strategies.fsdp.local_state_bytes``) next to the formula
``12 B x (P_tp / (tp x dp) + P_rest / dp)`` for the rank's own stage (fp32 weights 4 B + two AdamW
moments 8 B; P_tp = the stage's parameters the tp plan shards, P_rest = the others; the largest
stage is printed), and the median step time. Pipeline layouts run the Trainer's path
(``strategy.forward_backward``: 1F1B over ``--microbatches`` micro-batches). On a GPU each row also
prints tokens/s. Nothing is asserted: CPU timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

LAYOUTS = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))  # (tp, pp) of each layout; dp takes the rest of the processes


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_rep"}


class LitGPT(nn.Module):
    """The pipeline contract: the model in an attribute, ``loss_fn(output, target)`` on the root."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.net = model

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())


def run_layout(tp: int, pp: int, args: argparse.Namespace) -> None:
    from trainforge.strategies.fsdp import local_state_bytes
    from trainforge.strategies.megatron import MegatronStrategy

    extra = {"pipeline_parallel_size": pp, "num_microbatches": args.microbatches} if pp > 1 else {}
    plan = {f"net.{k}": v for k, v in PLAN.items()} if pp > 1 else PLAN
    strategy = MegatronStrategy(tensor_parallel_size=tp, tp_plan=plan, **extra)
    strategy.setup_environment()
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.depth)
    if pp > 1:
        lit = LitGPT(model)  # pruned in place to this rank's stages: the builder sees only those
        model, opts = strategy.setup(lit, lambda: [torch.optim.AdamW(lit.parameters(), lr=1e-3)])
        opt = opts[0]
    else:
        model = strategy.setup_module(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total = sum(p.numel() for p in model.parameters())  # this rank's stage(s), global sizes (DTensor.numel)
    p_tp = strategy.tp_coverage.get("sharded_numel", 0)
    dp = strategy.dims.dp
    name = " x ".join(
        f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v > 1 or k == "dp" and tp == pp == 1
    )
    g = torch.Generator().manual_seed(strategy.data_parallel_rank)
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(strategy.root_device)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        if pp > 1:  # the Trainer's path: the schedule runs forward, loss and backward of every micro-batch
            strategy.forward_backward(model, None, (x[:, :-1], x[:, 1:]), step)
        else:
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        if strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    held = local_state_bytes(model, [opt])
    row = (held["params"] + held["optimizer"], statistics.median(times), 12 * (p_tp / (tp * dp) + (total - p_tp) / dp))
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        formula = max(f for _, _, f in rows)
        per_rank = " ".join(f"{b / 2**20:.3f}" for b, _, _ in rows)
        ms = statistics.median(t for _, t, _ in rows) * 1e3
        tokens = args.batch * args.seq * dp / (ms / 1e3)
        extra = f"  {tokens:10.0f} tok/s" if strategy.root_device.type == "cuda" else ""
        print(
            f"{name:10s} per-rank MiB [{per_rank}]  formula {formula / 2**20:.3f} MiB  step {ms:8.2f} ms{extra}",
            flush=True,
        )
    dist.barrier()
    strategy.pipeline = None  # the next layout builds its own mesh and schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="per dp rank")
    parser.add_argument("--microbatches", type=int, default=2, help="pipeline layouts: micro-batches per batch")
    args, _ = parser.parse_known_args()
    if "RANK" not in os.environ:  # re-launch on --processes processes
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")) if p
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.processes}",
            __file__,
            *sys.argv[1:],
        ]
        sys.exit(subprocess.call(cmd, env=env))
    if int(os.environ["RANK"]) == 0:
        print(
            f"model: GPT dim={args.dim} depth={args.depth} vocab={args.vocab}; batch {args.batch}/dp rank x "
            f"seq {args.seq}; {os.environ['WORLD_SIZE']} processes; bytes = params + AdamW state",
            flush=True,
        )
    world = int(os.environ["WORLD_SIZE"])
    for tp, pp in LAYOUTS:
        if world % (tp * pp) == 0 and (pp == 1 or args.depth >= pp):
            run_layout(tp, pp, args)


if __name__ == "__main__":
    main()
