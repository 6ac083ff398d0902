"""notebook_launcher: real forked processes, gloo all_reduce, failures re-raised with the rank."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainforge.strategies.errors import ConfigurationError, LaunchError
from trainforge.trainer.cluster.notebook import notebook_launcher


@pytest.mark.slow
def test_two_processes_all_reduce_and_write_per_rank_files(tmp_path, capfd):
    scale = 10.0

    def train(out_dir):  # a local closure: cannot be pickled, so this only works when forked
        dist.init_process_group("gloo", init_method="env://")
        rank = dist.get_rank()
        print(f"hello from rank {rank}\n", end="", flush=True)  # one write: lines from 2 processes cannot interleave
        value = torch.tensor([scale * (rank + 1)])
        dist.all_reduce(value)
        record = {
            "rank": rank,
            "world": dist.get_world_size(),
            "sum": value.item(),
            "local_rank": os.environ["LOCAL_RANK"],
            "local_world": os.environ["LOCAL_WORLD_SIZE"],
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
        dist.destroy_process_group()

    before = dict(os.environ)
    assert notebook_launcher(train, args=(str(tmp_path),), num_processes=2, timeout=60) is None
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"], r["local_rank"], r["local_world"]) for r in records] == [
        (0, 2, "0", "2"),
        (1, 2, "1", "2"),
    ]
    assert all(r["sum"] == scale * 1 + scale * 2 for r in records)
    assert dict(os.environ) == before  # the rendezvous variables were only set for the children
    printed = capfd.readouterr().out.splitlines()  # children write to the parent's stdout
    assert sorted(line for line in printed if line.startswith("hello from")) == [
        "hello from rank 0",
        "hello from rank 1",
    ]


@pytest.mark.slow
def test_failing_rank_is_raised_in_parent_with_its_rank_and_traceback():
    def train():
        if int(os.environ["RANK"]) == 1:
            raise ValueError("bad batch on rank one")
        import time

        time.sleep(60)  # rank 0 would hang: the launcher must stop it

    with pytest.raises(LaunchError, match="rank 1 of 2 failed") as info:
        notebook_launcher(train, num_processes=2, timeout=60)
    assert "ValueError: bad batch on rank one" in str(info.value)
    assert "Traceback" in str(info.value)


def test_one_process_runs_in_process():
    seen = []
    assert notebook_launcher(seen.append, args=("here",), num_processes=1) is None
    assert seen == ["here"]


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigurationError, match="num_processes=0 must be an integer >= 1"):
        notebook_launcher(print, num_processes=0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"master_port={port} is already in use"):
            notebook_launcher(print, num_processes=2, master_port=port)
