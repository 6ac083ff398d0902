"""Out-of-memory agreement between processes, for the batch-size finders (``find_executable_batch_size``,
``Tuner.scale_batch_size``): after each attempt every process says how it went (``OK``, ``OOM`` or
``FAILED``) and all of them take the worst outcome of any process, so that an out-of-memory error on one
rank lowers the batch size on every rank together, and a rank whose attempt ran does not go on into the
next collective while another is retrying. One process (no process group): its own outcome."""

from __future__ import annotations

import torch

OK, OOM, FAILED = 0, 1, 2
OUTCOMES = {OK: "ran", OOM: "ran out of memory", FAILED: "raised an error"}


def agree_on_outcome(outcome: int) -> int:
    """The worst ``outcome`` of every process (a MAX all-reduce of one number; a collective: every process
    of the default group must call it once per attempt). Without a process group: ``outcome`` itself."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return outcome
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([outcome], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
