"""A background checkpoint write that fails (for tests/trainer/test_async_checkpoint.py).

    python tests/scripts/async_fail_run.py ROOT

Asynchronous saves every step into ROOT/checkpoints. Once the step-1 checkpoint is committed, the
process's file size limit (RLIMIT_FSIZE) drops to 4 KB, so the background write of the step-2
weights fails with EFBIG ("File too large"), as a full disk would with ENOSPC. The error must
reach the main thread as a CheckpointError; this script prints it and exits with status 3.
"""

import os
import resource
import signal
import sys

from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import CheckpointError, Trainer, seed_everything
from trainforge.callbacks import Callback, ModelCheckpoint


class FillTheDisk(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 1:  # the batch of step 2: ModelCheckpoint staged step 1 at its batch end
            trainer.accelerator.wait_for_checkpoint()
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def main() -> None:
    root = sys.argv[1]
    seed_everything(0)
    trainer = Trainer(
        max_steps=4,
        default_root_dir=root,
        enable_progress_bar=False,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), every_n_steps=1, async_save=True),
            FillTheDisk(),
        ],
    )
    try:
        trainer.fit(Regressor(make_net(dim=64)), DataLoader(regression_data(dim=64), batch_size=4))
    except CheckpointError as e:
        print(f"CheckpointError: {e}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
