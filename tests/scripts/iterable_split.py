"""Run under torchrun (gloo, 2 ranks) by tests/trainer/test_iterable_split.py.

IterableDatasets through Accelerator.prepare on two processes, split (dispatch_batches=False) and
dispatched (dispatch_batches=None/True); rank 0 writes what every rank saw to argv[1].
"""

import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainforge import Accelerator, ConfigurationError, Trainer, TrainingModule


class Naive(IterableDataset):
    """Counts 0..n-1 (does not know about workers or ranks)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class WorkerAware(Naive):
    """Splits itself between DataLoader workers, as torch asks."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, self.n, workers))


class Stateful(Naive):
    """Resumes without re-reading; counts what it reads (in this process)."""

    def __init__(self, n):
        super().__init__(n)
        self.pos, self.reads = 0, 0

    def __iter__(self):
        while self.pos < self.n:
            self.reads += 1
            self.pos += 1
            yield self.pos - 1

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class Records(IterableDataset):
    """Dict samples with a 2-d tensor and a list of tensors (nested batches for the dispatcher)."""

    def __iter__(self):
        for i in range(7):
            yield {"x": torch.full((2,), float(i)), "pair": [torch.tensor(i), torch.tensor(-i)]}


def epoch(acc, loader):
    """Per-rank batches and the gather_for_metrics of every step (ids)."""
    mine, gathered = [], []
    for batch in loader:
        mine.append(batch.tolist())
        gathered.extend(acc.gather_for_metrics(batch).tolist())
    return mine, gathered


class Pairs(IterableDataset):
    """(x, y) regression pairs with no __len__: the Trainer learns the epoch's end when it comes."""

    def __iter__(self):
        for i in range(11):
            yield torch.full((2,), float(i)), torch.tensor([float(i)])


class Recorder(TrainingModule):
    def __init__(self):
        super().__init__()
        self.net, self.seen, self.val_seen, self.ends = nn.Linear(2, 1), [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((self.trainer.current_epoch, x[:, 0].long().tolist()))
        self.ends.append(self.trainer.accelerator.gradient_state.end_of_dataloader)
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.val_seen.append(batch[0][:, 0].long().tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def via_trainer(root):
    module = Recorder()
    trainer = Trainer(
        max_epochs=2,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(Pairs(), batch_size=3), DataLoader(Pairs(), batch_size=3))
    return {
        "seen": module.seen,
        "val_seen": module.val_seen,
        "ends": module.ends,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


def trainer_resume(root):
    """Stopped after one step, checkpointed, resumed: the rest of the epoch, nothing repeated."""
    first = Recorder()
    trainer = Trainer(
        max_steps=1,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(first, DataLoader(Pairs(), batch_size=3))
    trainer.save_checkpoint(root + "/step1")
    rest = Recorder()
    Trainer(
        max_epochs=1,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    ).fit(rest, DataLoader(Pairs(), batch_size=3), ckpt_path=root + "/step1")
    return first.seen + rest.seen


class PairsByRank(Pairs):
    """Shards itself by rank without saying so (shards_by_rank): the Trainer's split must refuse it."""

    def __iter__(self):
        for i in range(dist.get_rank(), 11, dist.get_world_size()):
            yield torch.full((2,), float(i)), torch.tensor([float(i)])


def trainer_by_rank(root):
    try:
        Trainer(
            max_epochs=1,
            default_root_dir=root,
            enable_progress_bar=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
        ).fit(Recorder(), DataLoader(PairsByRank(), batch_size=3))
    except ConfigurationError as e:
        return str(e)
    return "trained"


def main(out_path):  # noqa: PLR0915 - one rank's scenario, read top to bottom
    rec = {
        "trainer": via_trainer(out_path + ".trainer"),
        "trainer_resume": trainer_resume(out_path + ".resume"),
        "trainer_by_rank": trainer_by_rank(out_path + ".by_rank"),
    }
    for name, ds, workers in (
        ("naive", Naive(11), 0),
        ("naive_workers", Naive(11), 2),
        ("aware_workers", WorkerAware(11), 2),
    ):
        acc = Accelerator(dispatch_batches=False)
        rec[f"split_{name}"] = epoch(acc, acc.prepare(DataLoader(ds, batch_size=3, num_workers=workers)))
    acc = Accelerator()  # dispatch_batches=None: an IterableDataset is dispatched, as in Accelerate
    rec["dispatch_default"] = epoch(acc, acc.prepare(DataLoader(Naive(11), batch_size=3)))

    class Config:  # the shape of accelerate's DataLoaderConfiguration
        dispatch_batches, even_batches, split_batches = True, False, False

    acc = Accelerator(dataloader_config=Config())
    rec["dispatch_uneven"] = [b.tolist() for b in acc.prepare(DataLoader(Naive(11), batch_size=3))]
    rec["dispatch_uneven_empty"] = [b.tolist() for b in acc.prepare(DataLoader(Naive(7), batch_size=3))]
    acc = Accelerator(dispatch_batches=False, even_batches=False)
    rec["split_uneven"] = [b.tolist() for b in acc.prepare(DataLoader(Naive(11), batch_size=3))]
    acc = Accelerator(dispatch_batches=False)
    rec["split_drop_last"] = epoch(acc, acc.prepare(DataLoader(Naive(11), batch_size=3, drop_last=True)))
    acc = Accelerator(dispatch_batches=True, split_batches=True)
    rec["dispatch_split_batches"] = epoch(acc, acc.prepare(DataLoader(Naive(11), batch_size=4)))
    acc = Accelerator(dispatch_batches=True)
    rec["dispatch_nested"] = [
        {"x": b["x"].tolist(), "pair": [t.tolist() for t in b["pair"]]}
        for b in acc.prepare(DataLoader(Records(), batch_size=2))
    ]
    acc = Accelerator(dispatch_batches=True)  # a map-style dataset can be dispatched too
    rec["dispatch_map"] = epoch(acc, acc.prepare(DataLoader(list(range(10)), batch_size=2)))
    # Mid-epoch save_state/load_state, split (Stateful: no re-reading) and dispatched.
    for mode, dispatch in (("split", False), ("dispatch", True)):
        full_acc = Accelerator(dispatch_batches=dispatch)
        rec[f"{mode}_uninterrupted"] = [b.tolist() for b in full_acc.prepare(DataLoader(Stateful(23), batch_size=2))]
        acc = Accelerator(dispatch_batches=dispatch)
        loader = acc.prepare(DataLoader(Stateful(23), batch_size=2))
        first = []
        for batch in loader:
            first.append(batch.tolist())
            if len(first) == 2:
                acc.save_state(out_path + f".{mode}")
                break
        fresh = Accelerator(dispatch_batches=dispatch)
        stream = Stateful(23)
        resumed_loader = fresh.prepare(DataLoader(stream, batch_size=2))
        fresh.load_state(out_path + f".{mode}")
        rec[f"{mode}_resumed"] = (first, [b.tolist() for b in resumed_loader], stream.reads)
    # Not Stateful: the position comes back by re-reading, and a warning says so.
    acc = Accelerator(dispatch_batches=False)
    loader = acc.prepare(DataLoader(Naive(20), batch_size=2))
    iterator = iter(loader)
    next(iterator)
    acc.save_state(out_path + ".naive")
    fresh = Accelerator(dispatch_batches=False)
    resumed_loader = fresh.prepare(DataLoader(Naive(20), batch_size=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state(out_path + ".naive")
    rec["naive_resume"] = ([b.tolist() for b in resumed_loader], [str(w.message) for w in caught])

    # A dataset that shards itself by rank without saying so: the split would repeat and lose samples.
    class ByRank(Naive):
        def __iter__(self):
            return iter(range(dist.get_rank(), self.n, dist.get_world_size()))

    acc = Accelerator(dispatch_batches=False)
    try:
        rec["by_rank"] = [b.tolist() for b in acc.prepare(DataLoader(ByRank(8), batch_size=2))]
    except ConfigurationError as e:
        rec["by_rank"] = str(e)
    # A dataset that shards itself opts out: iterated as is on every rank.
    ds = WorkerAware(6)
    ds.shards_by_rank = True
    acc = Accelerator(dispatch_batches=False)
    rec["opt_out"] = [b.tolist() for b in acc.prepare(DataLoader(ds, batch_size=3))]
    rec["rank"] = dist.get_rank()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rec)
    if dist.get_rank() == 0:
        torch.save(gathered, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
