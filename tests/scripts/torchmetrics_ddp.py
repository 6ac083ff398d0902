"""Launched on 2 processes: tests/trainer/test_torchmetrics.py's Classifier under DDP (gloo). Each
rank writes what it predicted (counted by hand) and what was logged to OUT.<rank>.json."""

import json
import os
import sys

from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.trainer.test_torchmetrics import Classifier, class_data
from trainforge import Trainer
from trainforge.strategies import DDPStrategy


def main(out):
    module = Classifier()
    trainer = Trainer(
        strategy=DDPStrategy(),
        max_epochs=2,
        num_sanity_val_steps=1,
        limit_val_batches=2,
        default_root_dir=out + ".root",
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(class_data(1, 64), batch_size=8), DataLoader(class_data(2, 48), batch_size=8))
    with open(f"{out}.{trainer.global_rank}.json", "w") as f:
        json.dump({"val_runs": module.val_runs, "train_epochs": module.train_epochs}, f)


if __name__ == "__main__":
    main(sys.argv[1])
