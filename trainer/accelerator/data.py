"""How the Accelerator prepares a DataLoader (``DataPreparer``, a part it builds): sharded and resumable
(``strategies/data/``), or dispatched from rank 0 (``trainer/accelerator/batch_dispatch.py``), with Accelerate's
``even_batches``/``split_batches``/``dispatch_batches`` options.

Sharding (``data_sharding``): ``"batches"`` (the Accelerator's default) follows Accelerate 1.15's
``BatchSamplerShard`` on several processes: each process takes whole consecutive batches of the epoch's order in
turn (batch 2 on 2 processes: rank 0 ``[0, 1], [4, 5]``, rank 1 ``[2, 3], [6, 7]``; with ``split_batches`` each takes
its contiguous slice of every batch), the epoch padded by wrapping around to its start (``even_batches``) or cut to
whole rounds (``drop_last``); a shuffled loader whose sampler has no generator gets one seeded by a draw from the
global RNG when it is prepared, synchronised from rank 0 at each pass (Accelerate's synchronized generator).
``"samples"`` (the Trainer's, as Lightning's ``DistributedSampler``) deals samples out one at a time
(``order[r::W]``). Either way the position saved is global, so a resume is exact on another number of processes
when processes x per-process batch is unchanged (``strategies/data/sampler.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Tuple

import torch

from trainforge.strategies.errors import ConfigurationError, invalid_choice
from trainforge.trainer.accelerator.wrappers import PreparedDataLoader

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy
    from trainforge.strategies.precision import Precision
    from trainforge.trainer.accelerator.wrappers import GradientState


class LoaderOptions(NamedTuple):
    """Accelerate's three data-loading options, as the Accelerator holds them when a loader is prepared
    (its users may set them on it after construction: ``trainer.accelerator.dispatch_batches = True``)."""

    even_batches: Any
    split_batches: Any
    dispatch_batches: Any


class DataPreparer:
    """Prepares loaders for ``strategy``'s processes; the loaders it returns share ``gradient_state``
    (end of data, padding) with the Accelerator and move batches as ``precision`` says."""

    def __init__(
        self, strategy: Strategy, gradient_state: GradientState, precision: Precision, sharding: str = "batches"
    ) -> None:
        self.strategy, self.gradient_state, self.precision = strategy, gradient_state, precision
        self.whole_batches = check_sharding(sharding) == "batches"

    def prepare(
        self,
        loader: torch.utils.data.DataLoader,
        options: LoaderOptions,
        seed: int,
        device_placement: bool,
        seedable: Tuple[bool, Optional[int]] = (False, None),
    ) -> Tuple[PreparedDataLoader, Optional[int]]:
        """The prepared loader, and the batch size of one process's micro-batch (the run's
        ``micro_batch_size`` when this is the first loader prepared). ``seedable``: Accelerate's
        ``(use_seedable_sampler, data_seed)``."""
        even, split, _ = options
        world = self.strategy.world_size
        dispatch = self._dispatches(loader, options)
        if dispatch:  # every rank builds the whole (unsharded) loader; only rank 0 iterates it
            from trainforge.strategies.data.loader import prepare_dataloader

            sharded = prepare_dataloader(loader, rank=0, world_size=1, seed=seed)
        else:
            if split or not even:
                loader = _rebuilt(loader, world, split)
            sharded = self.strategy.setup_dataloader(loader, seed=seed)
            _lay_out(sharded, loader.drop_last, even, self.whole_batches)
            if not even and sharded.kind == "stream":
                sharded.dataset.even_batches = False  # a split stream's last round is not completed
        # The random draws a plain DataLoader makes when an epoch starts (worker base seed, shuffle
        # order) are made by PreparedDataLoader from the user's generator or the global RNG, as torch
        # would; the loader itself gets a private generator, so that recreating its iterator on
        # resume draws nothing from the user's streams. No worker_init_fn is added: torch seeds torch,
        # ``random`` and numpy in each worker from the base seed, so the workers of a prepared loader
        # draw what a plain DataLoader's would (see PreparedDataLoader).
        sharded.generator = torch.Generator()
        sampler = loader.sampler if loader.batch_size is not None else getattr(loader.batch_sampler, "sampler", None)
        use_seedable, data_seed = seedable
        order_seed = None
        if use_seedable and isinstance(sampler, torch.utils.data.RandomSampler):  # Accelerate's SeedableRandomSampler
            order_seed = data_seed if data_seed is not None else torch.initial_seed()
        elif self.whole_batches and world > 1 and not dispatch and sharded.kind == "map":
            _synchronized_generator(sampler)  # (a custom sampler, kept as is, keeps drawing as it does)
        prepared = PreparedDataLoader(
            sharded,
            self.strategy.root_device if device_placement else torch.device("cpu"),  # cpu: nothing moved
            self.gradient_state,
            self.precision,
            base_generator=loader.generator,
            order_generator=getattr(sampler, "generator", None),
            order_seed=order_seed,
            read_ahead=self.whole_batches,  # Accelerate's DataLoaderShard reads one batch ahead
            broadcast=(lambda obj: self.strategy.broadcast(obj, 0)) if world > 1 else None,
            dispatcher=self._dispatcher(sharded, split, even) if dispatch else None,
            gather_object=self.strategy.all_gather_object if world > 1 else None,
            device_batches=self.strategy.device_batches,
        )
        return prepared, loader.batch_size

    def _dispatches(self, loader: torch.utils.data.DataLoader, options: LoaderOptions) -> bool:
        """dispatch_batches for this loader: None means True for an IterableDataset (Accelerate's default)."""
        data_options(*options, None)  # also when set after construction
        world = self.strategy.world_size
        if world == 1:
            return False
        dispatch = options.dispatch_batches
        if dispatch is None:
            dispatch = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        if dispatch and self.strategy.data_parallel_size != world:
            raise ConfigurationError(
                f"dispatch_batches=True is not built for {type(self.strategy).__name__} with data-parallel size "
                f"{self.strategy.data_parallel_size} of {world} processes (it dispatches over all of "
                "them): pass dispatch_batches=False"
            )
        return dispatch

    def _dispatcher(self, loader: Any, split: bool, even: bool) -> Any:
        from trainforge.strategies.data.loader import loader_state_dict
        from trainforge.trainer.accelerator.batch_dispatch import BatchDispatcher

        return BatchDispatcher(
            loader,
            rank=self.strategy.global_rank,
            world_size=self.strategy.world_size,
            device=self.strategy.root_device,
            broadcast=lambda obj: self.strategy.broadcast(obj, 0),
            split_batches=split,
            even_batches=even,
            state_of=lambda: loader_state_dict(loader),
        )


def _rebuilt(loader: torch.utils.data.DataLoader, world: int, split: bool) -> torch.utils.data.DataLoader:
    """``split_batches``: the same loader with a per-process batch of batch_size // world."""
    if not split:
        return loader
    if loader.batch_size is None or loader.batch_size % world:
        raise ConfigurationError(
            f"split_batches=True needs a batch_size divisible by the {world} processes "
            f"(got batch_size={loader.batch_size}); use a multiple of {world} or "
            "split_batches=False"
        )
    from trainforge.strategies.data.loader import loader_kwargs

    iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)  # takes no sampler
    return torch.utils.data.DataLoader(
        loader.dataset,
        batch_size=loader.batch_size // world,
        sampler=None if iterable else loader.sampler,
        drop_last=loader.drop_last,
        **loader_kwargs(loader),
    )


def data_options(even_batches: Any, split_batches: Any, dispatch_batches: Any, config: Any) -> tuple[Any, ...]:
    """Accelerate's three data-loading options, from the arguments or a DataLoaderConfiguration-like
    ``config`` (its values win, as the arguments are deprecated in Accelerate), validated."""
    if config is not None:
        names = ("even_batches", "split_batches", "dispatch_batches")
        if not any(hasattr(config, name) for name in names):
            raise ConfigurationError(
                f"dataloader_config={config!r} has none of {', '.join(names)}: pass "
                "accelerate's DataLoaderConfiguration or an object with those attributes"
            )
        even_batches = getattr(config, "even_batches", even_batches)
        split_batches = getattr(config, "split_batches", split_batches)
        dispatch_batches = getattr(config, "dispatch_batches", dispatch_batches)
    for name, value, allowed in (
        ("even_batches", even_batches, "True or False"),
        ("split_batches", split_batches, "True or False"),
        (
            "dispatch_batches",
            dispatch_batches,
            "None (Accelerate's default: True for an IterableDataset), True or False",
        ),
    ):
        if not (isinstance(value, bool) or (name == "dispatch_batches" and value is None)):
            raise ConfigurationError(f"{name}={value!r} must be {allowed}")
    return even_batches, split_batches, dispatch_batches


SHARDINGS = ("batches", "samples")


def check_sharding(sharding: Any) -> str:
    if sharding not in SHARDINGS:
        raise invalid_choice(
            "data_sharding",
            sharding,
            SHARDINGS,
            "'batches' gives each process whole batches (Accelerate), 'samples' deals samples out one at a time "
            "(torch's DistributedSampler, Lightning)",
        )
    return sharding


def _lay_out(sharded: Any, drop_last: bool, even: bool, whole_batches: bool) -> None:
    """Our sampler's layout: whole batches per rank, the epoch padded by wrapping around (``even``) or cut to
    whole rounds (``drop_last``), as Accelerate; or samples dealt one at a time, unpadded when not ``even``
    (``even_batches=False``: no duplicated samples, the last ranks may get one sample, or batch, fewer)."""
    sampler = sharded.sampler
    if sharded.kind != "map" or not callable(getattr(sampler, "set_layout", None)):
        return
    if whole_batches and sampler.num_replicas > 1:  # one process: the loader as it is (Accelerate leaves it)
        sampler.set_layout(block=sharded.batch_size or 1, drop_last=drop_last, pad=even)
    elif not even:
        sampler.set_layout(block=1, drop_last=sampler.drop_last, pad=False)


def _synchronized_generator(sampler: Any) -> None:
    """Accelerate's ``prepare_data_loader`` on several processes: a sampler with a ``generator`` attribute left
    None (a plain ``RandomSampler``) is given a generator seeded by one draw from the global RNG, then
    synchronised from rank 0 at each pass (``PreparedDataLoader`` broadcasts its state). Set on the user's
    sampler, as Accelerate does, so that a loader prepared twice draws once."""
    if sampler is None or not hasattr(sampler, "generator") or sampler.generator is not None:
        return
    generator = torch.Generator()
    generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    sampler.generator = generator
