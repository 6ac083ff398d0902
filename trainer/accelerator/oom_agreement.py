"""Out-of-memory agreement between processes, for the batch-size finders (``find_executable_batch_size``,
``Tuner.scale_batch_size``): after each attempt every process says how it went (``OK``, ``OOM`` or
``FAILED``) and all of them take the worst outcome of any process, so that an out-of-memory error on one
rank lowers the batch size on every rank together, and a rank whose attempt ran does not go on into the
next collective while another is retrying. One process: its own outcome.

Under a launcher, before any process group exists (``find_executable_batch_size`` before the Accelerator),
the processes agree through the launcher's store (torchrun's agent hosts one: ``TORCHELASTIC_USE_AGENT_STORE``);
without one they cannot agree, and several processes are refused rather than left to pick different sizes."""

from __future__ import annotations

import itertools
import os
from datetime import timedelta
from typing import Any, Optional

import torch

from trainforge.strategies.errors import ConfigurationError

OK, OOM, FAILED = 0, 1, 2
OUTCOMES = {OK: "ran", OOM: "ran out of memory", FAILED: "raised an error"}


def agree_on_outcome(outcome: int) -> int:
    """The worst ``outcome`` of every process (a MAX all-reduce of one number; a collective: every process
    of the default group must call it once per attempt). Without a process group: ``outcome`` itself."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return _agree_without_group(outcome)
    if dist.get_world_size() == 1:
        return outcome
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([outcome], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


# the launcher's store, connected on first use; each agreement's keys carry a call number (every process
# makes the same calls in the same order)
_store: Any = None
_calls = itertools.count()
STORE_TIMEOUT = timedelta(minutes=30)  # as long as a collective waits (torch's default process-group timeout)


def _agree_without_group(outcome: int) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return outcome
    store = _launcher_store()
    rank = int(os.environ.get("RANK", "0"))
    if store is None:
        raise ConfigurationError(
            f"out-of-memory agreement on rank {rank} of WORLD_SIZE={world} before any process group exists and "
            "without a launcher's store: the ranks would each pick their own batch size. Create the Accelerator "
            "(or the Trainer) first, which starts the process group, then search; or start the job with "
            "`trainforge launch` (torchrun), whose store the ranks agree through"
        )
    prefix = f"trainforge/oom/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_calls)}/"
    store.set(f"{prefix}{rank}", str(outcome))
    keys = [f"{prefix}{r}" for r in range(world)]
    store.wait(keys, STORE_TIMEOUT)
    return max(int(store.get(key)) for key in keys)


def _launcher_store() -> Optional[Any]:
    """A client of the store torchrun's agent hosts, or None where no launcher hosts one."""
    global _store
    if _store is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr and port:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            _store = torch.distributed.TCPStore(addr, int(port), world, is_master=False, timeout=STORE_TIMEOUT)
    return _store
