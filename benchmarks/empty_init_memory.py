"""Peak host memory per rank while preparing a pretrained transformers Llama on 2 processes under FSDP2 and
under tensor parallelism (MegatronStrategy, TP=2):
the path users have today (build the model whole, ``load_state_dict`` the file, then shard) vs built on
the meta device (``init_module(empty_init=True)``) with ``trainforge.load_pretrained`` (each rank reads
and allocates only its shards).

    python benchmarks/empty_init_memory.py                 # ~1.1 GB fp32 model (hidden 1024, 16 layers)
    python benchmarks/empty_init_memory.py --layers 2      # quick

The parent writes the pretrained weights once (safetensors, in a temporary directory), then runs each
path in fresh processes (torch.distributed.run, gloo). Each rank reports its peak anonymous memory
(RssAnon, sampled) and peak resident memory (``ru_maxrss``, which also counts the mapped file pages it
read) above what it held after its imports; the table prints it against the model's bytes
divided by the number of processes. Goal (issue 22): empty init <= 1.3 x model bytes / world size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def rank_main(args: argparse.Namespace) -> None:
    import transformers
    from inference import Peak, anon  # benchmarks/inference.py: RssAnon sampled every 0.5 ms
    from safetensors.torch import load_file

    from trainforge import Accelerator, load_pretrained
    from trainforge.strategies import FSDPStrategy, MegatronStrategy

    config = transformers.LlamaConfig(**json.loads(args.config))
    strategy = MegatronStrategy(tensor_parallel_size=args.nproc) if args.strategy == "tp" else FSDPStrategy()
    acc = Accelerator(strategy=strategy)
    base, base_anon = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, anon()
    sampler = Peak()
    sampler.start()
    if args.mode == "eager":
        model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(load_file(os.path.join(args.weights, "model.safetensors")), strict=False)
    else:
        with acc.init_module(empty_init=True):
            model = transformers.LlamaForCausalLM(config)
        load_pretrained(model, args.weights)
    model = acc.prepare(model)
    sampler.stop = True
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # TP leaves norms whole
    held = sum(t.numel() * t.element_size() for t in local)
    out = {"peak_rss": peak * 1024, "peak_anon": sampler.peak - base_anon, "shard_bytes": held}
    Path(args.out, f"{args.strategy}-{args.mode}.rank{acc.process_index}.json").write_text(json.dumps(out))
    acc.end_training()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", default="fsdp,tp", help="fsdp (FSDP2), tp (MegatronStrategy, TP = nproc)")
    p.add_argument("--strategy", default="fsdp", help=argparse.SUPPRESS)
    p.add_argument("--rank-mode", dest="mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--weights", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode is not None:
        rank_main(args)
        return
    import torch
    import transformers

    config = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 256, args.nproc),  # TP splits whole heads
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory(prefix="empty-init-") as tmp:
        weights, out = Path(tmp, "weights"), Path(tmp, "out")
        out.mkdir()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        model.save_pretrained(weights, max_shard_size="100GB")
        del model
        env = dict(os.environ, OMP_NUM_THREADS="1")
        runs = [(s, m) for s in args.strategies.split(",") for m in ("eager", "empty")]
        for strategy, mode in runs:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
            cmd += [__file__, "--rank-mode", mode, "--strategy", strategy, "--config", json.dumps(config)]
            subprocess.run(cmd + ["--weights", str(weights), "--out", str(out)], check=True, env=env)
        per_rank = model_bytes / args.nproc
        print(f"Llama {model_bytes / 2**30:.2f} GiB fp32 on {args.nproc} processes (gloo, CPU)")
        print("peak above the rank's baseline: RssAnon (process memory) and max RSS (also the pages of the")
        print("memory-mapped weight files it read, which the kernel can drop); ratios to model bytes / world size")
        print(
            f"{'path':<11} {'rank':>4} {'RssAnon GiB':>12} {'ratio':>6} {'max RSS GiB':>12} {'ratio':>6} {'shard':>6}"
        )
        for strategy, mode in runs:
            for rank in range(args.nproc):
                r = json.loads(Path(out, f"{strategy}-{mode}.rank{rank}.json").read_text())
                print(
                    f"{strategy + ' ' + mode:<11} {rank:>4} {r['peak_anon'] / 2**30:>12.2f} "
                    f"{r['peak_anon'] / per_rank:>6.2f} {r['peak_rss'] / 2**30:>12.2f} {r['peak_rss'] / per_rank:>6.2f} "
                    f"{r['shard_bytes'] / 2**30:>6.2f}"
                )


if __name__ == "__main__":
    main()
