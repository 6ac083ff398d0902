"""Per-rank memory of a model's parameters, gradients and optimizer state under DDP, DeepSpeed
ZeRO-1/2/3, FSDP and CPU offload, for each number of processes, and the fastest strategy that fits.

MODEL is either ``package.module:factory`` (called with no arguments inside a
``torch.device("meta")`` context, so nothing is allocated; on failure it is built on the CPU),
or a Hugging Face name built from the config classes shipped with ``transformers`` (no
download): gpt2, gpt2-medium, gpt2-large, gpt2-xl, bert-base-uncased, bert-large-uncased, or a
bare model type (llama, mistral, t5, ...) with its default config.

    trainforge estimate-memory gpt2-xl --num-processes 1 2 8 --precision bf16-mixed --device-memory 24GB

Numbers follow the ZeRO paper (see strategies/memory_estimate.py); activations are not included,
so a strategy "fits" when its model states leave 25% of the device free.

    trainforge estimate-memory llama --layouts --seq-len 4096 --num-processes 8 --device-memory 80GB

``--layouts`` tabulates MegatronStrategy's (pp, dp, tp) layouts instead, activations included
(measured on the meta device for a language model, else Megatron's formula from --layers/--hidden/
--heads; see strategies/parallel/layout.py), and names the one "auto" sizes would pick.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Dict, Tuple

import torch
from torch import nn

from trainforge.strategies.checkpoint.io import parse_size
from trainforge.strategies.errors import ConfigurationError
from trainforge.strategies.memory_estimate import (
    OPTIMIZER_STATES,
    MemoryRow,
    count_parameters,
    estimate_memory,
    format_bytes,
    format_table,
    recommend,
)
from trainforge.strategies.precision import normalize_precision

HELP = "estimate per-rank memory of a model under DDP / ZeRO / FSDP and recommend a strategy"
# name -> (model_type, config overrides, head); sizes from the model cards of the published checkpoints.
KNOWN_MODELS: Dict[str, Tuple[str, Dict[str, Any], str]] = {
    "gpt2": ("gpt2", {}, "causal-lm"),
    "gpt2-medium": ("gpt2", {"n_layer": 24, "n_embd": 1024, "n_head": 16}, "causal-lm"),
    "gpt2-large": ("gpt2", {"n_layer": 36, "n_embd": 1280, "n_head": 20}, "causal-lm"),
    "gpt2-xl": ("gpt2", {"n_layer": 48, "n_embd": 1600, "n_head": 25}, "causal-lm"),
    "bert-base-uncased": ("bert", {}, "base"),
    "bert-large-uncased": (
        "bert",
        {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
        "base",
    ),
}
_CLASS_NAMES = {"ddp": "DDPStrategy", "deepspeed": "DeepSpeedStrategy", "fsdp": "FSDPStrategy"}


def build_model(spec: str) -> nn.Module:
    """The model MODEL names, on the meta device where possible."""
    if ":" in spec:
        return _from_factory(spec)
    return _from_transformers(spec)


def _from_factory(spec: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigurationError(
            f"MODEL={spec!r}: cannot import {attr!r} from {module_name!r} ({e}); give "
            "'package.module:factory' importable from the current directory"
        ) from None
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:  # a factory doing data-dependent work: build it for real
        print(
            f"note: {spec} could not be built on the meta device ({type(e).__name__}); building it on the CPU",
            file=sys.stderr,
        )
        model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"MODEL={spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _from_transformers(name: str) -> nn.Module:
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise ConfigurationError(
            f"MODEL={name!r} is a Hugging Face name, which needs transformers "
            "(pip install transformers); or give 'package.module:factory'"
        ) from None
    model_type, overrides, head = KNOWN_MODELS.get(name, (name, {}, ""))
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except ValueError:
        raise ConfigurationError(
            f"MODEL={name!r} is not one of: {', '.join(KNOWN_MODELS)}, nor a transformers "
            "model type (llama, mistral, t5, ...), nor 'package.module:factory'"
        ) from None
    if not head:
        head = "causal-lm" if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else "base"
    auto = transformers.AutoModelForCausalLM if head == "causal-lm" else transformers.AutoModel
    with torch.device("meta"):
        return auto.from_config(config)


def describe(row: MemoryRow, world_size: int) -> str:
    if world_size == 1 and row.strategy == "ddp":
        return "one process: strategy='single' (nothing to shard)"
    args = ", ".join(f"{k}={v!r}" for k, v in row.options.items())
    return f"{row.name}: strategy={row.strategy!r}, i.e. {_CLASS_NAMES[row.strategy]}({args})"


def default_memory() -> Tuple[int, str]:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"GPU 0 ({props.name})"
    import psutil

    return int(psutil.virtual_memory().total), "host RAM (no GPU here; pass --device-memory to plan for one)"


def positive_int(text: str) -> int:
    """argparse's type for counts and sizes: a bad one is argparse's usage error (exit 2) naming the flag,
    not a traceback from deep inside the estimate."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="package.module:factory, or a Hugging Face name / model type")
    parser.add_argument(
        "--num-processes",
        type=positive_int,
        nargs="+",
        default=[1, 2, 4, 8],
        metavar="N",
        help="data-parallel process counts to tabulate (default: 1 2 4 8)",
    )
    parser.add_argument(
        "--precision", default="bf16-mixed", help="32, 16-mixed, bf16-mixed, bf16-true (default: bf16-mixed)"
    )
    parser.add_argument("--optimizer", default="adam", help=f"one of: {', '.join(OPTIMIZER_STATES)} (default: adam)")
    parser.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="memory of one accelerator, e.g. 80GB or 80GiB (default: GPU 0, else host RAM)",
    )
    parser.add_argument(
        "--cpu-memory",
        default=None,
        metavar="SIZE",
        help="host memory per node for offload (default: this machine's RAM)",
    )
    parser.add_argument(
        "--processes-per-node",
        type=positive_int,
        default=None,
        metavar="N",
        help="processes sharing one host's memory (default: all of them, up to 8)",
    )
    lay = parser.add_argument_group("model-parallel layouts (MegatronStrategy), activations included")
    lay.add_argument("--layouts", action="store_true", help="tabulate every (pp, dp, tp) layout instead")
    lay.add_argument(
        "--seq-len", type=positive_int, default=None, metavar="S", help="tokens per sequence (needed with --layouts)"
    )
    lay.add_argument("--micro-batch-size", type=positive_int, default=1, metavar="B", help="sequences per micro-batch")
    lay.add_argument(
        "--num-microbatches", type=positive_int, default=None, metavar="M", help="micro-batches per step (GPipe)"
    )
    lay.add_argument("--schedule", default="1f1b", help="pipeline schedule (1f1b, gpipe, ...)")
    lay.add_argument("--sequence-parallel", action="store_true")
    lay.add_argument("--activation-checkpointing", action="store_true")
    lay.add_argument("--eager-attention", action="store_true", help="attention scores stored (not SDPA/flash)")
    lay.add_argument(
        "--layers", type=positive_int, default=None, help="transformer layers (a model without a HF config)"
    )
    lay.add_argument("--hidden", type=positive_int, default=None, help="hidden size (a model without a HF config)")
    lay.add_argument("--heads", type=positive_int, default=None, help="attention heads (a model without a HF config)")


def run(args: argparse.Namespace) -> int:
    precision = normalize_precision(args.precision)
    bad = [n for n in args.num_processes if n < 1]
    if bad:
        raise ConfigurationError(f"--num-processes {bad[0]} must be >= 1")
    if args.optimizer not in OPTIMIZER_STATES:
        raise ConfigurationError(f"--optimizer {args.optimizer!r} is not one of: {', '.join(OPTIMIZER_STATES)}")
    device_memory, source = (
        (parse_size(args.device_memory, "--device-memory"), "--device-memory")
        if args.device_memory
        else default_memory()
    )
    if args.cpu_memory:
        cpu_memory = parse_size(args.cpu_memory, "--cpu-memory")
    else:
        import psutil

        cpu_memory = int(psutil.virtual_memory().total)
    model = build_model(args.model)
    param_count = count_parameters(model)
    if args.layouts:
        return _run_layouts(args, model, param_count, precision, device_memory, source)
    print(
        f"{args.model}: {param_count:,} parameters; precision {precision}, optimizer {args.optimizer}; "
        f"device memory {format_bytes(device_memory)} ({source}), host memory {format_bytes(cpu_memory)}; "
        "bytes per rank, model states only (activations need the 25% kept free)"
    )
    for n in args.num_processes:
        per_node = args.processes_per_node or min(n, 8)
        rows = estimate_memory(param_count, n, precision, args.optimizer)
        chosen = recommend(rows, device_memory, cpu_memory, per_node)
        print(f"\n== {n} process{'es' if n > 1 else ''} ==")
        print(format_table(rows, device_memory, cpu_memory, per_node, chosen=chosen))
        print(
            "recommendation: "
            + (
                describe(chosen, n)
                if chosen is not None
                else "nothing fits; use more processes, a lower precision, or a smaller model"
            )
        )
    return 0


def _run_layouts(
    args: argparse.Namespace, model: nn.Module, param_count: int, precision: str, device_memory: int, source: str
) -> int:
    from trainforge.strategies.parallel.layout import (
        ModelShape,
        choose_layout,
        estimate_layouts,
        format_layouts,
        measure_activation_bytes,
    )

    if args.seq_len is None:
        raise ConfigurationError("--layouts needs --seq-len S (tokens per sequence): activations grow with it")
    given, measured = (args.layers, args.hidden, args.heads), None
    if all(v is not None for v in given):
        shape = ModelShape(param_count, *given)  # the formula (a model that is not a language model)
    elif any(v is not None for v in given):
        raise ConfigurationError(
            "--layers, --hidden and --heads go together (give all three, or none for a "
            "transformers model, whose config has them)"
        )
    else:
        shape = ModelShape.of(model, param_count)
        measured = measure_activation_bytes(model, args.seq_len, args.micro_batch_size, precision, args.eager_attention)
    print(
        f"{args.model}: {param_count:,} parameters, {shape.layers} layers, hidden {shape.hidden}, {shape.heads} "
        f"heads; precision {precision}, optimizer {args.optimizer}; micro-batch {args.micro_batch_size} x "
        f"{args.seq_len} tokens, schedule {args.schedule}; device memory {format_bytes(device_memory)} ({source}); "
        + (
            f"activations of one micro-batch measured on the meta device: {format_bytes(measured)}"
            if measured
            else "activations from Megatron's formula"
        )
    )
    for n in args.num_processes:
        rows = estimate_layouts(
            shape,
            n,
            seq_len=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            num_microbatches=args.num_microbatches,
            precision=precision,
            optimizer=args.optimizer,
            ranks_per_node=args.processes_per_node,
            schedule=args.schedule,
            sequence_parallel=args.sequence_parallel,
            activation_checkpointing=args.activation_checkpointing,
            eager_attention=args.eager_attention,
            measured_activations=measured,
        )
        try:
            chosen: Any = choose_layout(rows, device_memory)
        except ConfigurationError:
            chosen = None
        print(f"\n== {n} process{'es' if n > 1 else ''} ==")
        print(format_layouts(rows, device_memory, chosen))
        print(
            "choice: "
            + (
                f"MegatronStrategy(tensor_parallel_size={chosen.tp}, pipeline_parallel_size={chosen.pp})"
                if chosen is not None
                else "nothing fits; use more processes, activation "
                "checkpointing, a shorter sequence or a smaller micro-batch"
            )
        )
    return 0
