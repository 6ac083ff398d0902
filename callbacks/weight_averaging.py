"""Weight averaging (SWA / EMA) with Lightning 2.6's names and arguments: ``WeightAveraging(device=None,
use_buffers=True, avg_fn=..., multi_avg_fn=...)`` with an overridable ``should_update(step_idx, epoch_idx)``,
and ``EMAWeightAveraging(decay=0.999, update_every_n_steps=1, update_starting_at_step=None,
update_starting_at_epoch=None)``.

What the model holds when (Lightning's semantics):

- training steps always run on the current weights; after every optimizer step that ``should_update``
  accepts (and at the end of an epoch it accepts) the average is updated from them;
- a validation epoch runs on the averaged weights (swapped in at its start, back at its end);
- a checkpoint holds the averaged weights *as the model* (so ``load_from_checkpoint``, ``merge-weights``
  and every reader of the model get the average) and the current weights in this callback's state
  (``current_model_state``); resuming puts both back, so a resumed run is bit-identical to one never
  stopped. The averaged weights stay in the module from the write until this callback's next training
  event (the next ``on_train_batch_start``, or an update), so module hooks that fire in between (the
  next batch's module ``on_train_batch_start``) see the average;
- when training ends the averaged weights are swapped into the module (Lightning copies them; the swap
  also keeps the current ones for a checkpoint written at fit end, which then resumes exactly): the
  ``ModelCheckpoint`` saves at fit end, ``trainer.save_weights`` after ``fit`` and the module in memory
  hold the average. A ``ModelCheckpoint(save_weights_only=True)`` save during training writes the
  current weights, as in Lightning (no checkpoint hook runs for a weights-only save).

Sharded weights (FSDP2 DTensors): the average is kept per tensor on each rank's local shard (the update
is elementwise, so a shard's average is the average's shard; no communication). The checkpoint's model
weights are written by the strategy in its sharded format; the current weights in the callback state
are gathered into full tensors (one all-gather per tensor at each save, the memory of one full copy on
every rank while it is written) and each rank takes its shard back on resume.

Why not ``torch.optim.swa_utils.AveragedModel`` itself: it deep-copies the whole module (for a
``TrainingModule`` that is its trainer reference and, under FSDP2, its hooks and process groups), and
its ``update_parameters`` reads its ``n_averaged`` tensor on the host at every update (a device
synchronisation per step on CUDA). This callback keeps the averaged tensors itself and applies torch's
own averaging functions to them exactly as ``AveragedModel`` does (first update copies, later ones call
``multi_avg_fn`` per device/dtype group or ``avg_fn`` per tensor, SWA by default).
``EMAWeightAveraging`` uses ``get_ema_multi_avg_fn`` (one ``lerp`` per group) where Lightning uses
``get_ema_avg_fn`` (``decay * a + (1 - decay) * w`` per tensor): the same average up to fp32 rounding,
at a fraction of the per-step cost. Its per-step update calls that function's kernel,
``torch._foreach_lerp_(averages, weights, 1 - decay)``, itself, on detached views of the weights built at
fit start (no grad mode to switch, no wrapper): on the benchmark's 26k-parameter MLP the callback's
per-step work is ~10 us, the lerp's own time (benchmarks/README.md).
"""

from __future__ import annotations

import itertools
import numbers
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn, get_swa_multi_avg_fn

from trainforge.callbacks.base import RESUME_NEEDS_CALLBACK, Callback
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover - type hints only
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView

_AVERAGING_KWARGS = ("avg_fn", "multi_avg_fn")


def _dtensor_type() -> Any:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


class WeightAveraging(Callback):
    """Keeps an average of the module's weights (parameters, and buffers unless ``use_buffers=False``),
    updated after the steps and epochs ``should_update`` accepts; SWA (equal weights) unless ``avg_fn``
    or ``multi_avg_fn`` (torch.optim.swa_utils signatures) says otherwise. ``device``: where the average
    lives (default: beside each weight; ``"cpu"`` saves accelerator memory)."""

    restore_on_rollback = True  # the average follows the weights (LossSpikes(rollback_after=N))

    def __init__(
        self, device: Optional[Union[torch.device, str, int]] = None, use_buffers: bool = True, **kwargs: Any
    ) -> None:
        unknown = sorted(set(kwargs) - set(_AVERAGING_KWARGS))
        if unknown:
            raise ConfigurationError(
                f"{type(self).__name__}: unknown argument(s) {', '.join(unknown)}; besides device and use_buffers "
                f"it takes {' and '.join(_AVERAGING_KWARGS)} (torch.optim.swa_utils.AveragedModel's)"
            )
        self._avg_fn: Optional[Callable[..., torch.Tensor]] = kwargs.get("avg_fn")
        self._multi_avg_fn: Optional[Callable[..., None]] = kwargs.get("multi_avg_fn")
        if self._avg_fn is not None and self._multi_avg_fn is not None:
            raise ConfigurationError(f"{type(self).__name__}: give avg_fn or multi_avg_fn, not both")
        if self._avg_fn is None and self._multi_avg_fn is None:
            self._multi_avg_fn = get_swa_multi_avg_fn()
        self._device = torch.device(device) if isinstance(device, (str, int)) else device
        self._use_buffers = bool(use_buffers)
        self._latest_update_step = 0  # optimizer steps taken at the last update (Lightning's counter)
        self._latest_update_epoch = -1
        self._n_averaged = 0
        self._averaged: Optional[List[torch.Tensor]] = None  # per source tensor: its (local shard's) average
        self._names: List[str] = []
        self._specs: List[Any] = []  # per source tensor: (mesh, placements, shape, stride) of a DTensor, or None
        self._groups: List[List[int]] = []  # indices of the tensors of one (device, dtype)
        self._averaged_in = False  # the module holds the average and self._averaged the current weights
        self._val_swapped = False
        self._ended = False  # TRAIN_END has swapped the average in for good
        self._pending: Optional[Dict[str, Any]] = None  # a loaded state, applied once the module is placed
        self._tensors: List[Any] = []  # its parameters (and buffers), as the optimizer holds them
        self._group_averaged: List[List[torch.Tensor]] = []
        self._group_live: Optional[List[List[torch.Tensor]]] = None
        self._lerp_weight: Optional[float] = None  # EMA: 1 - decay, for the direct foreach lerp (_update)
        self._lerp_groups: Optional[List[Tuple[List[torch.Tensor], List[torch.Tensor], float]]] = None

    # ---- Lightning's extension point ---------------------------------------------------------------
    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """Called with the zero-based index of the optimizer step just taken, or of the epoch just ended;
        the default updates after every step."""
        return step_idx is not None

    @property
    def local_numel(self) -> int:
        """Elements of the average held by this process (its shards only under FSDP2); 0 before fit."""
        return sum(a.numel() for a in self._averaged or [])

    # ---- the averaged tensors ----------------------------------------------------------------------
    def _sources(self, module: torch.nn.Module) -> Any:
        if self._use_buffers:
            return itertools.chain(module.named_parameters(), module.named_buffers())
        return module.named_parameters()

    def _live(self) -> List[torch.Tensor]:
        """The module's tensors in the averaged list's order: a DTensor's local shard, detached."""
        return [t.to_local().detach() if spec is not None else t for t, spec in zip(self._tensors, self._specs)]

    @torch.no_grad()
    def _build(self, module: torch.nn.Module) -> None:
        """The tensors averaged are the module's parameters (and buffers) at fit start, held like the
        optimizer holds them: one walk over the module, not one per step (a module that replaces a buffer
        object during training instead of updating it in place wants ``use_buffers=False``; one that rebinds
        a parameter's ``.data`` during fit is not supported: EMA reads the storage it had at fit start)."""
        dtensor = _dtensor_type()
        self._names, self._specs, self._tensors, averaged = [], [], [], []
        for name, t in self._sources(module):
            if getattr(t, "ds_numel", 0) > t.numel():  # a torch tensor's attribute, set by DeepSpeed
                raise ConfigurationError(
                    f"{type(self).__name__}: {name} is partitioned by DeepSpeed ZeRO-3 (its weights live in the "
                    "engine outside forward); average with ZeRO stage 1-2 or FSDP2 (strategy='fsdp')"
                )
            is_dt = dtensor is not None and isinstance(t, dtensor)
            local = t.to_local() if is_dt else t
            self._names.append(name)
            self._tensors.append(t)
            self._specs.append((t.device_mesh, t.placements, t.shape, t.stride()) if is_dt else None)
            averaged.append(local.detach().clone().to(self._device) if self._device else local.detach().clone())
        groups: Dict[Tuple[Any, Any], List[int]] = {}
        for i, a in enumerate(averaged):
            groups.setdefault((a.device, a.dtype), []).append(i)
        self._averaged, self._groups = averaged, list(groups.values())
        self._group_averaged = [[averaged[i] for i in idx] for idx in self._groups]
        # plain tensors beside their average: the lists handed to multi_avg_fn are built once
        same_place = all(s is None for s in self._specs) and all(
            a.device == t.device for a, t in zip(averaged, self._tensors)
        )
        self._group_live = [[self._tensors[i] for i in idx] for idx in self._groups] if same_place else None
        # EMA's per-step path: one foreach lerp per group on detached views of the weights (the same storage,
        # so no grad mode to switch: the update is the one kernel), floating-point groups only
        floating = all(g[0].is_floating_point() or g[0].is_complex() for g in self._group_averaged)
        self._lerp_groups = None
        weight = self._lerp_weight
        if weight is not None and self._group_live is not None and floating:
            live = [[t.detach() for t in g] for g in self._group_live]
            self._lerp_groups = [(avgs, lives, weight) for avgs, lives in zip(self._group_averaged, live)]
        self._n_averaged, self._averaged_in, self._val_swapped, self._ended = 0, False, False, False

    def _update(self, module: torch.nn.Module) -> None:
        lerp = self._lerp_groups
        if lerp is not None and self._n_averaged > 0 and not self._averaged_in:  # EMA's per-step path
            for avgs, lives, weight in lerp:
                torch._foreach_lerp_(avgs, lives, weight)  # what get_ema_multi_avg_fn calls
            self._n_averaged += 1
            return
        self._update_any(module)

    @torch.no_grad()
    def _update_any(self, module: torch.nn.Module) -> None:
        if self._averaged_in:
            self._swap(module)
        averaged = self._averaged
        assert averaged is not None
        if self._n_averaged > 0 and self._multi_avg_fn is not None and self._group_live is not None:
            for avgs, lives in zip(self._group_averaged, self._group_live):  # the per-step path: no list built
                self._multi_avg_fn(avgs, lives, self._n_averaged)
            self._n_averaged += 1
            return
        live = [c if c.device == a.device else c.to(a.device) for c, a in zip(self._live(), averaged)]
        if self._n_averaged == 0:
            for a, c in zip(averaged, live):
                a.copy_(c)
        elif self._multi_avg_fn is not None:
            for avgs, idx in zip(self._group_averaged, self._groups):
                self._multi_avg_fn(avgs, [live[i] for i in idx], self._n_averaged)
        else:
            assert self._avg_fn is not None
            for a, c in zip(averaged, live):
                a.copy_(self._avg_fn(a, c, self._n_averaged))
        self._n_averaged += 1

    @torch.no_grad()
    def _swap(self, module: torch.nn.Module) -> None:
        assert self._averaged is not None
        for a, c in zip(self._averaged, self._live()):
            tmp = a.clone()
            a.copy_(c)
            c.copy_(tmp)
        self._averaged_in = not self._averaged_in

    def _show_averaged(self, module: torch.nn.Module) -> bool:
        if self._averaged is None or self._averaged_in:
            return False
        self._swap(module)
        return True

    def _show_current(self, module: torch.nn.Module) -> None:
        if self._averaged is not None and self._averaged_in:
            self._swap(module)

    # ---- events ------------------------------------------------------------------------------------
    def on_setup(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        if stage == "fit":  # a new fit averages from its own start (Lightning builds a new AveragedModel)
            self._averaged = None
        averaging = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, WeightAveraging)]
        if len(averaging) > 1:
            raise ConfigurationError(
                f"Trainer(callbacks=...) holds {len(averaging)} weight-averaging callbacks ({', '.join(averaging)}): "
                "each swaps its average into the module for validation and checkpoints, so one would average the "
                "other's average and a checkpoint would hold a mix. Keep one (for two decays, run twice)"
            )

    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._averaged is None:  # built at LOAD_CHECKPOINT already when resuming
            self._build(module)

    def on_train_batch_start(self, trainer: TrainerView, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        self._show_current(module)  # after a checkpoint write, which leaves the average in the module

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._update_after_step(trainer, module)

    def _update_after_step(self, trainer: TrainerView, module: TrainingModule) -> None:
        step = trainer.global_step
        if step > self._latest_update_step and self.should_update(step_idx=step - 1):
            self._update(module)
            self._latest_update_step = step

    def on_train_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._update(module)
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        self._show_averaged(module)
        self._ended = True

    def on_validation_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if trainer.stage == "fit" and not self._ended and self._averaged is not None:
            # trainforge validates before BATCH_END, Lightning after: the step just taken is averaged first
            self._update_after_step(trainer, module)
        self._val_swapped = self._show_averaged(module)

    def on_validation_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._val_swapped:
            self._val_swapped = False
            self._show_current(module)

    def on_save_checkpoint(self, trainer: TrainerView, module: TrainingModule, checkpoint: Dict[str, Any]) -> None:
        self._show_averaged(module)  # the strategy writes the module next: the average is the checkpoint's model

    def on_load_checkpoint(self, trainer: TrainerView, module: TrainingModule, checkpoint: Dict[str, Any]) -> None:
        """The strategy has loaded the checkpoint's model (the average); the current weights come from
        this callback's state."""
        self._build(module)
        pending, self._pending = self._pending, None
        if pending is None:  # written without WeightAveraging: both start from the checkpoint's model
            return
        self._n_averaged = int(pending["n_averaged"])
        current = pending.get("current_model_state")
        if current is None:
            return
        with torch.no_grad():
            averaged = pending.get("average_model_state")
            if averaged is not None:  # written outside a checkpoint's SAVE_CHECKPOINT
                for a, spec, name in zip(self._averaged or [], self._specs, self._names):
                    a.copy_(self._shard(averaged[name], spec))
            for c, spec, name in zip(self._live(), self._specs, self._names):
                c.copy_(self._shard(current[name], spec))

    # ---- state ---------------------------------------------------------------------------------------
    @staticmethod
    def _shard(full: torch.Tensor, spec: Any) -> torch.Tensor:
        if spec is None:
            return full
        from torch.distributed.tensor import distribute_tensor

        mesh, placements, _, _ = spec
        return distribute_tensor(full.to(mesh.device_type), mesh, placements, src_data_rank=None).to_local()

    def _full(self, tensors: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
        out = {}
        for name, t, spec in zip(self._names, tensors, self._specs):
            if spec is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = spec
                dt = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
                t = dt.full_tensor().cpu()
            out[name] = t.detach()
        return out

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {
            "latest_update_step": self._latest_update_step,
            "latest_update_epoch": self._latest_update_epoch,
            "n_averaged": self._n_averaged,
        }
        if self._averaged is None:
            return state
        if self._averaged_in:  # inside a checkpoint: the module (written as the model) holds the average
            state["current_model_state"] = self._full(self._averaged)
            name = type(self).__name__
            state[RESUME_NEEDS_CALLBACK] = (
                f"its model weights are {name}'s average and the training weights are in that callback's state, so "
                f"training would go on from the average. Pass {name}(...) in Trainer(callbacks=...) to resume, or "
                "start a new run from the averaged weights (TrainingModule.load_from_checkpoint(path))"
            )
        else:
            state["current_model_state"] = self._full([t.detach() for t in self._live()])
            state["average_model_state"] = self._full(self._averaged)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._latest_update_step = int(state_dict["latest_update_step"])
        self._latest_update_epoch = int(state_dict.get("latest_update_epoch", -1))
        self._pending = dict(state_dict, n_averaged=state_dict.get("n_averaged", 0))


class EMAWeightAveraging(WeightAveraging):
    """Exponential moving average: ``average = decay * average + (1 - decay) * weights`` after every
    ``update_every_n_steps``-th optimizer step from ``update_starting_at_step`` on, and after every epoch
    from ``update_starting_at_epoch`` on (when given); the first update copies the weights."""

    def __init__(
        self,
        device: Optional[Union[torch.device, str, int]] = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: Optional[int] = None,
        update_starting_at_epoch: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0.0 < float(decay) < 1.0:
            raise ConfigurationError(
                f"EMAWeightAveraging(decay={decay!r}): decay must be a number strictly between 0 and 1 (0.999 "
                "keeps 99.9 % of the average at each update); 0 would only copy the weights and 1 never move"
            )
        _check_count("update_every_n_steps", update_every_n_steps, minimum=1)
        for name, value in (
            ("update_starting_at_step", update_starting_at_step),
            ("update_starting_at_epoch", update_starting_at_epoch),
        ):
            if value is not None:
                _check_count(name, value, minimum=0)
        if "avg_fn" in kwargs or "multi_avg_fn" in kwargs:
            raise ConfigurationError(
                "EMAWeightAveraging sets its own averaging function; use WeightAveraging for another"
            )
        super().__init__(device=device, use_buffers=use_buffers, multi_avg_fn=get_ema_multi_avg_fn(float(decay)))
        self.decay = float(decay)
        self._lerp_weight = 1.0 - self.decay
        self.update_every_n_steps: int = update_every_n_steps
        self.update_starting_at_step: Optional[int] = update_starting_at_step
        self.update_starting_at_epoch: Optional[int] = update_starting_at_epoch

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and step_idx % self.update_every_n_steps == 0:
                return True
        if epoch_idx is not None:
            return self.update_starting_at_epoch is not None and epoch_idx >= self.update_starting_at_epoch
        return False


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"EMAWeightAveraging({name}={value!r}): expected an integer >= {minimum}")
