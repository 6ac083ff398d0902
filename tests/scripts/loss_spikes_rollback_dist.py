"""Launched on 2 processes (gloo, DDP): LossSpikes(rollback_after=2) with an injected NaN loss on rank 0
(batch 5) and a loss spike on rank 1 (batch 6) in epoch 0, ModelCheckpoint every 2 steps. Both ranks skip
both steps and roll back to the step-4 checkpoint together; epoch 1 trains on. Then a second fit resumes
from the checkpoint written after the rollback (epoch 1, step 6) and must end on the same weights.
Rank 0 writes to OUT per rank [rollbacks, skipped steps, global step at epoch 0's end], whether each
rank's weights right after the rollback equal the checkpoint's, and the resume's outcome.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/loss_spikes_rollback_dist.py OUT [ddp|fsdp]

Under fsdp the checkpoint is sharded (dcp/) and the rollback's load is DCP's, into the live optimizer state;
the weights after the rollback are compared with a Trainer-free read of the same checkpoint instead."""

import json
import math
import os
import sys

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers.models import Regressor, make_net, regression_data
from trainforge import Trainer, seed_everything
from trainforge.callbacks import Callback, LossSpikes, ModelCheckpoint


class Injected(Regressor):
    """Epoch 0: a NaN loss on rank 0 at batch 5, a loss x 1e4 on rank 1 at batch 6."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        rank = torch.distributed.get_rank()
        if self.current_epoch == 0 and (batch_idx, rank) == (5, 0):
            return loss * math.nan
        if self.current_epoch == 0 and (batch_idx, rank) == (6, 1):
            return loss * 1e4
        return loss


def full_state(module):
    """Every weight as a full tensor (gathered from the shards under FSDP2: a collective)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


class Probe(Callback):
    def __init__(self, spikes):
        self.spikes, self.restored, self.at_step4, self.epoch0_step = spikes, None, None, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 4 and self.at_step4 is None:  # the batch end the step-4 checkpoint is written at
            self.at_step4 = full_state(module)
        if self.spikes.rollbacks and self.restored is None:
            self.restored = full_state(module)

    def on_train_epoch_end(self, trainer, module):
        if self.epoch0_step is None:
            self.epoch0_step = trainer.global_step


def fit(root, strategy, ckpt_path=None):
    seed_everything(0)
    spikes = LossSpikes(threshold=10.0, window=2, rollback_after=2)
    probe = Probe(spikes)
    module = Injected(make_net(dropout=0.1), step_lr=True)
    trainer = Trainer(
        strategy=strategy,
        max_epochs=2,
        callbacks=[spikes, probe, ModelCheckpoint(every_n_steps=2)],
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,  # checkpoints in <root>/checkpoints (a logger's would be in its version folder)
    )
    trainer.fit(module, DataLoader(regression_data(n=64), batch_size=4), ckpt_path=ckpt_path)
    return trainer, module, spikes, probe


def main(out, strategy):
    trainer, module, spikes, probe = fit(out + ".whole", strategy)
    if strategy == "ddp":  # the consolidated file; under fsdp the weights the checkpoint was written from
        saved = load_file(os.path.join(out + ".whole", "checkpoints", "epoch=0-step=4", "model.safetensors"))
    else:
        saved = probe.at_step4
    restored_equal = probe.restored is not None and all(torch.equal(saved[k], probe.restored[k]) for k in saved)
    weights = torch.cat([v.flatten() for v in full_state(module).values()])
    both = trainer.strategy.all_gather(weights)
    row = [spikes.rollbacks, spikes.skipped_steps, probe.epoch0_step]
    rows = trainer.strategy.all_gather_object(row)
    equal = trainer.strategy.all_gather_object(restored_equal)
    after = os.path.join(out + ".whole", "checkpoints", "epoch=1-step=6")
    resumed, resumed_module, _, _ = fit(out + ".resumed", strategy, ckpt_path=after)
    same = all(torch.equal(p, q) for p, q in zip(full_state(resumed_module).values(), full_state(module).values()))
    if trainer.is_global_zero:
        result = {
            "rows": rows,
            "restored_equal": equal,
            "agree": bool(torch.equal(both[0], both[1])),
            "finite": bool(weights.isfinite().all()),
            "resumed_equal": same,
            "final_step": trainer.global_step,
            "resumed_step": resumed.global_step,
        }
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ddp")
