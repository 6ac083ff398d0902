"""Profilers: PyTorchProfiler traces (loop phases, callback hooks, schedule, TensorBoard handler),
Accelerator.profile(), the SimpleProfiler hook timer, and refused settings. In-process, CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.models import Regressor, make_net, regression_data
from tests.scripts.cb_launch import multirank
from trainforge import Accelerator, Trainer
from trainforge.callbacks import Callback, PyTorchProfiler, SimpleProfiler
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.loop.profiling import instrument
from trainforge.utils import ProfileKwargs


@pytest.fixture(scope="module", autouse=True)
def _kineto_started_once():
    """torch.profiler's first start in a process initialises Kineto (2-5 s here), once per process."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass


class Marker(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        pass


class Slow(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        time.sleep(0.01)


def _fit(tmp_path, profiler, callbacks=(), steps=6, val=False):
    trainer = Trainer(
        max_steps=steps,
        profiler=profiler,
        callbacks=list(callbacks),
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        val_check_interval=2 if val else 1.0,
        limit_val_batches=1,
    )
    loader = DataLoader(regression_data(), batch_size=4)
    trainer.fit(Regressor(make_net()), loader, DataLoader(regression_data(8), batch_size=4) if val else None)
    return trainer


def _names(path):
    return [e.get("name", "") for e in json.loads(open(path).read())["traceEvents"]]


def test_chrome_trace_holds_the_loop_phases_and_each_callback_hook(tmp_path):
    profiler = PyTorchProfiler()
    _fit(tmp_path, profiler, [Marker()], steps=3, val=True)
    traces = sorted((tmp_path / "profiler").glob("rank0.*.pt.trace.json"))
    assert [str(p) for p in traces] == profiler.trace_files and len(traces) == 1
    names = set(_names(traces[0]))
    for phase in ("training_batch", "training_step", "backward", "optimizer_step", "validation"):
        assert f"[loop] {phase}" in names
    assert "Marker.on_train_batch_start" in names
    assert "[module] net.0 (Linear)" in names and "[module] net.1 (Tanh)" in names
    assert "Regressor.on_before_backward" not in names  # not overridden: not dispatched, not recorded
    assert "PyTorchProfiler.on_train_batch_start" not in names  # its own hooks are not wrapped
    assert (tmp_path / "profiler" / "rank0-summary.txt").read_text() == profiler.summary + "\n"


def test_schedule_records_exactly_the_active_steps(tmp_path):
    profiler = PyTorchProfiler(wait=1, warmup=1, active=2, filename="sched")
    _fit(tmp_path, profiler, steps=6)
    (trace,) = (tmp_path / "profiler").glob("sched-rank0.*.pt.trace.json")
    steps = sorted({n for n in _names(trace) if n.startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]


def test_a_schedule_that_never_records_says_so(tmp_path, caplog):
    profiler = PyTorchProfiler(wait=1000, warmup=1, active=1)
    with caplog.at_level("WARNING", logger="trainforge"):
        _fit(tmp_path, profiler, steps=4)
    assert not list((tmp_path / "profiler").iterdir())  # an empty folder, said nothing
    warned = [r.getMessage() for r in caplog.records if "recorded nothing" in r.getMessage()]
    assert (
        len(warned) == 1 and "wait=1000, warmup=1, active=1" in warned[0] and "in the 4 training batches" in warned[0]
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainforge"):
        _fit(tmp_path / "ok", PyTorchProfiler(wait=1, warmup=1, active=1), steps=4)
    assert not [r for r in caplog.records if "recorded nothing" in r.getMessage()]


def test_simple_profiler_dirpath_that_cannot_be_written_fails_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    steps = []

    class Count(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            steps.append(batch_idx)

    # the whole fit ran, then writing the report failed
    with pytest.raises(ConfigurationError, match=r"SimpleProfiler\(dirpath\)=.*a-file/reports' cannot be written to"):
        _fit(tmp_path, SimpleProfiler(dirpath=str(blocker / "reports")), [Count()], steps=2)
    assert steps == []


def test_tensorboard_handler_writes_its_trace(tmp_path):
    trainer = _fit(
        tmp_path,
        PyTorchProfiler(dirpath=str(tmp_path / "tb"), trace_handler="tensorboard", record_module_names=False),
        steps=2,
    )
    (trace,) = (tmp_path / "tb").glob("rank0.*.pt.trace.json")
    assert "[loop] training_step" in _names(trace)
    assert not [n for n in _names(trace) if n.startswith("[module]")]
    assert not trainer.model.net[0]._forward_hooks  # nothing left on the model after fit


def test_trainer_profiler_pytorch_string(tmp_path):
    trainer = _fit(tmp_path, "pytorch", steps=1)
    assert isinstance(trainer.callbacks[0], PyTorchProfiler)
    assert list((tmp_path / "profiler").glob("rank0.*.pt.trace.json"))


def test_simple_profiler_names_the_slow_callback_most_expensive(tmp_path, capsys):
    trainer = _fit(tmp_path, "simple", [Marker(), Slow()], steps=4)
    profiler = trainer.callbacks[0]
    assert isinstance(profiler, SimpleProfiler)
    costliest = max(profiler.totals.items(), key=lambda item: item[1][0])
    assert costliest[0] == "Slow.on_train_batch_end" and costliest[1][1] == 4
    assert profiler.totals["Marker.on_train_batch_start"][1] == 4
    report = capsys.readouterr().out
    assert "over 4 optimizer steps" in report
    rows = [line.split()[0] for line in report.splitlines()[2:] if line.strip()]
    assert rows[0] == "Slow.on_train_batch_end"


def test_without_a_profiler_the_dispatched_hooks_are_the_callbacks_own_methods():
    marker = Marker()
    hook = marker.on_train_batch_start
    assert instrument([("Marker.on_train_batch_start", hook)], [marker]) == [hook]
    (wrapped,) = instrument([("Marker.on_train_batch_start", hook)], [marker, SimpleProfiler()])
    assert wrapped != hook


def test_accelerator_profile_yields_a_profiler_and_writes_a_trace(tmp_path):
    acc = Accelerator(cpu=True)
    handler = ProfileKwargs(output_trace_dir=str(tmp_path / "acc"))
    with acc.profile(handler) as prof, torch.profiler.record_function("my_block"):
        torch.ones(4).sum()
    assert isinstance(prof, torch.profiler.profile)
    assert "my_block" in _names(tmp_path / "acc" / "profile_0.json")
    acc = Accelerator(cpu=True, kwargs_handlers=[ProfileKwargs(schedule_option=dict(wait=0, warmup=0, active=1))])
    with acc.profile() as prof:
        prof.step()
    assert isinstance(prof, torch.profiler.profile)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: PyTorchProfiler(wait=0, warmup=0, active=0), r"active=0 records no step.*active >= 1"),
        (lambda: PyTorchProfiler(wait=-1, active=2), r"wait=-1 must be an int >= 0.*wait=1, warmup=1, active=2"),
        (lambda: PyTorchProfiler(active="2"), r"active='2' must be an int >= 0"),
        (lambda: PyTorchProfiler(trace_handler="html"), r"trace_handler\)='html' is not one of: chrome, tensorboard"),
        (lambda: PyTorchProfiler(schedule=3), r"schedule=3\) must be torch.profiler.schedule"),
        (lambda: PyTorchProfiler(sort_by_key="time"), r"sort_by_key\)='time' is not one of: cpu_time_total"),
        (lambda: PyTorchProfiler(emit_nvtx=True), r"emit_nvtx=True\) is not supported.*emit_nvtx\(\)"),
        (lambda: PyTorchProfiler(record_shape=True), r"record_shape=True, which is neither.*record_shapes"),
        (lambda: PyTorchProfiler(row_limit="20"), r"row_limit='20'\) must be an int"),
        (lambda: ProfileKwargs(schedule_option=dict(wait=0, warmup=0, active=0)), r"schedule_option\).*active=0"),
        (lambda: ProfileKwargs(schedule_option=dict(waits=1, active=1)), r"key='waits' is not one of: wait"),
        (lambda: ProfileKwargs(activities=["gpu"]), r"activities=\['gpu'\].*'cpu', 'cuda'"),
        (lambda: Trainer(profiler="fast"), r"profiler='fast'\) is not one of: None, 'simple', 'pytorch'"),
        (lambda: Trainer(profiler=1), r"profiler=1\) is not one of"),
        (lambda: Trainer(profiler="advanced"), r"'advanced'.*cProfile.*profiler='simple'"),
        (lambda: Accelerator(cpu=True).profile(profile_handler={"a": 1}).__enter__(), r"must be a .*ProfileKwargs"),
    ],
)
def test_bad_settings_are_refused_with_the_value_and_the_fix(build, match):
    with pytest.raises(ConfigurationError, match=match):
        build()


@pytest.mark.slow
def test_two_ranks_write_one_trace_each():
    r0, r1 = multirank("profiler")  # the callbacks' shared 2-process launch (tests/scripts/cb_multirank.py)
    assert (r0["mine"], r1["mine"]) == ("rank0.0.pt.trace.json", "rank1.0.pt.trace.json")
    assert r0["files"] == r1["files"] == ["rank0.0.pt.trace.json", "rank1.0.pt.trace.json"]
    assert "[loop] training_step" in r0["phases"] and r0["phases"] == r1["phases"]


def test_reports_never_overwrite_an_existing_file(tmp_path):
    """A user's file (or an earlier run's report) where a report would go is kept; the report goes to -1."""
    out = tmp_path / "reports"
    out.mkdir()
    (out / "hooks.txt").write_text("mine\n")
    simple = SimpleProfiler(dirpath=str(out), filename="hooks.txt")
    _fit(tmp_path, simple, steps=2)
    assert (out / "hooks.txt").read_text() == "mine\n"
    assert simple.report_path is not None and Path(simple.report_path) == out / "hooks-1.txt"
    assert (out / "hooks-1.txt").read_text() == simple.report + "\n"
    (tmp_path / "profiler").mkdir()
    (tmp_path / "profiler" / "rank0-summary.txt").write_text("mine\n")
    torch_profiler = PyTorchProfiler()
    _fit(tmp_path, torch_profiler, steps=2)
    assert (tmp_path / "profiler" / "rank0-summary.txt").read_text() == "mine\n"
    assert Path(torch_profiler.summary_path) == tmp_path / "profiler" / "rank0-summary-1.txt"
