"""IterableDatasets on several processes, as Accelerate users expect (issue 9): the stream is split
between ranks without rank logic in the dataset (Accelerate ``IterableDatasetShard``, tests/test_data_loader.py
``test_iterable_dataset_shard``), or read by rank 0 and dispatched (``DataLoaderDispatcher``,
``dispatch_batches``; Accelerate's default for an IterableDataset); ``gather_for_metrics`` counts every
sample once (test_utils/scripts/test_distributed_data_loop.py); both resume mid-epoch."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tests.helpers import forklaunch
from trainforge import Accelerator, ConfigurationError
from trainforge.strategies.data.iterable import fingerprint
from trainforge.strategies.data.loader import prepare_dataloader
from trainforge.trainer.accelerator.batch_dispatch import BatchDispatcher
from trainforge.trainer.loop.settings import limited

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "iterable_split.py"


class Count(IterableDataset):
    def __init__(self, n, aware=False):
        self.n, self.aware = n, aware

    def __iter__(self):
        info = get_worker_info() if self.aware else None
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, self.n, workers))


class Counted(Count):
    def __len__(self):
        return self.n


class Resumable(Count):
    def __init__(self, n):
        super().__init__(n)
        self.pos, self.reads = 0, 0

    def __iter__(self):
        while self.pos < self.n:
            self.reads, self.pos = self.reads + 1, self.pos + 1
            yield self.pos - 1

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def _ranks(dataset_fn, world, **kwargs):
    """Every rank's batches, each rank prepared in this process (the split needs no process group)."""
    even = kwargs.pop("even_batches", True)
    loaders = [
        prepare_dataloader(DataLoader(dataset_fn(), **kwargs), rank=r, world_size=world, even_batches=even)
        for r in range(world)
    ]
    return [[getattr(b, "tolist", lambda: b)() for b in loader] for loader in loaders]


@pytest.mark.parametrize(
    "n,batch,world,workers,aware",
    [(11, 3, 2, 0, False), (11, 3, 3, 2, False), (20, 2, 2, 2, True), (3, 2, 3, 0, False)],
)
def test_split_reads_each_sample_once_padding_repeats_the_epochs_start(n, batch, world, workers, aware):
    """Accelerate IterableDatasetShard: batch-level round robin; the last round is completed with the
    stream's first samples so every rank gets the same full batches. With workers (a dataset that splits
    itself between them or not) nothing is read twice."""
    per_rank = _ranks(lambda: Count(n, aware), world, batch_size=batch, num_workers=workers)
    assert len({len(r) for r in per_rank}) == 1 and all(len(b) == batch for r in per_rank for b in r)
    step_major = [x for step in zip(*per_rank) for b in step for x in b]  # the rank-major gather of each step
    assert step_major[:n] == list(range(n))  # stream order; the duplicates are the tail
    first_round = min(n, batch * world)  # the stream's first round (the incomplete one itself when it is first)
    assert step_major[n:] == [i % first_round for i in range(len(step_major) - n)]
    uneven = _ranks(lambda: Count(n, aware), world, batch_size=batch, num_workers=workers, even_batches=False)
    assert sorted(x for r in uneven for b in r for x in b) == list(range(n))
    dropped = _ranks(lambda: Count(n, aware), world, batch_size=batch, num_workers=workers, drop_last=True)
    flat = sorted(x for r in dropped for b in r for x in b)
    assert flat == list(range(n // (batch * world) * batch * world))


def test_split_length_batch_size_none_and_opt_out():
    """__len__ per rank when the dataset has one; batch_size=None splits items; shards_by_rank opts out."""
    for even in (True, False):
        for rank in range(3):
            loader = prepare_dataloader(
                DataLoader(Counted(10), batch_size=3), rank=rank, world_size=3, even_batches=even
            )
            assert len(loader) == len(list(loader))
    items = _ranks(lambda: Count(5), 2, batch_size=None)
    assert items == [[0, 2, 4], [1, 3, 0]]  # the last round [4] completed with the first one's start
    own = Count(4)
    own.shards_by_rank = True
    loader = prepare_dataloader(DataLoader(own, batch_size=2), rank=1, world_size=2)
    assert loader.kind == "iterable" and [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_split_stream_resumes_without_rereading_a_stateful_dataset():
    """The position of a Stateful dataset is restored (no re-reading); the loader's own state_dict. The last
    round is completed with the first one, read again from the dataset's state at the epoch's start."""
    loader = prepare_dataloader(DataLoader(Resumable(13), batch_size=2, num_workers=0), rank=1, world_size=2)
    it = iter(loader)
    seen = [next(it).tolist(), next(it).tolist()]
    state = loader.state_dict()
    stream = Resumable(13)
    again = prepare_dataloader(DataLoader(stream, batch_size=2), rank=1, world_size=2)
    again.load_state_dict(state)
    rest = [b.tolist() for b in again]
    assert seen == [[2, 3], [6, 7]] and rest == [[10, 11], [1, 2]]  # [12] + the first round's [0, 1, 2]
    assert stream.reads == 13 - 8 + 4  # read from sample 8 on, then the first round (4 samples) for the padding


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dispatch_batches": "yes"}, r"dispatch_batches='yes' must be None .*True or False"),
        ({"dispatch_batches": 1}, r"dispatch_batches=1 must be None"),
        ({"even_batches": None}, r"even_batches=None must be True or False"),
        ({"split_batches": "no"}, r"split_batches='no' must be True or False"),
        ({"dataloader_config": object()}, r"dataloader_config=.* has none of even_batches, split_batches, "),
    ],
)
def test_bad_data_options_are_refused_before_any_work(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        Accelerator(**kwargs)


def test_a_bad_value_set_after_construction_is_refused_at_prepare():
    acc = Accelerator()
    acc.dispatch_batches = "no"  # the Trainer's users set it on trainer.accelerator
    with pytest.raises(ConfigurationError, match="dispatch_batches='no' must be None"):
        acc.prepare(DataLoader(Count(4), batch_size=2))


def test_dataloader_config_values_are_taken_and_one_process_never_dispatches():
    class Config:  # accelerate.DataLoaderConfiguration's attributes
        dispatch_batches, even_batches, split_batches = True, False, False

    acc = Accelerator(dataloader_config=Config())
    assert (acc.dispatch_batches, acc.even_batches, acc.split_batches) == (True, False, False)
    loader = acc.prepare(DataLoader(Count(5), batch_size=2))
    assert loader.dispatcher is None and [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]


def test_dispatcher_refuses_what_it_cannot_split_by_rows():
    """Strings, 0-d tensors and batches of different shapes get a clear error (on every rank: the
    message is broadcast)."""

    def first(batches):
        loader = prepare_dataloader(DataLoader(batches, batch_size=None), rank=0, world_size=1)
        dispatcher = BatchDispatcher(
            loader, rank=0, world_size=2, device=torch.device("cpu"), broadcast=lambda obj: obj
        )
        return next(iter(dispatcher))

    with pytest.raises(ConfigurationError, match=r"batch\['text'\] is a str.*dispatch_batches=False"):
        first([{"text": "a", "x": torch.zeros(2)}] * 2)
    with pytest.raises(ConfigurationError, match="0-d tensor"):
        first([torch.tensor(1.0)] * 2)
    with pytest.raises(ConfigurationError, match="shapes differ"):
        first([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ConfigurationError, match="different first dimensions"):
        first([(torch.zeros(2), torch.zeros(3))] * 2)
    piece, padding, _ = first([torch.arange(3), torch.arange(3, 5)])
    assert piece.tolist() == [0, 1, 2] and padding == 1
    piece, padding, _ = first([Pair(torch.arange(2), torch.ones(2, 3))] * 2)  # rank 0 of 2: the first batch
    assert type(piece) is Pair and piece.a.tolist() == [0, 1] and piece.b.shape == (2, 3) and padding == 0


def test_fingerprint_is_content_based():
    sample = {"x": torch.arange(4, dtype=torch.bfloat16), "id": 3, "t": torch.tensor(1.0), "o": object()}
    same = {"t": torch.tensor(1.0), "id": 3, "x": torch.arange(4, dtype=torch.bfloat16), "o": object()}
    assert fingerprint(sample) == fingerprint(same)
    assert fingerprint(sample) != fingerprint({**same, "id": 4})
    assert fingerprint(torch.zeros(2)) != fingerprint(torch.zeros(2, dtype=torch.float64))


def test_a_fraction_of_an_unknown_length_is_refused():
    assert limited(None, 1.0) == float("inf") and limited(None, 4) == 4
    with pytest.raises(ConfigurationError, match=r"limit_train_batches=0\.5 is a fraction .* no length"):
        limited(None, 0.5)


@pytest.mark.slow
def test_two_processes_split_dispatch_gather_resume_and_trainer(tmp_path):
    out = tmp_path / "records.pt"
    forklaunch.launch(SCRIPT, out, timeout=240)
    r0, r1 = torch.load(out, weights_only=True)
    everything = list(range(11))
    # Split (with and without workers, naive or worker-aware datasets) and dispatch: each sample on one
    # rank; the padded last step repeats the epoch's first samples (as Accelerate's IterableDatasetShard and
    # DataLoaderDispatcher); gather_for_metrics returns each once.
    expected = ([[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 0]])
    for key in ("split_naive", "split_naive_workers", "split_aware_workers", "dispatch_default"):
        assert (r0[key][0], r1[key][0]) == expected, key
        assert r0[key][1] == r1[key][1] == everything, key
    # even_batches=False: no duplicates, the last rank's last batch is short (split and dispatched alike)
    assert r0["split_uneven"] == r0["dispatch_uneven"] == [[0, 1, 2], [6, 7, 8]]
    assert r1["split_uneven"] == r1["dispatch_uneven"] == [[3, 4, 5], [9, 10]]
    assert (r0["dispatch_uneven_empty"], r1["dispatch_uneven_empty"]) == ([[0, 1, 2], [6]], [[3, 4, 5]])
    # drop_last: the incomplete last round is dropped on every rank
    assert (r0["split_drop_last"], r1["split_drop_last"]) == (
        ([[0, 1, 2]], list(range(6))),
        ([[3, 4, 5]], list(range(6))),
    )
    # split_batches: rank 0 reads one batch of 4 and each rank takes 2 rows; the last 3 rows are padded
    assert r0["dispatch_split_batches"][0] == [[0, 1], [4, 5], [8, 9]]
    assert r1["dispatch_split_batches"][0] == [[2, 3], [6, 7], [10, 0]]
    assert r0["dispatch_split_batches"][1] == everything
    # nested dicts/lists of tensors are dispatched; a map-style dataset too (last group of 2 rows: 1 each)
    assert r1["dispatch_nested"][1] == {"x": [[6.0, 6.0], [0.0, 0.0]], "pair": [[6, 0], [-6, 0]]}  # + first row
    assert r0["dispatch_nested"][0]["pair"] == [[0, 1], [0, -1]]
    assert r0["dispatch_map"] == ([[0, 1], [4, 5], [8]], list(range(10)))
    assert r1["dispatch_map"][0] == [[2, 3], [6, 7], [9]]
    # save_state mid-epoch, load_state into fresh objects: the rest is the uninterrupted run's; a Stateful
    # dataset is not read again (split: every rank reads from sample 8; dispatched: only rank 0 reads)
    # (split: the first round, 4 samples, read again for the last one's padding)
    for mode, reads in (("split", (19, 19)), ("dispatch", (15, 0))):
        for rec, read in zip((r0, r1), reads):
            first, rest, stream_reads = rec[f"{mode}_resumed"]
            assert first + rest == rec[f"{mode}_uninterrupted"], mode
            assert stream_reads == read, mode
    rest, messages = r0["naive_resume"]
    assert rest == [[4, 5], [8, 9], [12, 13], [16, 17]] and r1["naive_resume"][0][0] == [6, 7]
    assert any("not restored from the checkpoint but by reading again the 1 batch" in m for m in messages)
    assert r0["opt_out"] == r1["opt_out"] == [[0, 1, 2], [3, 4, 5]]
    for rec in (r0, r1):  # sharded by rank without saying so: refused on every rank, not silently wrong
        assert "ByRank yields different samples on different processes" in rec["by_rank"]
        assert "shards_by_rank = True" in rec["by_rank"]
    # The Trainer takes the same path (split by default), with a loader that has no length: the
    # epoch ends when the data does, the last batch is flagged, validation sees its share.
    for rec, batches in ((r0, [[0, 1, 2], [6, 7, 8]]), (r1, [[3, 4, 5], [9, 10, 0]])):
        t = rec["trainer"]
        assert t["seen"] == [(e, b) for e in (0, 1) for b in batches]
        assert t["ends"] == [False, True, False, True] and (t["epoch"], t["global_step"]) == (2, 4)
        assert t["val_seen"] == batches * 2
        assert rec["trainer_resume"] == [(0, b) for b in batches]  # fit(ckpt_path=) after one step: the rest
        # split, not dispatched: a stream sharded by rank is refused, never trained on rank 0's shard alone
        assert "PairsByRank yields different samples on different processes" in rec["trainer_by_rank"]


def test_a_stream_saved_on_its_last_batch_starts_the_next_epoch_afresh():
    """Saved inside the loop on an epoch's last batch (the loader reads one ahead, so the position is
    the last batch's), then resumed straight into the next epoch (the Trainer does, after the pending
    epoch end): that epoch reads the whole stream, not the restored end of the previous one."""
    acc = Accelerator()
    loader = acc.prepare(DataLoader(Count(6), batch_size=2))
    for i, _ in enumerate(loader):
        assert acc.gradient_state.end_of_dataloader == (i == 2)  # known before the loop body sees it
        if i == 2:
            state = loader.state_dict()
    assert state["batch_in_epoch"] == 3
    with pytest.warns(UserWarning, match="reading again the 3 batch"):
        again = Accelerator().prepare(DataLoader(Count(6), batch_size=2))
        again.load_state_dict(state, world_size=1, rank=0)
    again.set_epoch(1)
    assert [b.tolist() for b in again] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.slow
@pytest.mark.parametrize("case,ended", [("longer", "rank 0 after 2 batch(es)"), ("empty", "rank 1 after 0 batch(es)")])
def test_ranks_with_different_numbers_of_batches_stop_with_an_error_instead_of_hanging(case, ended, tmp_path):
    """Without the check these would hang until the process-group timeout (30 min)."""
    out = forklaunch.launch(SCRIPT.parent / "uneven_streams.py", case, tmp_path, timeout=120, check=False)
    assert out.returncode != 0 and "finished" not in out.stdout
    assert f"ran out of data on {ended} while rank(s)" in out.stdout, out.stdout[-3000:]
