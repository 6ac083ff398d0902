"""MegatronStrategy (TP=2) checkpointing to object storage, for tests/strategies/test_checkpoint_remote.py.

    python remote_megatron.py URL OUT       # 2 ranks (forklaunch): saves URL at step 3, resumes from it

Every rank's DCP shard of the tensor-parallel state goes through the staging dir and the upload; rank 0
writes OUT.json with the resumed run's losses and weights compared with the uninterrupted run's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_common import LitLM, full_state, loader, make_trainer, write_json
from megatron_train import PLAN, SaveAt

from trainforge.strategies.megatron import MegatronStrategy


def main() -> None:
    url, out = sys.argv[1], Path(sys.argv[2])
    module = LitLM()
    strategy = MegatronStrategy(tensor_parallel_size=2, tp_plan=PLAN)
    trainer = make_trainer(strategy, out.parent / "run", 6, callbacks=[SaveAt(3, url)])
    trainer.fit(module, loader(4))
    full = full_state(trainer)
    module2 = LitLM()
    trainer2 = make_trainer(MegatronStrategy(tensor_parallel_size=2, tp_plan=PLAN), out.parent / "resumed", 6)
    trainer2.fit(module2, loader(4), ckpt_path=url)
    resumed = full_state(trainer2)
    if trainer.is_global_zero:
        same = sorted(full) == sorted(resumed) and all(bool((full[k] == resumed[k]).all()) for k in full)
        write_json(out, {"losses_equal": module2.losses == module.losses[3:], "weights_equal": same})


if __name__ == "__main__":
    main()
