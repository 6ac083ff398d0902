"""trainforge.utils: HF Accelerate's ``accelerate.utils`` / ``accelerate.logging`` / ``accelerate.local_sgd``
names (issue 20), and the top-level ones. One process here; two in ``test_names_on_two_processes``
(tests/scripts/accelerate_names_dist.py, gloo). The Accelerator's arguments and members are in
test_accelerate_names.py."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import trainforge
from tests.helpers import forklaunch
from trainforge import Accelerator, ConfigurationError
from trainforge.utils import (
    DistributedType,
    LocalSGD,
    PartialState,
    find_executable_batch_size,
    get_logger,
    set_seed,
    should_reduce_batch_size,
    skip_first_batches,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_top_level_names_are_accelerates():
    for name in ("DistributedType", "PartialState", "skip_first_batches", "find_executable_batch_size"):
        assert getattr(trainforge, name) is getattr(trainforge.utils, name) and name in trainforge.__all__


def test_set_seed():
    set_seed(7)
    first = (random.random(), np.random.rand(), torch.rand(1))
    set_seed(7)
    assert (random.random(), np.random.rand(), torch.rand(1)) == first
    try:
        set_seed(7, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(ConfigurationError, match=r"seed=-1 must be an int in \[0, 4294967295\]"):
        set_seed(-1)


def test_get_logger_logs_on_the_main_process_only_unless_told(monkeypatch, caplog):
    logger = get_logger("trainforge.test_names", log_level="INFO")
    caplog.set_level(logging.INFO, logger="trainforge.test_names")
    monkeypatch.setenv("RANK", "1")  # another process, no process group: the launcher's environment says
    logger.info("main only")
    logger.info("everywhere", main_process_only=False)
    monkeypatch.setenv("RANK", "0")
    logger.warning_once("once")
    logger.warning_once("once")
    assert [r.getMessage() for r in caplog.records] == ["everywhere", "once"]
    assert caplog.records[0].funcName == "test_get_logger_logs_on_the_main_process_only_unless_told"
    with pytest.raises(ConfigurationError, match=r"log_level='LOUD'\) is not a logging level"):
        get_logger("x", log_level="LOUD")


def test_find_executable_batch_size_takes_nine_tenths_on_out_of_memory():
    """Accelerate 1.15: ``batch_size = int(batch_size * 0.9)`` per out-of-memory error (recorded with
    ``accelerate.utils.find_executable_batch_size`` on the same function: 64, 57, 51, 45, 40, 36, 32)."""
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size, lr):
        tried.append(batch_size)
        if batch_size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if batch_size > 32:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
        return batch_size, lr

    assert train(0.1) == (32, 0.1) and tried == [64, 57, 51, 45, 40, 36, 32]
    with pytest.raises(ConfigurationError, match=r"got batch_size as its first argument.*Call train\(lr=0.1\)"):
        train(8, 0.1)

    @find_executable_batch_size(starting_batch_size=2)
    def never(batch_size):
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        never()

    @find_executable_batch_size
    def other(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        other()
    with pytest.raises(ConfigurationError, match=r"starting_batch_size=0\) must be an int >= 1"):
        find_executable_batch_size(lambda b: b, starting_batch_size=0)


def test_find_executable_batch_size_takes_accelerates_reduce_function_without_arguments():
    """Accelerate 1.15's ``reduce_batch_size_fn`` takes no argument and returns the new size (recorded with
    accelerate: the same function tried 128, 64, 32, 16)."""
    sizes, tried = [128], []

    def halve():
        sizes.append(sizes[-1] // 2)
        return sizes[-1]

    @find_executable_batch_size(starting_batch_size=128, reduce_batch_size_fn=halve)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    assert train() == 16 and tried == [128, 64, 32, 16]
    with pytest.raises(ConfigurationError, match=r"reduce_batch_size_fn=0\.5\) must be a function returning"):
        find_executable_batch_size(lambda b: b, reduce_batch_size_fn=0.5)


@pytest.mark.parametrize(
    "error, reduce",
    [
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if"), True),
        (RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"), True),
        (RuntimeError("FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed"), True),
        (RuntimeError("CUDA out of memory"), False),  # Accelerate looks for " out of memory."
        (RuntimeError("CUDA out of memory.", 2), False),  # one argument only
        (ValueError("CUDA out of memory."), False),
        (torch.OutOfMemoryError("CUDA out of memory. Tried"), True),
    ],
)
def test_should_reduce_batch_size_knows_accelerates_messages(error, reduce):
    """Recorded with ``accelerate.utils.memory.should_reduce_batch_size`` (1.15): the same answers."""
    assert should_reduce_batch_size(error) is reduce


def test_find_executable_batch_size_refuses_a_reduction_that_does_not_lower_the_size():
    tried = []

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda b: max(b // 2, 4))
    def train(batch_size):
        tried.append(batch_size)
        if len(tried) > 5:
            raise ValueError("batch size 4 retried again and again")  # it was retried forever
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(
        ConfigurationError,
        match=r"find_executable_batch_size\(train\): reduce_batch_size_fn "
        r"<lambda> turned batch size 4, which ran out of memory, into 4; it must return a smaller int",
    ):
        train()
    assert tried == [8, 4]


def test_find_executable_batch_size_without_a_process_group_or_store_refuses_several_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        return batch_size

    with pytest.raises(ConfigurationError, match=r"rank 1 of WORLD_SIZE=2 before any process group.*Accelerator"):
        train()


# rank 1 runs out of memory above 4, rank 0 never; no Accelerator yet, so no process group
MP_FINDER = """
import os, torch
from trainforge.utils import find_executable_batch_size
rank = int(os.environ["RANK"])

@find_executable_batch_size(starting_batch_size=16)
def trial(bs):
    if rank == 1 and bs > 4:
        raise torch.OutOfMemoryError("out of memory")
    return bs

print(f"rank {rank} batch size {trial()}", flush=True)
"""


@pytest.mark.slow
def test_find_executable_batch_size_before_the_accelerator_agrees_under_the_launcher(tmp_path):
    from tests.helpers import procs

    script = tmp_path / "finder.py"
    script.write_text(MP_FINDER)
    out = procs.run(procs.trainforge_launch(script, nproc=2), timeout=120, cwd=tmp_path, env=procs.test_env())
    # each rank decided alone: rank 0 returned 16
    assert "rank 0 batch size 4" in out.stdout and "rank 1 batch size 4" in out.stdout, out.stdout[-2000:]


def test_partial_state_on_one_process(capsys):
    state = PartialState(cpu=True)
    assert (state.num_processes, state.process_index, state.is_main_process, state.is_last_process) == (
        1,
        0,
        True,
        True,
    )
    assert state.distributed_type is DistributedType.NO and state.device == torch.device("cpu")
    state.print("hello")
    state.wait_for_everyone()
    with state.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]
    assert capsys.readouterr().out == "hello\n"
    with pytest.raises(
        ConfigurationError, match=r"PartialState\(backend=...\) is not supported.*InitProcessGroupKwargs"
    ):
        PartialState(backend="gloo")


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(7))


def test_skip_first_batches_plain_prepared_and_refused():
    loader = DataLoader(list(range(7)), batch_size=2)
    skipped = skip_first_batches(loader, 2)
    assert [b.tolist() for b in skipped] == [[4, 5], [6]] and len(skipped) == 2
    assert [b.tolist() for b in skip_first_batches(DataLoader(_Stream(), batch_size=3), 1)] == [[3, 4, 5], [6]]
    prepared = Accelerator().prepare(DataLoader(list(range(7)), batch_size=2))
    assert [b.tolist() for b in skip_first_batches(prepared, 3)] == [[6]]
    with pytest.raises(ConfigurationError, match=r"num_batches=-1\) must be an int >= 0"):
        skip_first_batches(loader, -1)
    with pytest.raises(ConfigurationError, match=r"skip_first_batches\(list\): expected a torch DataLoader"):
        skip_first_batches([1, 2], 1)


def test_local_sgd_on_one_process_is_plain_training():
    acc = Accelerator()
    model = acc.prepare(nn.Linear(2, 1))
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=2, enabled=True) as local:
        local.step()
        local.step()
    assert local.num_steps == 2 and local.enabled is False  # nothing to average on one process
    with pytest.raises(ConfigurationError, match=r"local_sgd_steps=0\) must be an int >= 1"):
        LocalSGD(accelerator=acc, model=model, local_sgd_steps=0)


@pytest.mark.slow
def test_names_on_two_processes(tmp_path):
    """LocalSGD averages, check_trigger sees another rank's set_trigger, get_logger logs once,
    PartialState/distributed_type/is_last_process, and the kwargs handlers reach DDP (gloo, 2 processes)."""
    out = forklaunch.launch(SCRIPTS / "accelerate_names_dist.py", str(tmp_path), timeout=120).stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, r in enumerate(ranks):
        assert r["distributed_type"] == "MULTI_CPU" and r["state"] == [2, rank] and r["is_last"] == (rank == 1)
        assert r["trigger"] == [False, True, False]
        assert r["find_unused_parameters"] is True and r["timeout"] == 77
        assert r["tracker"] == ("CSVLogger" if rank == 0 else "OffMainTracker")
    csv_rows = (tmp_path / "names" / "metrics.csv").read_text().splitlines()  # rank 0's value only
    assert csv_rows == ["from_tracker,step", "1.0,1"]  # Lightning's CSV layout: the columns sorted
    # LocalSGD: different local steps, the same averaged parameters on both ranks afterwards
    assert ranks[0]["before_average"] != ranks[1]["before_average"]
    assert ranks[0]["after"] == ranks[1]["after"]
    assert ranks[0]["after"] == pytest.approx(
        [(a + b) / 2 for a, b in zip(ranks[0]["before_average"], ranks[1]["before_average"])]
    )
    assert out.count("logged by the main process") == 1 and out.count("logged by every process") == 2
