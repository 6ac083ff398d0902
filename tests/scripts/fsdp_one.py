"""One process: resume the 2-rank sharded checkpoint and measure one rank's state bytes.

    python tests/scripts/fsdp_one.py OUT      # after fsdp_train.py wrote OUT/ckpt/step-10

No launcher: the single-process environment starts a world of 1 on a free port. The global batch
stays 8 (one process, batch 8 instead of two of 4), so the data continues at the same samples.
Writes ``OUT/one.json`` and ``OUT/one_final.safetensors``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_common import fit, full_state, write_json
from safetensors.torch import save_file

from trainforge.strategies import FSDPStrategy
from trainforge.strategies.fsdp import local_state_bytes


def main(out: Path) -> None:
    trainer, module = fit(FSDPStrategy(), out / "one", ckpt_path=str(out / "ckpt" / "step-10"), batch_size=8)
    assert trainer.world_size == 1, trainer.world_size
    save_file({k: v.contiguous() for k, v in full_state(trainer).items()}, str(out / "one_final.safetensors"))
    write_json(
        out / "one.json",
        {
            "losses": module.losses,
            "global_step": trainer.global_step,
            "memory": local_state_bytes(trainer.model, trainer.optimizers),
        },
    )
    trainer.strategy.teardown()
    print("one ok", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
