"""The Trainer's side of ``TrainingModule.log``: where values go and when (Lightning's rules).

- ``trainer.callback_metrics``: every logged value, current after every step (tensors kept, no
  device sync; epoch values replace step values at the epoch end), so callbacks can monitor any
  metric whatever ``log_every_n_steps`` is. With ``on_step=True, on_epoch=True`` the step value is
  ``<name>_step``, the epoch value ``<name>_epoch``, and the plain ``<name>`` holds the newest of
  the two.
- ``trainer.logged_metrics``: what was last sent to the trackers (the LOG event), as floats.
- The LOG event, as Lightning's loggers get it: the metrics with ``epoch`` (the Trainer's epoch) added, at
  Lightning's step: during fit the optimizer steps taken before the logging batch's own (``global_step - 1``
  once it stepped: 859 on the last of 860 steps; the epoch-end and validation rows of that batch too),
  outside fit ``global_step``. ``trainer.log_metrics(metrics, step)`` with a step: as given, no ``epoch``.
- ``trainer.progress_bar_metrics``: the values logged with ``prog_bar=True``, as floats.
- Values logged in an epoch-end hook (``on_train_epoch_end``, ``on_validation_end``...) are logged
  for that epoch, at that step; those of ``on_train_epoch_end`` / ``on_validation_epoch_end`` in one LOG event
  with the loop's epoch values (one row of Lightning's metrics.csv).
- A ``torchmetrics.Metric`` (an attribute of the module) is logged as Lightning logs it: on_epoch its
  ``compute()`` at the epoch end, over every rank's samples, then ``reset()`` after the epoch-end
  hooks (after the sanity check too, whose values are dropped); on_step the batch's forward value
  (``trainer/loop/metrics.py``). ``sync_dist`` and ``reduce_fx`` do not apply to it: it syncs itself.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch

from trainforge.callbacks.events import Event
from trainforge.strategies.base import Strategy
from trainforge.strategies.data.utils import batch_size_of
from trainforge.strategies.errors import ConfigurationError, invalid_choice
from trainforge.trainer.loop.metrics import REDUCE_FX, MetricStore, metric_scalar, torchmetrics_type
from trainforge.trainer.loop.settings import Progress

_EPOCH_NAME = re.compile(r"(.*)_epoch(/dataloader_idx_\d+)?")

# the hook after which a loop's logged torchmetrics.Metric are reset, and that loop's MetricStore
_LAST_HOOKS = {Event.EPOCH_END: "train", Event.VALIDATION_END: "val", Event.TEST_END: "val"}


class MetricLogging:
    """The Trainer's metric stores and the rules of ``TrainingModule.log``; the Trainer builds one and
    tells it which loop runs (``running``), the batch (``batch``, for batch sizes) and the module (whose
    ``torchmetrics.Metric`` attributes may be logged). ``fire`` is the Trainer's dispatch point (LOG and
    the epoch-end events); ``progress`` gives the step of the LOG event."""

    def __init__(self, strategy: Strategy, progress: Progress, fire: Callable[..., None]) -> None:
        self.strategy, self.progress, self.fire = strategy, progress, fire
        self.stores = {"train": MetricStore(), "val": MetricStore()}
        # "train" or "val": the store and the on_step/on_epoch defaults of the running loop
        self.running = "train"
        self.batch: Any = None
        self.module: Any = None
        self.callback_metrics: Dict[str, Any] = {}
        self.logged_metrics: Dict[str, float] = {}
        # names logged with logger=False
        self._not_logged: Set[str] = set()
        # inside an epoch-end hook: what it logs
        self._epoch_end_logged: Optional[Dict[str, torch.Tensor]] = None
        # (module, ids of its torchmetrics.Metric)
        self._metric_ids: Tuple[Any, Set[int]] = (None, set())
        # several evaluation loaders: the running one's index, and which loader logged each name (Lightning's
        # "/dataloader_idx_N" suffix; validate/test return one dict per loader)
        self.dataloader_idx: Optional[int] = None
        self.loader_of: Dict[str, int] = {}
        # the Trainer runs a fit (Lightning's step of a LOG event is then one less: see the module docstring)
        self.fitting = False
        # a loop's epoch values, sent with what the epoch-end hooks log (emit(hold=True))
        self._held: Dict[str, float] = {}

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        """Send metrics to every tracker (the LOG event); call it on every rank."""
        for name, value in metrics.items():
            self.callback_metrics[name] = torch.tensor(float(value))
        self.logged_metrics.update({k: float(v) for k, v in metrics.items()})
        sent = dict(metrics)
        if step is None:
            sent.setdefault("epoch", self.progress.epoch)  # Lightning's loggers get the epoch with every row
            step = max(self.progress.global_step - 1, 0) if self.fitting else self.progress.global_step
        self.fire(Event.LOG, sent, step)

    def emit_step_metrics(self) -> None:
        """The training step values of the window, reduced and sent (a log point)."""
        self.emit(self.stores["train"].pop_step_metrics(self.strategy))

    def log_value(
        self,
        name: str,
        value: Any,
        *,
        on_step: Optional[bool],
        on_epoch: Optional[bool],
        prog_bar: bool,
        sync_dist: bool,
        batch_size: Optional[int],
        reduce_fx: str = "mean",
        rank_zero_only: bool = False,
        logger: bool = True,
        add_dataloader_idx: bool = True,
    ) -> None:
        """What ``TrainingModule.log`` calls: record one value under the loop's logging rules (``on_step`` /
        ``on_epoch`` defaults of the running hook, ``reduce_fx``, ``sync_dist``, torchmetrics objects)."""
        training = self.running == "train"
        cm = self.callback_metrics
        if (
            training
            and on_step is None
            and on_epoch is None
            and not prog_bar
            and type(value) is torch.Tensor
            and value.dim() == 0
            and logger
            and reduce_fx == "mean"
            and self._epoch_end_logged is None
        ):
            # the common case, once per step: the latest value, kept as a tensor
            store = self.stores["train"]
            cm[name] = store.step_values[name] = value.detach()
            store.step_sync[name] = sync_dist and not rank_zero_only
            return
        if reduce_fx not in REDUCE_FX:
            raise invalid_choice("self.log(reduce_fx)", reduce_fx, REDUCE_FX)
        suffix = self._suffix(name, add_dataloader_idx, logger)
        is_metric = not isinstance(value, (torch.Tensor, int, float)) and self._is_metric(name, value)
        sync = sync_dist and not rank_zero_only
        if self._epoch_end_logged is not None:
            # an epoch-end hook: the value is this epoch's
            cm[name] = self._epoch_end_logged[name] = self._epoch_end_value(name, value, is_metric, sync, reduce_fx)
            return
        on_step = training if on_step is None else on_step
        on_epoch = (not training) if on_epoch is None else on_epoch
        store = self.stores[self.running]
        if is_metric:
            store.log_metric_object(name, value, on_step=on_step, on_epoch=on_epoch, prog_bar=prog_bar, suffix=suffix)
        else:
            if on_epoch and batch_size is None:
                batch_size = batch_size_of(self.batch)
            store.log(
                name,
                value,
                on_step=on_step,
                on_epoch=on_epoch,
                prog_bar=prog_bar,
                sync_dist=sync,
                batch_size=batch_size or 1,
                reduce_fx=reduce_fx,
                suffix=suffix,
            )
        if on_step:
            latest = store.step_values[f"{name}_step{suffix}" if on_epoch else name + suffix]
            cm[name + suffix] = latest
            if on_epoch:
                cm[f"{name}_step{suffix}"] = latest

    def _suffix(self, name: str, add_dataloader_idx: bool, logger: bool) -> str:
        """The running evaluation loader's "/dataloader_idx_N" (several loaders), recorded with the names it
        makes; names logged with ``logger=False`` are kept from the trackers."""
        loader = self.dataloader_idx if self._epoch_end_logged is None else None
        suffix = f"/dataloader_idx_{loader}" if loader is not None and add_dataloader_idx else ""
        names = (name + suffix, f"{name}_step{suffix}", f"{name}_epoch{suffix}")
        if loader is not None:
            # the loader's own dict of validate/test's results (Lightning)
            for logged in names:
                self.loader_of[logged] = loader
        if not logger:
            self._not_logged.update(names)
        return suffix

    def _epoch_end_value(self, name: str, value: Any, is_metric: bool, sync: bool, reduce_fx: str) -> torch.Tensor:
        """A value logged in an epoch-end hook, as this epoch's one tensor (synced over the ranks with ``sync``)."""
        if is_metric:
            # computed now, over every rank; reset after the epoch-end hooks
            tensor = metric_scalar(name, value.compute(), value, "compute()")
            self.stores[self.running].logged_objects[id(value)] = value
            return tensor
        tensor = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        if sync and self.strategy.world_size > 1:
            tensor = self.strategy.all_reduce(tensor.to(self.strategy.root_device), reduce_fx)
        return tensor

    def _is_metric(self, name: str, value: Any) -> bool:
        """Whether ``value`` is a ``torchmetrics.Metric`` to log: one of the module's attributes, as
        Lightning requires (a Metric made per batch would keep one batch's state); a
        MetricCollection goes through ``log_dict``."""
        metric_type = torchmetrics_type()
        if metric_type is None:
            return False
        collection = torchmetrics_type("MetricCollection")
        if collection is not None and isinstance(value, collection):
            raise ConfigurationError(
                f"self.log({name!r}, MetricCollection): a collection holds several values; log it with "
                "self.log_dict(collection), which logs each metric under its own (prefixed) name"
            )
        if not isinstance(value, metric_type):
            return False
        module, ids = self._metric_ids
        if module is not self.module or id(value) not in ids:  # first use, or a Metric added since
            module = self.module
            ids = {id(m) for m in module.modules() if isinstance(m, metric_type)} if module is not None else set()
            self._metric_ids = (module, ids)
            if id(value) not in ids:
                owned = [n for n, m in module.named_modules() if isinstance(m, metric_type)] if module else []
                raise ConfigurationError(
                    f"self.log({name!r}, {type(value).__name__}): this Metric is not an attribute of "
                    f"{type(module).__name__} (its Metric attributes: {owned or 'none'}); a Metric keeps "
                    "its state over the epoch's batches and moves with the module: create it once in "
                    f"__init__ (self.metric = {type(value).__name__}(...)) and log that attribute"
                )
        return True

    def emit(self, metrics: Dict[str, float], hold: bool = False) -> None:
        """Metrics of a log point or an epoch's end: into ``callback_metrics``, and (unless logged with
        ``logger=False``) to the trackers. ``hold``: the loop's epoch values, sent by the next
        ``fire_epoch_end`` in one LOG event with what its hooks log (one row, as Lightning's loggers get it)."""
        if not metrics:
            return
        for name in metrics:  # the plain name: the newest value ("v_epoch/dataloader_idx_1" -> "v/dataloader_idx_1")
            forked = _EPOCH_NAME.fullmatch(name)
            if forked is not None:
                self.callback_metrics[forked[1] + (forked[2] or "")] = torch.tensor(metrics[name])
        hidden = self._not_logged
        for name in hidden.intersection(metrics):
            self.callback_metrics[name] = torch.tensor(float(metrics[name]))
        loggable = {k: v for k, v in metrics.items() if k not in hidden} if hidden else metrics
        if hold:  # current for the epoch-end hooks; sent after them
            self.callback_metrics.update({k: torch.tensor(float(v)) for k, v in loggable.items()})
            self._held.update(loggable)
        elif loggable:
            self.log_metrics(loggable)

    def fire_epoch_end(self, event: Event, drop: bool = False) -> None:
        """Fire an epoch-end event; what its hooks log is logged for this epoch, right after (``drop``:
        not logged, as the sanity check's values are not in Lightning)."""
        self._epoch_end_logged = {}
        try:
            self.fire(event)
            logged = self._epoch_end_logged
        finally:
            self._epoch_end_logged = None
        held, self._held = self._held, {}
        if not drop:
            self.emit({**held, **{k: float(v) for k, v in logged.items()}})
        if event in _LAST_HOOKS:
            # the torchmetrics.Metric logged are reset after the loop's last hook (Lightning)
            self.stores[_LAST_HOOKS[event]].reset_metric_objects()
