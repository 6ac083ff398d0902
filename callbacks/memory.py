"""MemoryMonitor: host and CUDA memory per rank, GPU health through NVML, leak warnings, snapshots.

Every ``every_n_steps`` optimizer steps each rank measures its host RSS (psutil) and, on CUDA, the
allocated / reserved / peak-allocated memory of its device; the values of all ranks are gathered
(``trainer.strategy.all_gather``) and their max and mean go to the trackers through
``trainer.log_metrics`` as ``memory/<name>_max`` and ``memory/<name>_mean`` (MB). With a GPU and
``pynvml`` (package nvidia-ml-py) it also reports ``gpu/utilization_pct``, ``gpu/temperature_c`` and
``gpu/power_w``; without either they are skipped silently.

Memory snapshots (``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot`` plus an HTML view
from ``torch.cuda._memory_viz``) are CUDA-only: on a CPU run they are skipped (one warning when
``record_history=True`` was asked for).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

import psutil
import torch

from trainforge.callbacks.base import Callback
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

log = logging.getLogger("trainforge")

_MB = 1024.0 * 1024.0
#: Order of the per-rank vector that is gathered; NaN where a value does not exist on that rank.
_FIELDS = (
    "host_rss_mb",
    "cuda_allocated_mb",
    "cuda_reserved_mb",
    "cuda_peak_allocated_mb",
    "utilization_pct",
    "temperature_c",
    "power_w",
)
_NVML_FIELDS = ("utilization_pct", "temperature_c", "power_w")
#: Quantities watched for leaks, and the peak columns of the summary.
_LEAK_FIELDS = ("host_rss_mb", "cuda_allocated_mb")
_PEAK_FIELDS = ("host_rss_mb", "cuda_peak_allocated_mb")


class MemoryLeakWarning(UserWarning):
    """Memory grew over ``leak_intervals`` consecutive measurement intervals."""


class MemoryMonitor(Callback):
    """Measure memory every ``every_n_steps`` optimizer steps on every rank.

    Leak rule: on one rank, a watched quantity (host RSS, CUDA allocated) rose in each of the last
    ``leak_intervals`` intervals and by more than ``leak_min_growth_mb`` in total; the warning
    (``MemoryLeakWarning``, on global zero) names the rank, the growth and the steps, and the window
    restarts. The CUDA peak is reset after each measurement, so ``cuda_peak_allocated_mb`` is the
    peak of the interval and the summary can say at which step the run peaked.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        leak_intervals: int = 5,
        leak_min_growth_mb: float = 64.0,
        snapshot_on_oom: bool = True,
        snapshot_dir: Optional[str] = None,
        record_history: bool = False,
        history_max_entries: int = 100_000,
    ) -> None:
        if int(every_n_steps) < 1 or int(leak_intervals) < 1:
            raise ConfigurationError(
                f"MemoryMonitor(every_n_steps={every_n_steps!r}, "
                f"leak_intervals={leak_intervals!r}): both must be integers >= 1"
            )
        if leak_min_growth_mb < 0:
            raise ConfigurationError(f"MemoryMonitor(leak_min_growth_mb={leak_min_growth_mb!r}) must be >= 0")
        self.every_n_steps = int(every_n_steps)
        self.leak_intervals = int(leak_intervals)
        self.leak_min_growth_mb = float(leak_min_growth_mb)
        self.snapshot_on_oom = snapshot_on_oom
        self.snapshot_dir = snapshot_dir
        self.record_history = record_history
        self.history_max_entries = int(history_max_entries)
        # rank -> field -> (value, step) of the highest value seen; survives a resume (state_dict).
        self.peaks: Dict[int, Dict[str, Tuple[float, int]]] = {}
        # rank -> field -> last ``leak_intervals + 1`` (step, value) samples.
        self._windows: Dict[int, Dict[str, Deque[Tuple[int, float]]]] = {}
        self.leaks: List[Dict[str, Any]] = []  # every leak reported, for inspection
        self.last_metrics: Dict[str, float] = {}
        self.snapshots: List[str] = []  # files written
        self._last_step = -1
        self._nvml: Any = None  # handle, False once NVML turned out to be unusable
        self._recording = False

    # ---- hooks ----------------------------------------------------------------------------
    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if not self.record_history:
            return
        if not _is_cuda(trainer):
            warnings.warn(
                "MemoryMonitor(record_history=True): memory snapshots need CUDA; skipped on this "
                f"{_device(trainer).type} run",
                UserWarning,
                stacklevel=2,
            )
            return
        torch.cuda.memory._record_memory_history(max_entries=self.history_max_entries)
        self._recording = True

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > 0 and step != self._last_step and step % self.every_n_steps == 0:
            self.measure(trainer)

    def on_fit_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if trainer.global_step != self._last_step:
            self.measure(trainer)  # every rank is here, so the collective is safe
        if self._recording:
            self._dump_snapshot(trainer, f"fit_end_step{trainer.global_step}")
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
        if trainer.is_global_zero:
            print(self.summary())

    def on_exception(self, trainer: TrainerView, module: TrainingModule, exception: BaseException) -> None:
        oom_types = tuple(
            t
            for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
            if t is not None
        )
        if self.snapshot_on_oom and isinstance(exception, oom_types) and _is_cuda(trainer):
            # Rank-local on purpose: the other ranks may never reach a collective again.
            self._dump_snapshot(trainer, f"oom_step{trainer.global_step}")
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False

    # ---- measuring ------------------------------------------------------------------------
    def measure(self, trainer: TrainerView) -> Dict[str, float]:
        """Measure on this rank, gather all ranks, log, update peaks and leak windows. Collective."""
        step = trainer.global_step
        self._last_step = step
        local = self._local_values(trainer)
        device = trainer.device
        vec = torch.tensor([local.get(f, float("nan")) for f in _FIELDS], dtype=torch.float64, device=device)
        gathered = trainer.strategy.all_gather(vec).detach().to("cpu", torch.float64)  # [world, fields]
        metrics: Dict[str, float] = {}
        for j, field in enumerate(_FIELDS):
            column = gathered[:, j]
            present = column[~torch.isnan(column)]
            if present.numel() == 0:
                continue
            prefix = "gpu/" if field in _NVML_FIELDS else "memory/"
            metrics[f"{prefix}{field}_max"] = float(present.max())
            metrics[f"{prefix}{field}_mean"] = float(present.mean())
        for rank in range(gathered.shape[0]):
            row = {f: float(gathered[rank, j]) for j, f in enumerate(_FIELDS)}
            self._update_peaks(rank, row, step)
            if trainer.is_global_zero:
                self._check_leak(rank, row, step)
        self.last_metrics = metrics
        trainer.log_metrics(metrics, step=step)
        return metrics

    def _local_values(self, trainer: TrainerView) -> Dict[str, float]:
        values = {"host_rss_mb": psutil.Process(os.getpid()).memory_info().rss / _MB}
        if _is_cuda(trainer):
            dev = _device(trainer)
            values["cuda_allocated_mb"] = torch.cuda.memory_allocated(dev) / _MB
            values["cuda_reserved_mb"] = torch.cuda.memory_reserved(dev) / _MB
            values["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated(dev) / _MB
            torch.cuda.reset_peak_memory_stats(dev)  # next value is the next interval's peak
            values.update(self._nvml_values(dev))
        return values

    def _nvml_values(self, device: torch.device) -> Dict[str, float]:
        if self._nvml is False:
            return {}
        try:
            import pynvml

            if self._nvml is None:
                pynvml.nvmlInit()
                # NVML numbers the physical GPUs; match ours by UUID so CUDA_VISIBLE_DEVICES is respected.
                uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
                if uuid:
                    self._nvml = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
                else:
                    self._nvml = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            handle = self._nvml
            return {
                "utilization_pct": float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                "temperature_c": float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            }
        except Exception as err:  # no pynvml, no driver, no permission: GPU health is optional
            log.debug("MemoryMonitor: NVML unavailable (%s); GPU utilisation/temperature/power skipped", err)
            self._nvml = False
            return {}

    def _update_peaks(self, rank: int, row: Dict[str, float], step: int) -> None:
        peaks = self.peaks.setdefault(rank, {})
        for field in _PEAK_FIELDS:
            value = row[field]
            if value == value and (field not in peaks or value > peaks[field][0]):  # skips NaN
                peaks[field] = (value, step)

    def _check_leak(self, rank: int, row: Dict[str, float], step: int) -> None:
        windows = self._windows.setdefault(rank, {})
        for field in _LEAK_FIELDS:
            value = row[field]
            if value != value:
                continue
            window = windows.setdefault(field, deque(maxlen=self.leak_intervals + 1))
            window.append((step, value))
            if len(window) <= self.leak_intervals:
                continue
            samples = list(window)
            rising = all(b[1] > a[1] for a, b in zip(samples, samples[1:]))
            growth = samples[-1][1] - samples[0][1]
            if rising and growth > self.leak_min_growth_mb:
                leak = {
                    "rank": rank,
                    "field": field,
                    "growth_mb": growth,
                    "from_step": samples[0][0],
                    "to_step": samples[-1][0],
                }
                self.leaks.append(leak)
                warnings.warn(
                    f"MemoryMonitor: possible memory leak on rank {rank}: {field} grew by "
                    f"{growth:.1f} MB over {self.leak_intervals} consecutive intervals "
                    f"(steps {leak['from_step']} -> {leak['to_step']})",
                    MemoryLeakWarning,
                    stacklevel=2,
                )
                window.clear()
                window.append(samples[-1])

    # ---- snapshots ------------------------------------------------------------------------
    def _dump_snapshot(self, trainer: TrainerView, tag: str) -> None:
        """Pickle the CUDA allocator state and write an HTML view next to it (CUDA-only)."""
        folder = self.snapshot_dir or os.path.join(str(trainer.default_root_dir), "memory")
        base = os.path.join(folder, f"rank{trainer.global_rank}_{tag}")
        try:
            from torch.cuda import _memory_viz

            os.makedirs(folder, exist_ok=True)
            torch.cuda.memory._dump_snapshot(base + ".pickle")
            snapshot = torch.cuda.memory._snapshot()
            # A trace needs recorded history; without it only the segments (allocator layout) exist.
            html = _memory_viz.trace_plot(snapshot) if self._recording else _memory_viz.segment_plot(snapshot)
            with open(base + ".html", "w") as fh:
                fh.write(html)
            self.snapshots += [base + ".pickle", base + ".html"]
            log.warning("MemoryMonitor: CUDA memory snapshot written to %s.pickle (view: %s.html)", base, base)
        except Exception as err:  # never hide the original error (OOM) behind a snapshot failure
            log.warning("MemoryMonitor: could not write the memory snapshot %s: %s", base, err)

    # ---- summary and state ----------------------------------------------------------------
    def summary(self) -> str:
        """A table: peak host RSS and CUDA memory per rank and the step where each happened."""
        lines = [
            "MemoryMonitor summary (MB, peak per rank)",
            f"{'rank':>4}  {'host_rss_peak':>13}  {'at_step':>7}  {'cuda_peak':>10}  {'at_step':>7}",
        ]
        for rank in sorted(self.peaks):
            cells = []
            for field, width in (("host_rss_mb", 13), ("cuda_peak_allocated_mb", 10)):
                value, step = self.peaks[rank].get(field, (None, None))
                cells.append(f"{value:>{width}.1f}  {step:>7d}" if value is not None else f"{'-':>{width}}  {'-':>7}")
            lines.append(f"{rank:>4}  " + "  ".join(cells))
        if not self.peaks:
            lines.append("  (no measurement was taken)")
        return "\n".join(lines)

    def state_dict(self) -> Dict[str, Any]:
        # The leak windows are not saved: a resumed process starts from its own memory baseline.
        return {
            "peaks": {r: {f: list(v) for f, v in p.items()} for r, p in self.peaks.items()},
            "leaks": list(self.leaks),
            "last_step": self._last_step,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.peaks = {
            int(r): {f: (float(v[0]), int(v[1])) for f, v in p.items()} for r, p in state_dict.get("peaks", {}).items()
        }
        self.leaks = list(state_dict.get("leaks", []))
        self._last_step = int(state_dict.get("last_step", -1))


def _device(trainer: TrainerView) -> torch.device:
    device = trainer.device
    return torch.device(device) if device is not None else torch.device("cpu")


def _is_cuda(trainer: TrainerView) -> bool:
    return _device(trainer).type == "cuda" and torch.cuda.is_available()
