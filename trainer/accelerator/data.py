"""How the Accelerator prepares a DataLoader (a mixin of ``Accelerator``): sharded and resumable
(``strategies/data/``), or dispatched from rank 0 (``trainer/accelerator/batch_dispatch.py``), with Accelerate's
``even_batches``/``split_batches``/``dispatch_batches`` options."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

import torch

from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.wrappers import PreparedDataLoader

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import RunSettings, Strategy
    from trainforge.strategies.precision import Precision
    from trainforge.trainer.accelerator.wrappers import GradientState


class DataPreparation:
    """Mixed into ``Accelerator``."""

    if TYPE_CHECKING:  # the Accelerator's, for the type checker
        strategy: Strategy
        gradient_state: GradientState
        device: torch.device
        num_processes: int
        process_index: int
        precision: Precision
        run_settings: RunSettings
        seed: int
        even_batches: bool
        split_batches: bool
        dispatch_batches: Optional[bool]
        _dataloaders: List[PreparedDataLoader]

        def update_run_settings(self, **changes: Any) -> None: ...

    def prepare_data_loader(self, loader: torch.utils.data.DataLoader) -> PreparedDataLoader:
        dispatch = self._dispatches(loader)
        if dispatch:  # every rank builds the whole (unsharded) loader; only rank 0 iterates it
            from trainforge.strategies.data.loader import prepare_dataloader

            sharded = prepare_dataloader(loader, rank=0, world_size=1, seed=self.seed)
        else:
            if self.split_batches or not self.even_batches:
                loader = _rebuilt(loader, self.num_processes, self.split_batches)
            sharded = self.strategy.setup_dataloader(loader, seed=self.seed)
            if not self.even_batches and hasattr(sharded.sampler, "pad"):
                _unpadded(sharded.sampler)
            if not self.even_batches and sharded.kind == "stream":
                sharded.dataset.even_batches = False  # a split stream's last round is not completed
        if self.run_settings.micro_batch_size is None:  # the first loader prepared is the training one
            self.update_run_settings(micro_batch_size=loader.batch_size)
        # The random draws a plain DataLoader makes when an epoch starts (worker base seed, shuffle
        # order) are made by PreparedDataLoader from the user's generator or the global RNG, as torch
        # would; the loader itself gets a private generator, so that recreating its iterator on
        # resume draws nothing from the user's streams. No worker_init_fn is added: torch seeds torch,
        # ``random`` and numpy in each worker from the base seed, so the workers of a prepared loader
        # draw what a plain DataLoader's would (see PreparedDataLoader).
        sharded.generator = torch.Generator()
        sampler = loader.sampler if loader.batch_size is not None else getattr(loader.batch_sampler, "sampler", None)
        world = self.num_processes
        prepared = PreparedDataLoader(
            sharded,
            self.device if self.run_settings.device_placement else torch.device("cpu"),  # cpu: nothing moved
            self.gradient_state,
            self.precision,
            base_generator=loader.generator,
            order_generator=getattr(sampler, "generator", None),
            broadcast=(lambda obj: self.strategy.broadcast(obj, 0)) if world > 1 else None,
            dispatcher=self._dispatcher(sharded) if dispatch else None,
            gather_object=self.strategy.all_gather_object if world > 1 else None,
            device_batches=self.strategy.device_batches,
        )
        self._dataloaders.append(prepared)
        return prepared

    def _dispatches(self, loader: torch.utils.data.DataLoader) -> bool:
        """dispatch_batches for this loader: None means True for an IterableDataset (Accelerate's default)."""
        data_options(self.even_batches, self.split_batches, self.dispatch_batches, None)  # also when set later
        if self.num_processes == 1:
            return False
        dispatch = self.dispatch_batches
        if dispatch is None:
            dispatch = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        if dispatch and self.strategy.data_parallel_size != self.num_processes:
            raise ConfigurationError(
                f"dispatch_batches=True is not built for {type(self.strategy).__name__} with data-parallel size "
                f"{self.strategy.data_parallel_size} of {self.num_processes} processes (it dispatches over all of "
                "them): pass dispatch_batches=False"
            )
        return dispatch

    def _dispatcher(self, loader: Any) -> Any:
        from trainforge.strategies.data.loader import loader_state_dict
        from trainforge.trainer.accelerator.batch_dispatch import BatchDispatcher

        return BatchDispatcher(
            loader,
            rank=self.process_index,
            world_size=self.num_processes,
            device=self.device,
            broadcast=lambda obj: self.strategy.broadcast(obj, 0),
            split_batches=self.split_batches,
            even_batches=self.even_batches,
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


def data_options(even_batches: Any, split_batches: Any, dispatch_batches: Any, config: Any) -> "tuple[Any, ...]":
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


def _unpadded(sampler: Any) -> None:
    """``even_batches=False``: no duplicated samples; the last ranks may get one sample (batch) fewer."""
    from trainforge.strategies.data.sampler import epoch_length

    sampler.pad = False
    sampler.total_size = epoch_length(len(sampler.dataset), sampler.num_replicas, sampler.drop_last, False)
    sampler.num_samples = len(range(sampler.rank, sampler.total_size, sampler.num_replicas))
