"""ThroughputMonitor: samples/s, tokens/s and MFU over a sliding window of training batches.

Reported through ``trainer.log_metrics`` every ``trainer.log_every_n_steps`` optimizer steps:

- ``throughput/samples_per_sec`` (sum over ranks) and ``throughput/samples_per_sec_per_device``;
  the batch size is the leading dim of the first tensor in the batch, else ``len(batch)``.
- ``throughput/tokens_per_sec`` (+ ``_per_device``) when the batch says how many tokens it holds:
  a dict key ``"num_tokens"`` (int or tensor, summed), else the numel of ``batch[tokens_key]`` or of
  ``batch["input_ids"]``.
- ``throughput/flops_per_sec_per_device`` and ``throughput/mfu`` when FLOPs are known: the user's
  ``flops_per_sample``, or, for a model that contains a transformer (``torch.nn`` transformer layers,
  ``MultiheadAttention`` or a Hugging Face ``PreTrainedModel``), the estimate ``6 * N * tokens``
  (N = parameter count; forward 2N + backward 4N per token; it ignores the attention score FLOPs,
  so it is an estimate). MFU needs a peak: ``peak_flops`` or the table below for the GPU model
  (``torch.cuda.get_device_name``) and precision; on CPU there is none unless given.

Time is ``time.perf_counter`` on the host, with validation time taken out. On CUDA the host runs
ahead of the GPU, so the monitor calls ``torch.cuda.synchronize`` at report points only: a sync per
step would stall the launch queue and cost the throughput being measured. The window's end is thus
exact; its start may lead the GPU by the launch queue's depth, an error spread over the window.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, Optional, Tuple

import torch
from torch import nn

from trainforge.callbacks.base import Callback
from trainforge.strategies.data.utils import batch_size_of
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

# Dense peak FLOP/s per GPU from NVIDIA's datasheets (no sparsity). Keys: "fp32", "tf32", "bf16", "fp8".
PEAK_FLOPS: Dict[str, Dict[str, float]] = {
    "h200": {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12},
    "h100 sxm": {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12},
    "h100 pcie": {"fp32": 51.2e12, "tf32": 378.0e12, "bf16": 756.0e12, "fp8": 1513.0e12},
    "a100": {"fp32": 19.5e12, "tf32": 156.0e12, "bf16": 312.0e12},
    "l40s": {"fp32": 91.6e12, "tf32": 183.0e12, "bf16": 362.05e12, "fp8": 733.0e12},
    "l4": {"fp32": 30.3e12, "tf32": 60.0e12, "bf16": 121.0e12, "fp8": 242.0e12},
    "v100 sxm": {"fp32": 15.7e12, "bf16": 125.0e12},  # fp16 tensor cores (no bf16 on Volta)
    "v100 pcie": {"fp32": 14.0e12, "bf16": 112.0e12},
    "rtx 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp8": 330.3e12},
    "rtx 3090": {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 71.0e12},
}


def gpu_key(device_name: str) -> Optional[str]:
    """The ``PEAK_FLOPS`` key for a ``torch.cuda.get_device_name`` string, or None."""
    name = device_name.lower()
    for chip in ("h200", "a100", "l40s", "rtx 4090", "rtx 3090"):
        if chip in name or chip.replace("rtx ", "") in name:
            return chip
    if "h100" in name:
        return "h100 pcie" if "pcie" in name else "h100 sxm"
    if "v100" in name:
        return "v100 pcie" if "pcie" in name else "v100 sxm"
    if "l4" in name.split() or name.endswith(" l4"):
        return "l4"
    return None


def peak_flops_for(device: torch.device, precision: str) -> Optional[float]:
    """Peak dense FLOP/s of one GPU at ``precision``; None on CPU or for an unknown GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    table = PEAK_FLOPS.get(gpu_key(torch.cuda.get_device_name(device)) or "")
    if table is None:
        return None
    if precision == "fp8":
        kind = "fp8" if "fp8" in table else "bf16"
    elif precision in ("16-mixed", "bf16-mixed", "bf16-true"):
        kind = "bf16"
    else:  # fp32 weights: tensor cores only when TF32 matmuls are allowed
        kind = "tf32" if torch.get_float32_matmul_precision() != "highest" and "tf32" in table else "fp32"
    return table[kind]


def is_transformer(module: nn.Module) -> bool:
    """True for models the ``6 * N * tokens`` rule fits."""
    kinds: Tuple[type, ...] = (
        nn.Transformer,
        nn.TransformerEncoderLayer,
        nn.TransformerDecoderLayer,
        nn.MultiheadAttention,
    )
    hf = sys.modules.get("transformers")  # never import transformers just to ask
    if hf is not None and hasattr(hf, "PreTrainedModel"):
        kinds = kinds + (hf.PreTrainedModel,)
    return any(isinstance(m, kinds) for m in module.modules())


def parameter_count(module: nn.Module) -> int:
    """Total parameters; global sizes for DTensor shards and DeepSpeed ZeRO-3 (``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


class ThroughputMonitor(Callback):
    """Measure training speed over the last ``window`` batches; see the module docstring."""

    def __init__(
        self,
        window: int = 20,
        flops_per_sample: Optional[float] = None,
        tokens_key: Optional[str] = None,
        peak_flops: Optional[float] = None,
    ) -> None:
        if int(window) < 1:
            raise ConfigurationError(f"ThroughputMonitor(window={window!r}) must be an integer >= 1")
        for name, value in (("flops_per_sample", flops_per_sample), ("peak_flops", peak_flops)):
            if value is not None and not value > 0:
                raise ConfigurationError(f"ThroughputMonitor({name}={value!r}) must be a positive number or None")
        self.window = int(window)
        self.flops_per_sample = flops_per_sample
        self.tokens_key = tokens_key
        self.peak_flops = peak_flops
        self.last_metrics: Dict[str, float] = {}
        self._entries: Deque[Tuple[float, float, Any, Any]] = deque(maxlen=self.window + 1)
        self._samples = 0.0
        self._tokens: Any = None  # int, or a device tensor summed lazily (no sync per step)
        self._flops: Any = None
        self._flops_per_token: Optional[float] = None
        self._peak: Optional[float] = None
        self._paused = 0.0
        self._pause_start: Optional[float] = None
        self._last_step = -1

    def _clock(self) -> float:
        return time.perf_counter() - self._paused

    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._flops_per_token = 6.0 * parameter_count(module) if is_transformer(module) else None
        device = trainer.device
        self._peak = self.peak_flops or peak_flops_for(device, trainer.precision)
        self._entries.clear()
        self._entries.append((self._clock(), self._samples, self._tokens, self._flops))

    def on_validation_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._pause_start = time.perf_counter()

    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        samples = batch_size_of(batch)
        tokens = self._count_tokens(batch)
        self._samples += samples
        if tokens is not None:
            self._tokens = tokens if self._tokens is None else self._tokens + tokens
        flops = None
        if self.flops_per_sample is not None:
            flops = self.flops_per_sample * samples
        elif self._flops_per_token is not None and tokens is not None:
            flops = self._flops_per_token * tokens
        if flops is not None:
            self._flops = flops if self._flops is None else self._flops + flops
        step = trainer.global_step
        report = step > 0 and step != self._last_step and step % max(1, int(trainer.log_every_n_steps)) == 0
        device = trainer.device
        if report and device.type == "cuda":
            torch.cuda.synchronize(device)  # only here, see the module docstring
        self._entries.append((self._clock(), self._samples, self._tokens, self._flops))
        if report:
            self._last_step = step
            self._report(trainer, device, step)

    def _count_tokens(self, batch: Any) -> Any:
        if self.tokens_key is not None:
            if not isinstance(batch, dict) or self.tokens_key not in batch:
                keys = sorted(map(str, batch)) if isinstance(batch, dict) else f"a {type(batch).__name__}, not a dict"
                raise ConfigurationError(
                    f"ThroughputMonitor(tokens_key={self.tokens_key!r}): the batch has no such "
                    f"key (batch keys: {keys}); pass one of them or tokens_key=None"
                )
            return _numel_or_count(batch[self.tokens_key], is_count=False)
        if isinstance(batch, dict):
            if "num_tokens" in batch:
                return _numel_or_count(batch["num_tokens"], is_count=True)
            if "input_ids" in batch:
                return _numel_or_count(batch["input_ids"], is_count=False)
        return None

    def _report(self, trainer: TrainerView, device: torch.device, step: int) -> None:
        t0, s0, k0, f0 = self._entries[0]
        t1, s1, k1, f1 = self._entries[-1]
        dt = t1 - t0
        ok = dt > 0 and len(self._entries) > 1
        rates = [(s1 - s0) / dt if ok else 0.0, 1.0 if ok else 0.0]
        for first, last in ((k0, k1), (f0, f1)):
            known = ok and last is not None
            delta = float(last) - (0.0 if first is None else float(first)) if known else 0.0
            rates += [delta / dt if known else 0.0, 1.0 if known else 0.0]
        # One all_reduce at every report point on every rank, even when this rank has no rate yet.
        total = trainer.strategy.all_reduce(torch.tensor(rates, dtype=torch.float64, device=device), op="sum")
        samples_s, n_ok, tokens_s, n_tok, flops_s, n_flops = (float(x) for x in total.cpu())
        world = max(1, int(trainer.world_size))
        if n_ok < world:
            return
        metrics = {"throughput/samples_per_sec": samples_s, "throughput/samples_per_sec_per_device": samples_s / world}
        if n_tok == world:
            metrics["throughput/tokens_per_sec"] = tokens_s
            metrics["throughput/tokens_per_sec_per_device"] = tokens_s / world
        if n_flops == world:
            metrics["throughput/flops_per_sec_per_device"] = flops_s / world
            if self._peak:
                metrics["throughput/mfu"] = flops_s / world / self._peak
        self.last_metrics = metrics
        trainer.log_metrics(metrics, step=step)


def _numel_or_count(value: Any, is_count: bool) -> Any:
    """A token count: the value itself (summed) for counts, the numel for token tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().sum() if is_count else value.numel()
    if is_count:
        return sum(value) if isinstance(value, (list, tuple)) else value
    return len(value) if hasattr(value, "__len__") else None
