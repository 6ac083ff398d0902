"""Asynchronous checkpoints (strategies/checkpoint/async_save.py): exact staged state, one save in flight,
pruning after the commit, errors raised in the main thread, SIGKILLs during background writes,
and bit-identical resume on 1 process and on 2 (DDP, FSDP, DeepSpeed) processes. CPU, fp32."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from tests.helpers import forklaunch, procs
from tests.helpers.models import Regressor, make_net, regression_data
from tests.strategies.test_checkpoint_crash import _readline
from trainforge import Accelerator, CheckpointError, ConfigurationError, Trainer, seed_everything
from trainforge.callbacks import ModelCheckpoint
from trainforge.strategies import resolve_strategy
from trainforge.strategies.checkpoint.async_save import WRITER_NICENESS, AsyncCheckpointer, resolve_async_save
from trainforge.strategies.checkpoint.io import (
    list_checkpoints,
    load_object,
    load_tensors,
    read_latest_pointer,
    resolve_checkpoint,
    verify_checkpoint,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["yes", 1, 0.0, "auto"])
def test_bad_async_save_values_name_the_choices(tmp_path, value):
    with pytest.raises(ConfigurationError, match=r"ModelCheckpoint: async_save=.*is not one of: None .*True .*False"):
        ModelCheckpoint(async_save=value)
    acc = Accelerator()
    with pytest.raises(ConfigurationError, match="async_save=.*is not one of"):
        acc.save_state(str(tmp_path / "state"), async_save=value)
    trainer = Trainer(max_steps=1, default_root_dir=str(tmp_path), enable_progress_bar=False)
    with pytest.raises(ConfigurationError, match="async_save=.*is not one of"):
        trainer.save_checkpoint(str(tmp_path / "ckpt"), async_save=value)
    assert not (tmp_path / "state").exists() and not (tmp_path / "ckpt").exists()


def test_default_is_on_for_cuda_and_off_on_cpu():
    assert resolve_async_save(None, torch.device("cuda")) is True
    assert resolve_async_save(None, torch.device("cpu")) is False
    assert resolve_async_save(True, torch.device("cpu")) is True
    assert resolve_async_save(False, torch.device("cuda")) is False


# ---- the saver on its own -------------------------------------------------------------------------
def test_staged_state_is_the_state_at_save_time_with_buffers_reused(tmp_path):
    saver = AsyncCheckpointer(resolve_strategy("single"))
    weight = torch.arange(1000, dtype=torch.float32)
    ptrs = []
    for step in range(3):
        writer = saver.open(tmp_path / f"step-{step}")
        writer.save_tensors("model", {"weight": weight, "tied": weight})
        writer.save_object("optimizer", {"step": step, "exp_avg": weight * 2, "rng": torch.get_rng_state()})
        writer.finalize({"step": step})
        ptrs.append(writer._staged[0]["weight"].data_ptr())
        expected = weight.clone()
        weight.add_(1.0)  # training goes on the moment staging ended
        saver.wait()
        loaded = load_tensors(tmp_path / f"step-{step}")
        assert torch.equal(loaded["weight"], expected) and loaded["tied"] is loaded["weight"]
        assert load_object(tmp_path / f"step-{step}", "optimizer")["step"] == step
        assert read_latest_pointer(tmp_path) == f"step-{step}"
    assert ptrs[0] == ptrs[1] == ptrs[2], "the staging buffer of the weights must be reused between saves"
    writers = [t for t in threading.enumerate() if t.name.startswith("trainforge-async-ckpt")]
    if sys.platform.startswith("linux"):  # the writer yields the CPU to the training threads
        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert writers and os.getpriority(os.PRIO_PROCESS, writers[0].native_id) == min(19, base + WRITER_NICENESS)
    saver.close()


def _save_held_in_flight(path: Path) -> tuple[AsyncCheckpointer, threading.Event]:
    """A saver whose save of ``path`` stays in flight until the returned event is set."""
    saver = AsyncCheckpointer(resolve_strategy("single"))
    writer = saver.open(path)
    writer.save_object("state", {"n": 1})
    gate = threading.Event()
    real_finalize = writer._writer.finalize
    writer._writer.finalize = lambda *a, **k: (gate.wait(30), real_finalize(*a, **k))[1]
    writer.finalize({"step": 1})
    return saver, gate


def test_one_save_in_flight_and_pruning_only_after_the_commit(tmp_path, caplog):
    saver, gate = _save_held_in_flight(tmp_path / "a")
    seen = []
    saver.after_commit(lambda: seen.append((tmp_path / "a" / "metadata.json").is_file()))
    assert saver.in_flight() and not seen
    threading.Timer(0.5, gate.set).start()
    with caplog.at_level(logging.INFO, logger="trainforge"):
        second = saver.open(tmp_path / "b")  # waits for "a"
    assert seen == [True], "the deletion ran before the new checkpoint was committed"
    assert sum("still being written" in r.getMessage() for r in caplog.records) == 1
    second.save_object("state", {"n": 2})
    second.finalize({"step": 2})
    saver.close()
    assert read_latest_pointer(tmp_path) == "b"


def test_a_process_forked_while_a_save_is_in_flight_exits_at_once(tmp_path):
    """A DataLoader worker forked during a background save inherits the exit hook, not the writer thread:
    its exit must not wait for that save (it hung until the DataLoader killed it, 5 s per worker)."""
    saver, gate = _save_held_in_flight(tmp_path / "a")
    try:
        assert saver.in_flight()
        child = multiprocessing.get_context("fork").Process(target=int)
        started = time.monotonic()
        child.start()
        child.join(10)
        took = time.monotonic() - started
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
        assert not alive and child.exitcode == 0, f"the forked process hung at exit ({took:.1f} s)"
    finally:
        gate.set()
        saver.close()
    assert read_latest_pointer(tmp_path) == "a"  # the parent's save still committed


def test_a_failed_background_write_is_raised_naming_the_checkpoint(tmp_path):
    saver = AsyncCheckpointer(resolve_strategy("single"))
    ok = saver.open(tmp_path / "good")
    ok.save_object("state", {"n": 1})
    ok.finalize({"step": 1})
    saver.wait()
    bad = saver.open(tmp_path / "bad")
    bad.save_object("state", {"n": 2})

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device", str(bad.tmp_dir / "state.pt"))

    bad._writer.save_object = fail
    bad.finalize({"step": 2})
    pruned = []
    saver.after_commit(lambda: pruned.append(True))
    time.sleep(0.2)
    with pytest.raises(
        CheckpointError,
        match=r"save of .*bad failed .*No space left.*previous checkpoint .*good "
        r"is intact",
    ):
        saver.check()
    assert not pruned, "pruning must not follow a failed save"
    assert read_latest_pointer(tmp_path) == "good" and not (tmp_path / "bad").exists()
    assert resolve_checkpoint(tmp_path, "last") == tmp_path / "good"
    saver.close()


# ---- through the Trainer --------------------------------------------------------------------------
def _fit(root: Path, ckpt_path=None, keep_last_k=None, max_steps=8):
    seed_everything(0)
    module = Regressor(make_net(dropout=0.2), step_lr=True)
    trainer = Trainer(
        max_steps=max_steps,
        default_root_dir=str(root),
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(every_n_steps=2, keep_last_k=keep_last_k, async_save=True)],
        logger=False,  # checkpoints in <root>/checkpoints (a logger's would be in its version folder)
    )
    trainer.fit(module, DataLoader(regression_data(), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return module.state_dict()


def test_trainer_async_saves_resume_bit_identical_and_prune_after_commit(tmp_path):
    full = _fit(tmp_path / "full", keep_last_k=2)
    ckpts = tmp_path / "full" / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["epoch=0-step=6", "epoch=0-step=8"]
    assert read_latest_pointer(ckpts) == "epoch=0-step=8" and verify_checkpoint(ckpts / "epoch=0-step=8")["step"] == 8
    _fit(tmp_path / "cut", max_steps=3)  # saved at step 2 asynchronously, then stopped
    resumed = _fit(tmp_path / "cut", ckpt_path=str(tmp_path / "cut" / "checkpoints" / "epoch=0-step=2"))
    for key in full:
        assert torch.equal(full[key], resumed[key]), key


# ---- real processes -------------------------------------------------------------------------------
def _final(root: Path) -> dict:
    return load_file(root / "final.safetensors")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork server needs os.fork")
def test_sigkill_while_async_writes_are_in_flight_then_resume_is_bit_identical(tmp_path):
    rng = random.Random(12)
    server = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "async_kill_run.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=0,
        env=procs.test_env(),
    )

    def fit(root: Path, log: Path, resume: bool, kill_after: float = 0.0) -> int:
        server.stdin.write(f"run {root} {log} {int(resume)}\n".encode())
        pid = int(_readline(server, 30).split()[1])
        if kill_after:  # counted from the start of the loop (the log's "started" line)
            deadline = time.monotonic() + 60
            while "started" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(kill_after)
            os.kill(pid, signal.SIGKILL)
        server.stdin.write(f"reap {pid}\n".encode())
        return int(_readline(server, 120).split()[1])

    try:
        assert _readline(server, 60) == "ready"
        ref_log = tmp_path / "reference.log"
        assert fit(tmp_path / "reference", ref_log, False) == 0, ref_log.read_text()
        reference = _final(tmp_path / "reference")
        mid_write = 0
        for trial in range(12):
            root, log = tmp_path / f"trial{trial}", tmp_path / f"trial{trial}.log"
            status = fit(root, log, False, kill_after=rng.uniform(0.01, 0.8))
            text = log.read_text()
            assert "Traceback" not in text, text
            if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                assert "done" in text, text  # it finished before the kill
            committed = [int(line.split()[1]) for line in text.splitlines() if line.startswith("committed ")]
            ckpts = root / "checkpoints"
            mid_write += ckpts.is_dir() and any(p.name.endswith(".partial") for p in ckpts.iterdir())
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # latest must name a complete checkpoint that verifies
                path = resolve_checkpoint(ckpts, "last", missing_ok=True)
            if path is not None:
                assert verify_checkpoint(path)["step"] >= max(committed, default=0)
            assert fit(root, log, True) == 0, log.read_text()[-3000:]
            final = _final(root)
            assert all(torch.equal(final[k], reference[k]) for k in reference), f"trial {trial}: resume differs"
        print(f"kills that landed while an asynchronous write was in flight: {mid_write} of 12")
        assert mid_write >= 1, "no kill landed while an asynchronous write was in flight"
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.mark.slow
def test_file_too_large_in_the_background_write_names_the_path_and_keeps_the_previous(tmp_path):
    proc = procs.run([sys.executable, str(SCRIPTS / "async_fail_run.py"), str(tmp_path)], timeout=120, check=False)
    out = proc.stdout
    assert proc.returncode == 3, out[-4000:]
    assert "CheckpointError: asynchronous save of" in out and "epoch=0-step=2 failed" in out, out[-4000:]
    assert "File too large" in out and "previous checkpoint" in out and "epoch=0-step=1 is intact" in out
    ckpts = tmp_path / "checkpoints"
    assert read_latest_pointer(ckpts) == "epoch=0-step=1"
    assert resolve_checkpoint(ckpts, "last") == ckpts / "epoch=0-step=1"
    assert load_object(ckpts / "epoch=0-step=1", "trainer_state")["progress"]["global_step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_two_processes_async_saves_killed_and_restarted_resume_bit_identical(tmp_path, strategy):
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    script = SCRIPTS / "resume_run.py"
    common = ["--strategy", strategy, "--ckpt-every", "2"]
    forklaunch.launch(script, "--root", tmp_path / "full", "--record", tmp_path / "full.rec", *common, timeout=240)
    marker = tmp_path / "killed-once"
    # rank 1 is killed at step 7, while rank 0 may still be writing the step-6 save; both restart as under
    # torchrun --max-restarts 1 (forked; the real agent's restart: tests/trainer/test_resume.py)
    forklaunch.launch(
        script,
        "--root",
        tmp_path / "cut",
        "--record",
        tmp_path / "cut.rec",
        *common,
        "--async-save",
        "--kill-at",
        "7",
        "--kill-rank",
        "1",
        "--kill-marker",
        marker,
        "--resume",
        timeout=240,
        max_restarts=1,
    )
    assert marker.exists(), "the kill never happened"
    full, cut = _final(tmp_path / "full"), _final(tmp_path / "cut")
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    ckpts = tmp_path / "cut" / "checkpoints"
    assert verify_checkpoint(resolve_checkpoint(ckpts, "last"))["step"] == 12


@pytest.mark.slow
def test_the_process_does_not_exit_before_an_async_save_state_is_committed(tmp_path):
    script = (
        "import sys, torch\n"
        "from trainforge import Accelerator\n"
        "acc = Accelerator()\n"
        "model, opt = acc.prepare(torch.nn.Linear(512, 512), torch.optim.AdamW([torch.zeros(1)]))\n"
        "acc.save_state(sys.argv[1], async_save=True)\n"
        "print('returned', flush=True)\n"
    )  # and the interpreter exits at once
    out = procs.run([sys.executable, "-c", script, str(tmp_path / "state")], timeout=120).stdout
    assert "returned" in out
    assert verify_checkpoint(tmp_path / "state")["kind"] == "accelerator"
    assert load_tensors(tmp_path / "state")["weight"].shape == (512, 512)
