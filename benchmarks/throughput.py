"""GPT-2 (124M) training throughput: raw loop vs Accelerator vs Trainer, eager and torch.compile.

    python benchmarks/throughput.py                      # on a GPU: GPT-2 124M, seq 1024, bf16-mixed
    python benchmarks/throughput.py --small              # a CPU smoke test: tiny config, short sequences
    python benchmarks/throughput.py --model gpt1b --seq-len 2048 --batch-size 4 --modes compile \
        --loops raw,trainer --precision bf16-mixed,fp8   # fp8 (torchao) vs bf16 on a 1.0B GPT

The model is ``transformers.GPT2LMHeadModel(GPT2Config())`` with random weights (nothing is
downloaded), trained on random token ids already in memory with fused AdamW (on CUDA). Each loop
timestamps the start of step ``warmup`` and of step ``warmup + steps`` (after a device synchronize),
so framework work between steps, including any host-device sync it forces, counts. ``compile``
compiles the model in place (``module.compile()``; ``Trainer(compile=True)`` for the Trainer).
The Trainer runs with its progress bar (to /dev/null) and tracker, without checkpointing (the
end-of-fit checkpoint of 1.5 GB would fall outside the measured window anyway).

Printed per loop and mode: median ms/step over interleaved repeats, tokens/s, MFU and the ratio
to raw in the same mode. MFU = 6 * N * tokens/s / peak, N = parameter count (embeddings included,
attention FLOPs not), peak = the dense bf16 FLOP/s of the GPU found in ``PEAK_FLOPS`` by name
(``--peak-tflops`` overrides; on CPU MFU is shown only with ``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainforge import Accelerator, Trainer, TrainingModule
from trainforge.callbacks import ProgressBar

# Dense (no sparsity) bf16 tensor-core peak FLOP/s from the vendors' datasheets; first match wins,
# so more specific names come first.
PEAK_FLOPS: Tuple[Tuple[str, float], ...] = (
    ("B200", 2250e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def peak_flops(device: torch.device, override_tflops: Optional[float]) -> Optional[float]:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS if key in name), None)


class RandomTokens(Dataset):
    """``n`` sequences of random token ids in memory; ``__getitems__`` returns a whole batch."""

    def __init__(self, n: int, seq_len: int, vocab_size: int) -> None:
        self.ids = torch.randint(0, vocab_size, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]

    def __getitems__(self, indices: List[int]) -> torch.Tensor:
        return self.ids[torch.as_tensor(indices)]


def keep_batch(batch: torch.Tensor) -> torch.Tensor:
    return batch


class StepClock:
    """Start of step ``warmup`` and of step ``warmup + steps``, each after a device synchronize."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.first, self.last, self.device = warmup, warmup + steps, device
        self.t0 = self.t1 = 0.0

    def tick(self, i: int) -> bool:
        if i in (self.first, self.last):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if i == self.first:
                self.t0 = time.perf_counter()
            else:
                self.t1 = time.perf_counter()
                return True
        return False

    @property
    def per_step(self) -> float:
        if not self.t1:
            raise RuntimeError("the loop ended before the measured window did")
        return (self.t1 - self.t0) / (self.last - self.first)


def gpt2_config(small: bool):
    from transformers import GPT2Config

    if small:  # a few seconds per step on a CPU
        return GPT2Config(
            n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=512, bos_token_id=511, eos_token_id=511
        )
    return GPT2Config()  # GPT-2 124M: 12 layers, 12 heads, 768 wide, 1024 positions, 50257 tokens


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    if args.model == "gpt1b":
        from plain_gpt import PlainGPT  # beside this script

        return PlainGPT(vocab_size=50304, n_layer=18, n_embd=2048, n_head=16, seq_len=args.seq_len)
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(gpt2_config(args.small))


def to_fp8(model: nn.Module) -> nn.Module:
    """The raw loop's fp8: torchao's float8 training with the Trainer's own layer filter."""
    from torchao.float8 import convert_to_float8_training

    from trainforge.strategies.precision import _fp8_filter

    return convert_to_float8_training(model, module_filter_fn=_fp8_filter)


AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "fp8": torch.bfloat16}


def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)


def make_loader(data: Dataset, args: argparse.Namespace, device: torch.device) -> DataLoader:
    return DataLoader(
        data,
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=keep_batch,
        num_workers=0,
        pin_memory=device.type == "cuda",
    )


# ---- the three loops -----------------------------------------------------------------------------
def run_raw(args: argparse.Namespace, data: Dataset, compile: bool, device: torch.device, precision: str) -> float:
    model = make_model(args).to(device)
    if precision == "fp8":
        model = to_fp8(model)
    if compile:
        model.compile()
    optimizer, loader = make_optimizer(model, device), make_loader(data, args, device)
    dtype = AUTOCAST.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    clock = StepClock(args.warmup, args.steps, device)
    model.train()
    for i, x in enumerate(loader):
        if clock.tick(i):
            break
        x = x.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            loss = model(input_ids=x, labels=x).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return clock.per_step


def run_accelerator(
    args: argparse.Namespace, data: Dataset, compile: bool, device: torch.device, precision: str
) -> float:
    accelerator = Accelerator(precision=precision)
    model = make_model(args)
    if compile:
        model.compile()
    optimizer = make_optimizer(model, accelerator.device)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(data, args, device))
    clock = StepClock(args.warmup, args.steps, device)
    model.train()
    for i, x in enumerate(loader):
        if clock.tick(i):
            break
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return clock.per_step


class LitGPT2(TrainingModule):
    def __init__(self, model: nn.Module, clock: StepClock) -> None:
        super().__init__()
        self.model, self.clock = model, clock

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.clock.tick(batch_idx)
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.model, self.device)


class _Terminal:
    """A stream that says it is a terminal (so the tqdm bar is really drawn) and drops the text."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def run_trainer(
    args: argparse.Namespace, data: Dataset, compile: bool, device: torch.device, precision: str, defaults: bool = False
) -> float:
    """``defaults``: every default on (tqdm bar, CSV tracker, end-of-fit checkpoint, which falls after the
    measured window); otherwise the bar and the tracker without checkpointing."""
    clock = StepClock(args.warmup, args.steps, device)
    with tempfile.TemporaryDirectory(prefix="tf-throughput-") as root:
        extra = {} if defaults else {"enable_checkpointing": False}
        trainer = Trainer(
            precision=precision,
            max_steps=args.warmup + args.steps + 1,
            compile=compile,
            default_root_dir=root,
            callbacks=[ProgressBar(stream=_Terminal())],
            **extra,
        )
        trainer.fit(LitGPT2(make_model(args), clock), make_loader(data, args, device))
    return clock.per_step


def run_trainer_defaults(
    args: argparse.Namespace, data: Dataset, compile: bool, device: torch.device, precision: str
) -> float:
    return run_trainer(args, data, compile, device, precision, defaults=True)


LOOPS: Dict[str, Callable[..., float]] = {
    "raw": run_raw,
    "accelerator": run_accelerator,
    "trainer": run_trainer,
    "trainer-defaults": run_trainer_defaults,
}


def add_peer_loops() -> None:
    """HF Accelerate and Lightning side by side, where they are installed (benchmarks/throughput_peers.py)."""
    import throughput_peers  # beside this script

    LOOPS.update(throughput_peers.loops(sys.modules[__name__]))


# ---- driver --------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = gpt2_config(args.small)
    if args.model == "gpt2" and args.seq_len > cfg.n_positions:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds the model's {cfg.n_positions} positions")
    vocab = 50304 if args.model == "gpt1b" else cfg.vocab_size
    data = RandomTokens((args.warmup + args.steps + 2) * args.batch_size, args.seq_len, vocab)
    variants = [
        (loop, mode, prec)
        for prec in args.precision
        for mode in args.modes
        for loop in args.loops
        if loop not in NO_FP8 or prec != "fp8"
    ]
    times: Dict[Tuple[str, str, str], List[float]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for loop, mode, prec in variants[r % len(variants) :] + variants[: r % len(variants)]:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            per_step = LOOPS[loop](args, data, mode == "compile", device, prec)
            times[(loop, mode, prec)].append(per_step)
            print(
                f"  repeat {r + 1}/{args.repeats} {loop:<17}{mode:<8}{prec:<11}{per_step * 1e3:10.2f} ms/step",
                flush=True,
            )
    n_params = sum(p.numel() for p in make_model(args).parameters())
    report(times, args, device, n_params)


NO_FP8 = ("accelerate", "lightning")  # the peers' rows are bf16/fp32 only here


def report(
    times: Dict[Tuple[str, str, str], List[float]], args: argparse.Namespace, device: torch.device, n_params: int
) -> None:
    peak = peak_flops(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    tokens = args.batch_size * args.seq_len
    model = {"gpt1b": "plain GPT", "gpt2": "GPT-2 (small config)" if args.small else "GPT-2 124M"}[args.model]
    print(
        f"\nthroughput benchmark on {name}: {model} "
        f"({n_params / 1e6:.1f}M parameters), batch {args.batch_size} x seq {args.seq_len} = {tokens} tokens/step, "
        f"{args.repeats} interleaved repeats x {args.steps} steps, torch {torch.__version__}"
        + (f", peak {peak / 1e12:.0f} TFLOP/s" if peak else ", MFU n/a (unknown peak: pass --peak-tflops)")
    )
    print("MFU counts the bf16 peak for every precision (fp8 above 100% of it is possible)")
    print(
        f"{'loop':<18}{'mode':<9}{'precision':<12}{'ms/step':>10}{'tokens/s':>12}{'MFU':>8}{'ratio to raw':>14}"
        f"{'vs bf16':>9}"
    )
    for (loop, mode, prec), values in times.items():
        med = statistics.median(values)
        raw = times.get(("raw", mode, prec))
        ratio = f"{med / statistics.median(raw):.4f}" if raw else "-"
        bf16 = times.get((loop, mode, "bf16-mixed")) if prec == "fp8" else None
        speedup = f"{statistics.median(bf16) / med:.3f}" if bf16 else "-"
        mfu = f"{6 * n_params * tokens / med / peak:.1%}" if peak else "n/a"
        print(f"{loop:<18}{mode:<9}{prec:<12}{med * 1e3:>10.2f}{tokens / med:>12,.0f}{mfu:>8}{ratio:>14}{speedup:>9}")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPT-2 training throughput: raw loop vs Accelerator vs Trainer")
    p.add_argument(
        "--small", action="store_true", help="tiny GPT-2 config, short sequences, few steps (a CPU smoke test)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="default 16 (--small: 4)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (--small: 64)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 30; --small: 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; --small: 2)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; --small: 1)")
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        help="comma-separated among 32, bf16-mixed, 16-mixed, fp8 (16-mixed and fp8 need a GPU; fp8 "
        "needs torchao and prints its speed-up over bf16-mixed when both are given)",
    )
    p.add_argument(
        "--model",
        default="gpt2",
        choices=("gpt2", "gpt1b"),
        help="gpt2: GPT-2 124M from transformers; gpt1b: a 1.0B GPT of plain blocks (fp8 runs)",
    )
    p.add_argument(
        "--loops",
        default="raw,accelerator,trainer,trainer-defaults,accelerate,lightning",
        help="the peers (accelerate, lightning) only where installed",
    )
    p.add_argument("--modes", default="eager,compile", help="eager, compile, or both")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU, overriding the table")
    args = p.parse_args(argv)
    add_peer_loops()
    small = args.small
    for name, big, tiny in (
        ("batch_size", 16, 4),
        ("seq_len", 1024, 64),
        ("steps", 30, 4),
        ("warmup", 10, 2),
        ("repeats", 3, 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, tiny if small else big)
    args.loops = [x.strip() for x in args.loops.split(",") if x.strip()]
    if "--loops" not in (argv if argv is not None else sys.argv):  # default: leave out peers not installed
        args.loops = [loop for loop in args.loops if loop in LOOPS]
    args.modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    args.precision = [x.strip() for x in args.precision.split(",") if x.strip()]
    for flag, given, valid in (
        ("--loops", args.loops, tuple(LOOPS)),
        ("--modes", args.modes, ("eager", "compile")),
        ("--precision", args.precision, ("32", "bf16-mixed", "16-mixed", "fp8")),
    ):
        bad = [x for x in given if x not in valid]
        if bad or not given:
            p.error(f"{flag}={','.join(given)!r}: choose from {', '.join(valid)}")
    return args


if __name__ == "__main__":
    main()
