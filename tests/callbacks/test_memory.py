"""MemoryMonitor: metrics reach the LOG event, a planted leak is flagged, a steady run is not."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.scripts.cb_launch import multirank, multirank_output
from tests.scripts.cb_standin import StandInTrainer
from trainforge.callbacks.base import Callback
from trainforge.callbacks.memory import MemoryLeakWarning, MemoryMonitor
from trainforge.strategies.errors import ConfigurationError

MB_FLOATS = 262144  # float32 elements in 1 MiB


class Leaky(nn.Module):
    """Keeps a fresh ~1 MB tensor alive per forward: RSS grows by ~1 MB per step."""

    def __init__(self, leak: bool) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.leak = leak
        self.kept = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.leak:
            self.kept.append(torch.ones(MB_FLOATS))  # ones, not empty: pages must be touched
        return self.net(x)


class Recorder(Callback):
    def __init__(self) -> None:
        self.seen = []

    def on_log(self, trainer, module, metrics, step):
        self.seen.append((dict(metrics), step))


def _run(tmp_path, leak: bool, steps: int, **kwargs):
    torch.manual_seed(0)
    model = Leaky(leak)
    monitor = MemoryMonitor(**kwargs)
    recorder = Recorder()
    trainer = StandInTrainer([monitor, recorder], root=str(tmp_path))
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer.fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.01), max_steps=steps)
    return monitor, trainer, recorder


def test_planted_leak_is_flagged(tmp_path):
    with pytest.warns(MemoryLeakWarning, match=r"rank 0: host_rss_mb grew by [\d.]+ MB .*steps \d+ -> \d+"):
        monitor, _, _ = _run(tmp_path, leak=True, steps=24, every_n_steps=2, leak_intervals=3, leak_min_growth_mb=3.0)
    leak = monitor.leaks[0]
    assert leak["rank"] == 0 and leak["field"] == "host_rss_mb"
    # 3 intervals of 2 steps, 1 MB kept per step: about 6 MB (allocator slack allowed)
    assert 3.0 < leak["growth_mb"] < 30.0
    assert leak["to_step"] - leak["from_step"] == 6


def test_steady_run_is_not_flagged_and_metrics_reach_log(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryLeakWarning)
        monitor, trainer, recorder = _run(
            tmp_path, leak=False, steps=40, every_n_steps=2, leak_intervals=3, leak_min_growth_mb=3.0
        )
    assert monitor.leaks == []
    logged = [(m, s) for m, s in recorder.seen if "memory/host_rss_mb_max" in m]
    assert [s for _, s in logged] == list(range(2, 41, 2))  # every 2 steps, through the LOG event
    for metrics, _ in logged:
        assert metrics["memory/host_rss_mb_max"] >= metrics["memory/host_rss_mb_mean"] > 10.0
        assert not any(k.startswith("memory/cuda") for k in metrics)  # CPU run: no CUDA values
    out = capsys.readouterr().out
    assert "MemoryMonitor summary" in out
    rank0 = next(line for line in out.splitlines() if line.strip().startswith("0 "))
    peak, step = monitor.peaks[0]["host_rss_mb"]
    assert f"{peak:.1f}" in rank0 and str(step) in rank0.split()


def test_peaks_survive_resume(tmp_path, capsys):
    first, _, _ = _run(tmp_path, leak=True, steps=8, every_n_steps=2, leak_intervals=50)
    state = first.state_dict()
    resumed = MemoryMonitor(every_n_steps=2)
    resumed.load_state_dict(state)
    assert resumed.peaks == first.peaks
    high = first.peaks[0]["host_rss_mb"]
    resumed.peaks[0]["host_rss_mb"] = (high[0] + 1e6, high[1])  # a peak no real run here reaches
    summary = resumed.summary()
    assert f"{high[0] + 1e6:.1f}" in summary and str(high[1]) in summary


def test_snapshot_is_skipped_on_cpu(tmp_path):
    with pytest.warns(UserWarning, match="need CUDA; skipped"):
        monitor, _, _ = _run(tmp_path, leak=False, steps=4, every_n_steps=2, record_history=True)
    assert monitor.snapshots == [] and not (tmp_path / "memory").exists()


def test_bad_arguments():
    with pytest.raises(ConfigurationError, match="every_n_steps=0"):
        MemoryMonitor(every_n_steps=0)
    with pytest.raises(ConfigurationError, match="leak_min_growth_mb=-1"):
        MemoryMonitor(leak_min_growth_mb=-1)


@pytest.mark.slow
def test_real_trainer_two_ranks_gather_max_and_mean():
    r0, r1 = multirank("monitors")  # rank 1 holds 64 MB more than rank 0
    for step in ("4", "8", "12"):
        m0, m1 = r0["logged"][step], r1["logged"][step]
        memory = {k: v for k, v in m0.items() if k.startswith("memory/")}
        assert memory and all(m1[k] == v for k, v in memory.items())  # every rank logs the gathered values
        assert m0["memory/host_rss_mb_max"] - m0["memory/host_rss_mb_mean"] > 20  # ~32: half the gap
    peaks = r0["peaks"]
    assert peaks == r1["peaks"]
    assert peaks["1"]["host_rss_mb"][0] - peaks["0"]["host_rss_mb"][0] > 40
    assert multirank_output().count("MemoryMonitor summary") == 1  # printed by global zero only
