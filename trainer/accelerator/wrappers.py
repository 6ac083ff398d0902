"""The objects ``Accelerator.prepare`` hands back: they look like what the user passed in."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from trainforge.strategies.data.utils import move_to_device
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.seed import raw_rng_state, rng_state, set_rng_state

log = logging.getLogger("trainforge")


@dataclass
class GradientState:
    """Shared by the Accelerator and its prepared objects: is this micro-batch a sync step?"""

    sync_gradients: bool = True
    end_of_dataloader: bool = False
    padding: int = 0  # duplicates the sampler added at the end of this epoch (dropped by gather_for_metrics)
    # Where they sit in the rank-major gather of the last batch: "strided" (a sampler deals samples to ranks in
    # turn: the last sample of the last ranks) or "contiguous" (a split stream or dispatched batches: the tail).
    padding_order: str = "strided"
    # Accelerate's ``remainder``: samples in the epoch's last global batch (len % (batch x processes)), -1
    # when unknown (no length, drop_last, a stream or dispatched batches); gather_for_metrics keeps that many
    # rows of the last batch, however many rows a sample produced (the `loss.repeat(batch_size)` pattern).
    remainder: int = -1
    active_dataloaders: int = 0  # prepared loaders being iterated now (outside any, gather_for_metrics = gather)


class PreparedOptimizer(torch.optim.Optimizer):
    """Steps and zeroes only on sync steps of gradient accumulation; otherwise the wrapped optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Any, gradient_state: GradientState) -> None:
        # Deliberately no super().__init__: this is a view of ``optimizer``, sharing its state.
        self.optimizer, self.strategy, self.gradient_state = optimizer, strategy, gradient_state
        self.step_count = 0  # optimizer steps taken (saved by Accelerator.save_state as the run's global step)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> Any:
        if self.gradient_state.sync_gradients:
            self.step_count += 1
            return self.strategy.optimizer_step(self.optimizer)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"Prepared({self.optimizer!r})"


class PreparedScheduler:
    """Steps only when the optimizer really stepped (a sync step of accumulation)."""

    def __init__(self, scheduler: Any, gradient_state: GradientState, steps_per_call: int = 1) -> None:
        self.scheduler, self.gradient_state = scheduler, gradient_state
        # Accelerate steps a prepared scheduler once per process per optimizer step (unless
        # split_batches), so a schedule written for one process keeps its length in samples.
        self.steps_per_call = steps_per_call

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.gradient_state.sync_gradients:
            for _ in range(self.steps_per_call):
                self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


class PreparedDataLoader:
    """A sharded, resumable loader (``trainforge.strategies.data.loader``) that moves batches to the device, calls
    ``set_epoch`` for the user, and tells the Accelerator when an epoch's last batch arrives.

    ``batch_in_epoch`` counts batches handed out this epoch; with the global batch size preserved it
    is also the number of global steps into the epoch, whatever the number of processes."""

    def __init__(
        self,
        loader: Any,
        device: torch.device,
        gradient_state: GradientState,
        precision: Any,
        base_generator: Optional[torch.Generator] = None,
        order_generator: Optional[torch.Generator] = None,
        order_seed: Optional[int] = None,
        read_ahead: bool = False,
        broadcast: Optional[Callable[[Any], Any]] = None,
        dispatcher: Any = None,
        gather_object: Optional[Callable[[Any], List[Any]]] = None,
        device_batches: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        self.loader, self.device, self.gradient_state, self.precision = loader, device, gradient_state, precision
        self.dispatcher = dispatcher  # dispatch_batches=True: trainer.dispatch.BatchDispatcher over ``loader``
        self.gather_object = gather_object  # several processes: checks that a split stream is the same on all
        self._held_state: Optional[Dict[str, Any]] = None  # the loader's position at the batch handed out last
        # The strategy's own device loader (XLA's MpDeviceLoader) prefetches: the position saved is the one
        # recorded with each batch the loop received (held like a read-ahead's, in ``_held_state``).
        self.device_batches = device_batches
        # The user's DataLoader generator and RandomSampler generator (None: the global torch RNG).
        self.base_generator, self.order_generator, self.broadcast = base_generator, order_generator, broadcast
        self._generators_after: List[torch.Tensor] = []  # the user's generators after the epoch-start draws
        # use_seedable_sampler: epoch e's permutation from a generator seeded with order_seed + e (Accelerate's
        # SeedableRandomSampler, which reseeds the sampler's generator, the user's when it has one)
        self.order_seed = order_seed
        self.read_ahead = read_ahead  # Accelerate's one batch read ahead (``_reads_ahead``)
        # The process's RNG states before the batch read ahead was made (a collate or dataset drawing from the
        # global RNG drew there); saved with the position, and replayed by a resumed pass to make that batch again
        self._rng_before_ahead: Optional[Tuple[Any, ...]] = None
        self._replay_rng: Optional[Dict[str, Any]] = None
        self._skip = 0  # skip_first_batches: batches the next pass starts into the epoch
        self.epoch = 0
        self.batch_in_epoch = 0
        self._resumed = False

    def __len__(self) -> int:
        if self.dispatcher is None:
            return len(self.loader)
        batches = len(self.loader)  # the whole loader's, read by rank 0
        if self.dispatcher.split_batches:  # each is split between the ranks
            return batches
        world = self.dispatcher.world_size  # each step takes one batch per rank
        return batches // world if self.dispatcher.drop_last else -(-batches // world)

    def __getattr__(self, name: str) -> Any:  # dataset, batch_size, sampler, ...
        return getattr(self.loader, name)

    def set_epoch(self, epoch: int) -> None:
        if self._resumed and epoch != self.epoch and self.loader.kind != "map":
            # A stream's restored position belongs to the epoch being left (e.g. saved on its last batch):
            # the new epoch reads the stream afresh, as after an uninterrupted epoch. (Our sampler knows epochs.)
            self.loader.next_iter_state = None
        if epoch != self.epoch or not self._resumed:
            self.epoch, self._resumed, self.batch_in_epoch = epoch, False, 0

    def __iter__(self) -> Iterator[Any]:  # noqa: PLR0915 - a generator: its loader state lives in one frame
        from trainforge.strategies.data.loader import num_padding_samples, samples_in_last_batch

        if not self._resumed or self.batch_in_epoch == 0:  # a new epoch (also one resumed at its start)
            self.batch_in_epoch = 0
            self._replay_rng = None
            self._start_epoch()
            if self._skip:
                self._start_at(self._skip)
        self._skip = 0
        self._resumed = False
        self._held_state = self._rng_before_ahead = None
        contiguous = self.dispatcher is not None or self.loader.kind == "stream"
        try:
            total = -1 if contiguous or self._reads_ahead() else len(self.loader)
        except TypeError:  # an IterableDataset without __len__: the end is known only when it comes
            total = -1
        state = self.gradient_state
        state.padding = 0 if contiguous else num_padding_samples(self.loader)
        # whole batches per rank (Accelerate's sharding): the padding is the tail of the gathered last step
        whole = contiguous or getattr(getattr(self.loader, "sampler", None), "block", 1) > 1
        state.remainder = -1 if whole else samples_in_last_batch(self.loader)
        state.padding_order = "contiguous" if whole else "strided"
        device = self.device
        move = device.type != "cpu"  # loaders yield CPU tensors: nothing to move on a CPU run
        convert = self.precision.convert_input if self.precision.input_dtype is not None else None
        state.end_of_dataloader = False
        state.active_dataloaders += 1
        device_batches = self.device_batches
        tracked = device_batches is not None
        move = move and not tracked  # the strategy's loader puts them on the device (streams: moved here)
        batches: Any = None
        try:
            if total >= 0:
                batches = (
                    iter(device_batches(_with_positions(self.loader))) if device_batches is not None else self.loader
                )
                for batch in batches:
                    if tracked:
                        batch, position = batch
                        self._held_state = position.state
                    self.batch_in_epoch += 1
                    state.end_of_dataloader = self.batch_in_epoch == total
                    if move:
                        batch = move_to_device(batch, device)
                    yield convert(batch) if convert is not None else batch
            else:
                for batch, padding, last in self._looked_ahead():
                    self.batch_in_epoch += 1
                    state.end_of_dataloader = last
                    if last and contiguous:
                        state.padding = padding
                    if move or tracked:
                        batch = move_to_device(batch, device)
                    yield convert(batch) if convert is not None else batch
        finally:  # also when the loop breaks out (the generator is closed)
            state.active_dataloaders -= 1
            close = getattr(batches, "close", None)
            if tracked and callable(close):
                close()
        self._held_state = None  # the pass ran out: the loader's own state says so
        state.end_of_dataloader = True
        self.epoch += 1
        self.batch_in_epoch = 0

    def _reads_ahead(self) -> bool:
        """Read one batch ahead as Accelerate's DataLoaderShard does (``read_ahead``): with workers the batches
        are made in them, so only a loader without workers draws from this process's RNG in its collate or
        dataset (random masking, augmentation), and reading ahead then puts those draws where Accelerate has
        them, before the previous batch's forward. A strategy's own device loader (XLA) prefetches itself."""
        reads_itself = self.loader.kind in ("map", "custom")  # streams and iterables read ahead anyway
        return self.read_ahead and reads_itself and self.loader.num_workers == 0 and self.device_batches is None

    def _looked_ahead(self) -> Iterator[Any]:
        """``(batch, padding, is_last)`` for a loader whose end is known only when it comes: one batch is
        read ahead (as Accelerate does) so the last one is known when it is handed out; the loader's
        position after each batch is held, so a checkpoint does not count the batch read ahead."""
        from trainforge.strategies.data.loader import loader_state_dict

        if self.dispatcher is not None:
            source: Iterator[Any] = iter(self.dispatcher)
        else:
            loader = self.loader
            source = ((batch, loader.last_padding, loader_state_dict(loader)) for batch in loader)
        # made in this process (no workers, not rank 0's dispatch): its draws from the global RNG are replayed
        capture = self.loader.num_workers == 0 and self.dispatcher is None and self.device_batches is None
        previous = self._first_read(source, capture)
        kind = self.loader.kind
        if self.gather_object is not None and kind == "stream":
            self._check_same_stream(previous is not None and self.loader.last_fingerprint or None)
        # every rank reads its own stream: agree at each batch that all still have one (else DDP hangs)
        # (a split stream with even_batches=False may end one batch early on the last ranks, by design)
        uneven_by_design = kind == "stream" and not getattr(self.loader.dataset, "even_batches", True)
        agree = (
            self.gather_object is not None
            and self.dispatcher is None
            and kind in ("stream", "iterable")
            and not uneven_by_design
        )
        if agree:
            self._check_same_end(previous is not None, 0)
        while previous is not None:
            before = raw_rng_state() if capture else None
            current = next(source, None)
            if agree:
                self._check_same_end(current is not None, self.batch_in_epoch + 1)
            batch, padding, position = previous
            self._held_state = position
            self._rng_before_ahead = before if current is not None else None
            yield batch, padding, current is None
            previous = current

    def _first_read(self, source: Iterator[Any], capture: bool) -> Any:
        """The pass's first batch. Resumed after a checkpoint that held a batch read ahead: made again under the
        RNG states it was first made under, then the restored states continue (exact with a collate or dataset
        that draws from the global RNG)."""
        replay, self._replay_rng = self._replay_rng, None
        if not capture or replay is None:
            return next(source, None)
        restored = rng_state()
        set_rng_state(replay)
        try:
            return next(source, None)
        finally:
            set_rng_state(restored)

    def _gather(self, obj: Any) -> List[Any]:
        assert self.gather_object is not None, "the checks that gather run with several processes only"
        return self.gather_object(obj)

    def _check_same_end(self, has_batch: bool, read: int) -> None:
        """An IterableDataset whose stream is longer on one rank (or empty on one) would hang until the
        process-group timeout (tests/trainer/test_iterable_split.py,
        ``test_ranks_with_different_numbers_of_batches_stop_with_an_error_instead_of_hanging``). One small
        gather per batch of such a loader (only with several processes and no dispatch) finds it: every rank
        stops with the same error."""
        seen = self._gather((bool(has_batch), int(read)))
        if len({flag for flag, _ in seen}) > 1:
            ended = [f"rank {r} after {n} batch(es)" for r, (flag, n) in enumerate(seen) if not flag]
            going = [r for r, (flag, _) in enumerate(seen) if flag]
            name = type(getattr(self.loader.dataset, "dataset", self.loader.dataset)).__name__
            raise ConfigurationError(
                f"{name} ran out of data on {', '.join(ended)} while rank(s) {going} still had batches: every "
                "process must get the same number of batches per epoch, or training waits for the ranks that "
                "ended. Give every rank a stream of the same length (a dataset that shards itself by rank: "
                "equal shards, or drop the remainder), or let trainforge split one stream (drop "
                "`shards_by_rank`, and read the same stream on every rank), or dispatch_batches=True"
            )

    def _check_same_stream(self, mark: Optional[str]) -> None:
        """A split stream must be the same on every rank; compare the first sample each read (one small
        gather per epoch, on every rank, also one that has no batch)."""
        marks = self._gather(mark)
        seen = {m for m in marks if m is not None}
        if len(seen) > 1:
            differ = [rank for rank, m in enumerate(marks) if m is not None and m != marks[0]]
            name = type(getattr(self.loader.dataset, "dataset", self.loader.dataset)).__name__
            raise ConfigurationError(
                f"{name} yields different samples on different processes (rank 0 and rank {differ[0]} read different "
                "first samples), so splitting its stream between ranks would repeat and lose samples. A dataset that "
                "shards itself by rank says so with `shards_by_rank = True`; a shuffled stream must be seeded the "
                "same on every process (per epoch, e.g. in set_epoch), not per rank"
            )

    def _start_epoch(self) -> None:
        from trainforge.strategies.data.loader import set_loader_epoch

        set_loader_epoch(self.loader, self.epoch)  # sampler, batch sampler or dataset
        if self.dispatcher is not None:
            self.dispatcher.first_rows = None  # the new epoch's first rows pad its last group
        self._draw_epoch_randomness()

    def _draw_epoch_randomness(self) -> None:
        """What iterating a plain ``DataLoader(shuffle=True, generator=g)`` draws, in torch's order: the
        worker base seed from ``g`` (else the global RNG), then RandomSampler's permutation from its
        generator (else from a generator seeded by one more global draw; then a second randperm, as
        RandomSampler makes for ``num_samples % n``). The permutation's generator state is handed to
        our sampler, which saves it, so a resumed epoch keeps its order on any number of processes.

        Worker seeds: torch seeds worker ``i`` (torch, ``random``, numpy) from ``base + i``, ``base``
        being what the iterator draws from ``loader.generator`` (private, so that the iterator a resume
        recreates draws nothing from the user's streams; torchdata then restores the saved base). That
        generator is given the state the user's stream had before ``base`` was drawn, so the draw is
        ``base`` again: on one process (on rank 0) the workers get a plain DataLoader's seeds, and
        augmentation in ``__getitem__`` is the same. On data-parallel rank ``r > 0`` it is seeded with
        ``base + r`` instead, so each rank's workers get their own seeds even when every process seeded
        its RNG alike (a plain DataLoader on every rank would give them all the same ones)."""
        source = self.base_generator if self.base_generator is not None else torch.default_generator
        before = source.get_state()
        base = int(torch.empty((), dtype=torch.int64).random_(generator=self.base_generator).item())
        sampler: Any = getattr(self.loader, "sampler", None)
        if getattr(sampler, "shuffle", False) and callable(getattr(sampler, "set_order_state", None)):
            sampler.set_order_state(self._order_state(len(sampler.dataset)))
        rank = getattr(self.loader, "rank", 0)
        if rank == 0:
            self.loader.generator.set_state(before)
        else:
            self.loader.generator.manual_seed(base + rank)
        users = [g for g in (self.base_generator, self.order_generator) if g is not None]
        self._generators_after = [g.get_state() for i, g in enumerate(users) if g not in users[:i]]

    def _order_state(self, n: int) -> torch.Tensor:
        """The state of the generator this epoch's permutation of ``n`` samples comes from (rank 0's), the user's
        generator left where RandomSampler leaves it (two ``randperm``)."""
        g = self.order_generator
        if self.order_seed is not None:  # SeedableRandomSampler: reseeded for each epoch, the same on every rank
            g = g if g is not None else torch.Generator()
            g.manual_seed(self.order_seed + self.epoch)
        elif g is None:  # RandomSampler without a generator: one drawn from the global RNG
            g = torch.Generator()
            if self.dispatcher is None or self.dispatcher.rank == 0:  # dispatched: only the reading rank's sampler
                g.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            state = g.get_state()
            return self.broadcast(state) if self.broadcast is not None else state
        elif self.broadcast is not None:  # rank 0's generator on every rank (Accelerate synchronises it)
            g.set_state(self.broadcast(g.get_state()))
        state = g.get_state()
        torch.randperm(n, generator=g)
        torch.randperm(n, generator=g)
        return state

    def release_workers(self) -> None:
        """Stop DataLoader workers left running by a pass that ended early (``ResumableDataLoader``)."""
        if self.dispatcher is None:
            self.loader.release_workers()

    def skip_first_batches(self, num_batches: int, open_window: int = 0) -> PreparedDataLoader:
        """Start the next pass ``num_batches`` into the epoch. After ``load_state`` (which restored the
        position already) the count a ported Accelerate script computes is checked against the restored
        position instead: the same batch of the epoch, ``0`` when the checkpoint was saved on the
        epoch's last batch (the script then starts the next epoch), or the first batch of the accumulation
        window the checkpoint was written ``open_window`` micro-batches into (the checkpoint holds their
        gradients: see ``Accelerator.skip_first_batches``) is a logged no-op; any other an error."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ConfigurationError(f"skip_first_batches(num_batches={num_batches!r}) must be an int >= 0")
        if self._resumed and self.batch_in_epoch > 0:
            at, epoch = self.batch_in_epoch, self.epoch
            try:
                length = len(self)
            except TypeError:  # a stream without a length: its end is not known here
                length = -1
            if num_batches == 0 and at == length:  # saved on the epoch's last batch
                self.set_epoch(epoch + 1)
                done = f"the end of epoch {epoch} (batch {at} of {at}); the next pass starts epoch {epoch + 1}"
            elif num_batches == at:
                done = f"batch {at} of epoch {epoch}; the next pass continues from there"
            elif open_window > 0 and num_batches == at - open_window:
                done = (
                    f"batch {at} of epoch {epoch}, {open_window} micro-batch(es) into the accumulation window that "
                    f"starts after batch {num_batches}; the checkpoint holds their gradients, so the next pass "
                    "continues from there"
                )
            else:
                raise ConfigurationError(
                    f"skip_first_batches({num_batches}) does not match the checkpoint: load_state restored this "
                    f"loader to batch {at} of epoch {epoch}{f' (of {length} batches)' if length >= 0 else ''}, "
                    "and it continues from there by itself. Drop the skip_first_batches call, and start the "
                    f"epoch loop at the loader's `epoch` ({epoch}). (A count computed as step * "
                    "gradient_accumulation_steps, as in run_clm_no_trainer.py, is off when the loader's length "
                    "is not a multiple of gradient_accumulation_steps: each epoch ends with a shorter window.)"
                )
            log.warning(
                "trainforge: skip_first_batches(%d): load_state already restored this loader to %s; not skipping "
                "again (trainforge restores data positions, Accelerate does not)",
                num_batches,
                done,
            )
            return self
        self._skip = num_batches
        return self

    def _start_at(self, num_batches: int) -> None:
        sampler: Any = getattr(self.loader, "sampler", None)
        if self.dispatcher is not None or not callable(getattr(sampler, "check_compatible", None)):
            raise ConfigurationError(
                "skip_first_batches needs a map-style dataset sharded by trainforge (no custom "
                "sampler, IterableDataset or dispatch_batches=True): skip inside your own "
                "sampler instead"
            )
        state = sampler.state_dict()
        state["consumed"] = min(num_batches * (self.loader.batch_size or 1) * sampler.num_replicas, sampler.total_size)
        sampler.load_state_dict(state)
        self.batch_in_epoch = num_batches

    def state_dict(self) -> Dict[str, Any]:
        from trainforge.strategies.data.loader import loader_state_dict

        position = copy.deepcopy(self._held_state) if self._held_state is not None else loader_state_dict(self.loader)
        state = {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "loader": position,
            "user_generators": list(self._generators_after),
        }
        if self.dispatcher is not None and self.dispatcher.first_rows is not None:
            state["dispatch_first_rows"] = [t.detach().cpu() for t in self.dispatcher.first_rows]
        if self._rng_before_ahead is not None:
            state["rng_before_read_ahead"] = rng_state(self._rng_before_ahead)
        return state

    def load_state_dict(self, state: Dict[str, Any], *, world_size: int, rank: int) -> None:
        from trainforge.strategies.data.loader import load_loader_state

        if self.dispatcher is not None:  # the whole loader, read by rank 0: its own layout on every rank
            world_size, rank = 1, 0
        load_loader_state(self.loader, state["loader"], world_size=world_size, rank=rank)
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        # made again by the resumed pass under the states it was first made under (``_first_read``)
        self._replay_rng = state.get("rng_before_read_ahead")
        if self.dispatcher is not None:  # what a resumed epoch pads its last group with
            first = state.get("dispatch_first_rows")
            self.dispatcher.first_rows = [t.to(self.dispatcher.device) for t in first] if first else None
        users = [g for g in (self.base_generator, self.order_generator) if g is not None]
        users = [g for i, g in enumerate(users) if g not in users[:i]]
        saved = state.get("user_generators", [])
        if len(saved) == len(users):  # the user's generators continue from where the saved epoch left them
            for g, g_state in zip(users, saved):
                g.set_state(g_state)
            self._generators_after = list(saved)
        self._resumed = True


class _Position:
    """The loader's state right after it produced one batch. ``__slots__``, no ``__dict__``: device
    loaders that move tensors nested in objects (torch_xla's) leave it as it is."""

    __slots__ = ("state",)

    def __init__(self, state: Dict[str, Any]) -> None:
        self.state = state


def _with_positions(loader: Any) -> Iterator[Any]:
    """``(batch, _Position)`` pairs: the state is taken when the batch leaves the loader, as the loop
    would take it without prefetching."""
    from trainforge.strategies.data.loader import loader_state_dict

    for batch in loader:
        yield batch, _Position(loader_state_dict(loader))
