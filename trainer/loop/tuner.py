"""Lightning's tuner under its names: ``Tuner(trainer).scale_batch_size(model, ...)`` (the largest batch size
that trains without running out of memory, doubling from ``init_val``; ``mode="binsearch"`` then bisects
between the last size that ran and the first that did not) and ``Tuner(trainer).lr_find(model, ...)`` (a
learning-rate range test: ``num_training`` steps with the rate raised from ``min_lr`` to ``max_lr``; the
``LRFinder`` it returns has ``.results`` and ``.suggestion()``).

Trials leave no trace: they run ``training_step`` on the trainer's device with a throwaway optimizer from
``configure_optimizers`` (no scheduler, no callbacks, no tracker, no checkpoint: nothing is written to
disk), then the module's weights and buffers, its train/eval mode and every random generator are put back
exactly; a fit after tuning is the fit with the found value set by hand. Trials call ``training_step``
outside ``fit``: a module that calls ``self.log`` or ``self.optimizers()`` there cannot be tuned. A
``train_dataloader()`` that does not read the size tried (a loader built with another batch size, or batches
of one size in every trial) is refused: the size reported would never have been tried.
Under several processes every process calls the tuner: each trial is one process's own steps (no gradient
all-reduce), then all of them agree on its outcome (``trainer/accelerator/oom_agreement.py``), so an out-of-memory
error on any rank lowers the size on every rank; ``lr_find`` uses rank 0's curve on every rank."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, MutableMapping, Optional, Tuple

import numpy as np
import torch

from trainforge.strategies.data.utils import apply_to_tensors
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.oom_agreement import FAILED, OK, OOM, agree_on_outcome
from trainforge.trainer.accelerator.seed import rng_state, set_rng_state
from trainforge.trainer.compat.accelerate.accelerator_args import release_memory
from trainforge.trainer.compat.accelerate.utils import should_reduce_batch_size
from trainforge.trainer.loop.settings import parse_optimizers
from trainforge.trainer.module.datamodule import DataModule
from trainforge.trainer.module.training_module import TrainingModule

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.trainer.loop.trainer import Trainer

_MODES = ("power", "binsearch")
_LR_MODES = ("exponential", "linear")


def _positive_int(value: Any, call: str, arg: str, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{call}({arg}={value!r}) must be an int >= 1: {fix}")


def _holders(model: Any, datamodule: Any, names: Tuple[str, ...], what: str, fix: str) -> Tuple[str, List[Any]]:
    """Where a hyperparameter lives, in Lightning's order: ``model.NAME``, ``model.hparams.NAME``,
    ``datamodule.NAME``, ``datamodule.hparams.NAME``: (the name found, [the objects or hparams holding it])."""
    looked: List[str] = []
    for name in names:
        found: List[Any] = []
        for owner, label in ((model, "model"), (datamodule, "datamodule")):
            if owner is None:
                continue
            if name in vars(owner) or any(name in vars(cls) for cls in type(owner).__mro__):
                found.append(owner)
            hparams = owner.hparams if isinstance(owner, (TrainingModule, DataModule)) else None
            if isinstance(hparams, Mapping) and name in hparams:
                found.append(hparams)
            looked += [f"{label}.{name}", f"{label}.hparams.{name}"]
        if found:
            return name, found
    raise ConfigurationError(f"{what}: found none of {', '.join(looked)}; {fix}")


def _set(holders: List[Any], name: str, value: Any) -> None:
    for holder in holders:
        if isinstance(holder, MutableMapping):
            holder[name] = value
        else:
            setattr(holder, name, value)


class LRFinder:
    """What ``Tuner.lr_find`` returns: ``results`` ``{"lr": [...], "loss": [...]}`` (the smoothed loss of
    each step) and ``suggestion()``: the rate where the loss falls fastest (per decade of rate, each slope a
    least-squares fit over about a tenth of the points)."""

    def __init__(self, mode: str, min_lr: float, max_lr: float, num_training: int) -> None:
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, min_lr, max_lr, num_training
        self.results: Dict[str, List[float]] = {"lr": [], "loss": []}

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> Optional[float]:
        """The steepest descent of the loss over log10(rate), leaving out the first ``skip_begin`` and last
        ``skip_end`` steps; None (too few finite points) if fewer than 3 remain."""
        lrs = np.array(self.results["lr"][skip_begin : len(self.results["lr"]) - skip_end], dtype=np.float64)
        losses = np.array(self.results["loss"][skip_begin : len(self.results["loss"]) - skip_end], dtype=np.float64)
        keep = np.isfinite(losses)
        lrs, losses = lrs[keep], losses[keep]
        if len(losses) < 3:
            return None
        # each slope fitted over about a tenth of the points: one noisy batch does not make the steepest drop
        half, logs = max(1, len(losses) // 20), np.log10(lrs)
        slopes = [
            np.polyfit(logs[max(0, i - half) : i + half + 1], losses[max(0, i - half) : i + half + 1], 1)[0]
            for i in range(len(losses))
        ]
        return float(lrs[int(np.argmin(slopes))])


class Tuner:
    """``Tuner(trainer)``: Lightning's ``lightning.pytorch.tuner.Tuner`` (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    # ---- batch size ----------------------------------------------------------------------------------
    def scale_batch_size(
        self,
        model: TrainingModule,
        train_dataloaders: Any = None,
        datamodule: Any = None,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
    ) -> int:
        """The largest batch size (from ``init_val``, at most ``max_trials`` trials of ``steps_per_trial``
        steps) that trains without an out-of-memory error on any process; set where it was found and returned."""
        if mode not in _MODES:
            raise ConfigurationError(f"scale_batch_size(mode={mode!r}) is not one of: {', '.join(_MODES)}")
        _positive_int(steps_per_trial, "scale_batch_size", "steps_per_trial", "the steps each trial trains")
        _positive_int(init_val, "scale_batch_size", "init_val", "the first batch size tried, e.g. 2")
        _positive_int(max_trials, "scale_batch_size", "max_trials", "how many sizes to try at most, e.g. 25")
        if train_dataloaders is not None:
            raise ConfigurationError(
                "scale_batch_size(train_dataloaders=...): a DataLoader's batch size is fixed when it is built; "
                f"read `self.{batch_arg_name}` in the module's (or a DataModule's) train_dataloader() instead"
            )
        where = (
            f"scale_batch_size(batch_arg_name={batch_arg_name!r})",
            f"give the module (self.{batch_arg_name} = 2 or save_hyperparameters()) or the DataModule a "
            f"`{batch_arg_name}` that its train_dataloader() reads, or pass batch_arg_name=",
        )
        name, holders = _holders(model, datamodule, (batch_arg_name,), *where)
        size, last_ok, lowest_oom = init_val, None, None
        trials: List[_Trial] = []
        before = [(h, h[name] if isinstance(h, Mapping) else getattr(h, name)) for h in holders]
        with _NoTrace(model), _PutBack(before, name):
            if datamodule is not None:  # once: each trial builds the loader again, not the datasets
                datamodule.setup("fit")
            for _ in range(max_trials):
                _set(holders, name, size)
                trial = _Trial(size, name)
                outcome = self._agreed(lambda: self._train(model, datamodule, None, steps_per_trial, trial=trial), size)
                trials.append(trial)
                if outcome == OK:
                    last_ok = size
                    if lowest_oom is None:
                        size *= 2
                    elif mode == "power" or lowest_oom - size <= 1:
                        break
                    else:
                        size = (size + lowest_oom) // 2
                    continue
                lowest_oom = size
                if last_ok is None:
                    size //= 2
                    if size == 0:
                        break
                elif mode == "power" or size - last_ok <= 1:
                    break
                else:
                    size = (last_ok + size) // 2
        _Trial.check_sizes_changed(trials)
        if last_ok is None:  # the holders have their value of before again
            raise RuntimeError(
                f"scale_batch_size: no batch size from {init_val} down to 1 trains without running out of memory"
            )
        _set(holders, name, last_ok)
        return last_ok

    # ---- learning rate -------------------------------------------------------------------------------
    def lr_find(  # noqa: C901 - Lightning's LR finder: one sweep, its stop and restore rules together
        self,
        model: TrainingModule,
        train_dataloaders: Any = None,
        datamodule: Any = None,
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: Optional[float] = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> LRFinder:
        """A learning-rate range test; with ``update_attr`` the suggestion is set on ``model.lr`` /
        ``model.learning_rate`` (or ``attr_name``; also under ``hparams``)."""
        if mode not in _LR_MODES:
            raise ConfigurationError(f"lr_find(mode={mode!r}) is not one of: {', '.join(_LR_MODES)}")
        for label, value in (("min_lr", min_lr), ("max_lr", max_lr)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigurationError(f"lr_find({label}={value!r}) must be a number > 0")
        if min_lr >= max_lr:
            raise ConfigurationError(
                f"lr_find(min_lr={min_lr!r}, max_lr={max_lr!r}): min_lr must be below max_lr, e.g. 1e-8 and 1.0"
            )
        _positive_int(num_training, "lr_find", "num_training", "the steps of the test, e.g. 100")
        if early_stop_threshold is not None and not early_stop_threshold > 0:
            raise ConfigurationError(
                f"lr_find(early_stop_threshold={early_stop_threshold!r}) must be > 0 (or None: never stop early)"
            )
        name_holders: Optional[Tuple[str, List[Any]]] = None
        if update_attr:  # before the test: a module without the attribute is told at once
            names = (attr_name,) if attr_name else ("lr", "learning_rate")
            fix = "give the module `self.lr` (or save_hyperparameters()), pass attr_name=, or update_attr=False"
            name_holders = _holders(model, None, names, f"lr_find(attr_name={attr_name!r})", fix)
        finder = LRFinder(mode, float(min_lr), float(max_lr), num_training)

        def rate(step: int) -> float:
            t = step / max(num_training - 1, 1)
            if mode == "exponential":
                return float(min_lr * (max_lr / min_lr) ** t)
            return float(min_lr + (max_lr - min_lr) * t)

        state = {"avg": 0.0, "best": math.inf}

        def record(step: int, lr: float, loss: float) -> bool:
            state["avg"] = 0.98 * state["avg"] + 0.02 * loss
            smooth = state["avg"] / (1 - 0.98 ** (step + 1))
            finder.results["lr"].append(lr)
            finder.results["loss"].append(smooth)
            state["best"] = min(state["best"], smooth)
            diverged = not math.isfinite(smooth)
            return diverged or (early_stop_threshold is not None and smooth > early_stop_threshold * state["best"])

        with _NoTrace(model):
            if datamodule is not None and train_dataloaders is None:
                datamodule.setup("fit")
            outcome = self._agreed(
                lambda: self._train(model, datamodule, train_dataloaders, num_training, rate, record)
            )
        if outcome != OK:
            raise RuntimeError("lr_find: the test ran out of memory on a process; lower the batch size first")
        finder.results = _from_rank_zero(finder.results)
        suggestion = finder.suggestion()
        if name_holders is not None and suggestion is not None:
            _set(name_holders[1], name_holders[0], suggestion)
        return finder

    # ---- trials -------------------------------------------------------------------------------------
    def _agreed(self, attempt: Callable[[], None], size: Optional[int] = None) -> int:
        """Run ``attempt``; every process then agrees on the worst outcome (an error that is not out of
        memory is raised on its process, and stops the others too)."""
        error: Optional[BaseException] = None
        try:
            attempt()
            outcome = OK
        except Exception as err:
            outcome = OOM if should_reduce_batch_size(err) else FAILED
            error = err if outcome == FAILED else None
        agreed = agree_on_outcome(outcome)
        if agreed != OK:
            release_memory()  # the failed attempt's tensors, before the next one
        if error is not None:
            raise error
        if agreed == FAILED:
            at = f" at batch size {size}" if size is not None else ""
            raise RuntimeError(f"Tuner: another process raised an error{at} (see its traceback); this one stops too")
        return agreed

    def _train(
        self,
        model: TrainingModule,
        datamodule: Any,
        loader: Any,
        steps: int,
        rate: Optional[Callable[[int], float]] = None,
        record: Optional[Callable[[int, float, float], bool]] = None,
        trial: Optional[_Trial] = None,
    ) -> None:
        if not model.automatic_optimization:
            raise ConfigurationError(
                f"Tuner: {type(model).__name__} uses manual optimization (automatic_optimization=False); "
                "the tuner's trials step one optimizer from configure_optimizers()"
            )
        if loader is None:
            if datamodule is not None:
                loader = datamodule.train_dataloader()
            else:
                lightning_hooks: Any = model  # train_dataloader() is the user's (Lightning's hook), undeclared
                loader = lightning_hooks.train_dataloader()
        if trial is not None:
            trial.check_loader(loader)
        device = self.trainer.device
        model.to(device)
        model.train()
        optimizer = parse_optimizers(model.configure_optimizers(), type(model).__name__).optimizer
        batches = iter(loader)
        for step in range(steps):
            try:
                batch = next(batches)
            except StopIteration:  # fewer batches than steps: start the loader again
                batches = iter(loader)
                batch = next(batches)
            if trial is not None and step == 0:
                trial.note_batch(batch)
            batch = apply_to_tensors(batch, lambda t: t.to(device))
            lr = rate(step) if rate is not None else 0.0
            if rate is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            with self.trainer.accelerator.autocast():
                out = model.training_step(batch, step)
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()
            optimizer.step()
            if record is not None and record(step, lr, float(loss.detach())):
                break


class _Trial:
    """One batch size tried, and what the loader built for it ran: a loader that does not read the size
    would make every trial "succeed" at the size it always had, and the tuner report a size never tried."""

    def __init__(self, size: int, holder: str) -> None:
        self.size, self.holder = size, holder
        self.first_dim: Optional[int] = None

    def check_loader(self, loader: Any) -> None:
        built = getattr(loader, "batch_size", None)
        if built is None:  # a DataLoader given a batch_sampler
            built = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if isinstance(built, int) and built != self.size:
            raise ConfigurationError(self._ignored(f"built a loader of batch size {built}"))

    def note_batch(self, batch: Any) -> None:
        dims: List[int] = []
        apply_to_tensors(batch, lambda t: dims.append(t.shape[0]) if t.dim() else None)
        self.first_dim = dims[0] if dims else None

    @staticmethod
    def check_sizes_changed(trials: List[_Trial]) -> None:
        """Trials of different sizes whose batches all had the same first dimension: the size was ignored."""
        dims = {t.first_dim for t in trials}
        sizes = {t.size for t in trials}
        if len(sizes) > 1 and len(dims) == 1 and None not in dims:
            raise ConfigurationError(
                trials[-1]._ignored(f"ran batches of {dims.pop()} in every trial (sizes {sorted(sizes)})")
            )

    def _ignored(self, what: str) -> str:
        return (
            f"scale_batch_size set {self.holder}={self.size}, but train_dataloader() {what}: it does not read "
            f"`{self.holder}`, so no trial ran the size it tried. Build the loader with "
            f"batch_size=self.{self.holder} (or self.hparams.{self.holder}) in train_dataloader()"
        )


class _NoTrace:
    """Puts back the module's weights, buffers, gradients, device, train/eval mode and every random
    generator as they were on entry."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.grads = [p.grad for p in self.model.parameters()]
        self.device = next((p.device for p in self.model.parameters()), None)
        self.training = self.model.training
        self.rng = rng_state()

    def __exit__(self, *exc: Any) -> None:
        self.model.load_state_dict(self.state)
        if self.device is not None:
            self.model.to(self.device)
        for p, grad in zip(self.model.parameters(), self.grads):
            p.grad = grad
        self.model.train(self.training)
        set_rng_state(self.rng)


class _PutBack:
    """Gives each holder its value of before if the search fails (an error, or no size that runs)."""

    def __init__(self, before: List[Tuple[Any, Any]], name: str) -> None:
        self.before, self.name = before, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        for holder, value in self.before:
            _set([holder], self.name, value)


def _from_rank_zero(results: Dict[str, List[float]]) -> Dict[str, List[float]]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return results
    box: List[Any] = [results]
    dist.broadcast_object_list(box, src=0)
    return dict(box[0])
