"""The Trainer's evaluation loops: validation inside fit, the sanity check, ``validate``, ``test``
and ``predict`` (Lightning's hooks: ``on_<stage>_start``, ``_epoch_start``, ``_batch_start``,
``_batch_end``, ``_epoch_end``, ``_end``; see ``callbacks/events.py``).

Train/eval modes are restored per submodule after each loop, so a submodule the user put in eval
mode (a frozen encoder, batch-norm statistics) stays there (Lightning 2.2+)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from trainforge.callbacks.events import EVAL_EVENTS
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.accelerator import Accelerator
from trainforge.trainer.loop.metric_logging import MetricLogging
from trainforge.trainer.loop.module_hooks import check_dataloader_idx
from trainforge.trainer.loop.settings import LoopConfig, limited, loader_length
from trainforge.trainer.loop.step_hooks import keep_on_host, overridden
from trainforge.trainer.module.training_module import TrainingModule


def _with_index(step: Any, dataloader_idx: int, batch: Any, batch_idx: int) -> Any:
    return step(batch, batch_idx, dataloader_idx)


def module_modes(module: nn.Module) -> Dict[nn.Module, bool]:
    return {m: m.training for m in module.modules()}


def restore_modes(modes: Dict[nn.Module, bool]) -> None:
    for m, training in modes.items():
        m.training = training


def _mode_hook_name(step_name: str, mode: str) -> str:
    """Lightning's ``on_validation_model_<mode>`` (also for the sanity check) or ``on_test_model_<mode>``."""
    return f"on_{'test' if step_name == 'test_step' else 'validation'}_model_{mode}"


def _restore(module: TrainingModule, step_name: str, modes: Dict[nn.Module, bool]) -> None:
    """After the loop: the module's ``on_<stage>_model_train`` when it overrides it (Lightning), else each
    submodule's mode as it was before."""
    name = _mode_hook_name(step_name, "train")
    if overridden(module, name):
        getattr(module, name)()
    else:
        restore_modes(modes)


_LIMITS = {"validation_step": "limit_val_batches", "test_step": "limit_test_batches"}


def pipeline_loss_name(step_name: str) -> str:
    """Validation/test under pipeline parallelism: ``module.loss_fn`` through the stages (forward
    only; validation_step/test_step are not called), logged as ``val/loss`` / ``test/loss``, the
    mean over the epoch and the data-parallel ranks."""
    name = {"validation_step": "val/loss", "test_step": "test/loss"}.get(step_name)
    if name is None:
        raise ConfigurationError(
            f"{step_name} with pipeline parallelism is not built yet (the stages compute "
            "the loss only); predict on one process from the merged weights"
        )
    return name


class Evaluation:
    """The evaluation loops, a part the Trainer builds once: ``run`` (validation inside fit, the sanity
    check, ``validate``, ``test``) and ``predict``, each given the module and its prepared model.
    ``fire`` is the Trainer's dispatch point; ``logging`` its metric stores (told which loop runs)."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: LoopConfig,
        fire: Callable[..., None],
        logging: MetricLogging,
        callbacks: List[Any],
    ) -> None:
        self.accelerator, self.strategy, self.config = accelerator, accelerator.strategy, config
        self.fire, self.logging, self.callbacks = fire, logging, callbacks
        # the module's batch-transfer hooks for the stage (trainer/loop/step_hooks.py), or None
        self.transfer: Optional[Callable[[Any, int], Any]] = None

    def prepare_model(self, module: TrainingModule, model: Any, loaders: Any = ()) -> Any:
        """The prepared model to evaluate ``module`` with: ``model`` when it already wraps it."""
        if model is not None and self.accelerator.unwrap_model(model) is module:
            return model
        # a layout chosen from the model and the first loader's batches ("auto" sizes)
        self.strategy.plan_layout(module, loaders[0] if loaders else None)
        # the Trainer's own path (no optimizers here): the loops run the steps under autocast,
        # so the module's forward is not wrapped as Accelerator.prepare wraps a user's model
        prepared, _ = self.accelerator.prepare_model_with_optimizers(module, list)
        return prepared

    def run(
        self,
        module: TrainingModule,
        model: Any,
        loaders: List[Any],
        step_name: str,
        max_batches: Optional[int] = None,
        sanity: bool = False,
    ) -> None:
        """One evaluation loop over ``loaders`` with ``step_name``'s events; ``sanity``: the sanity check
        (its metrics are dropped)."""
        start, epoch_start, batch_start, batch_end, epoch_end, end = EVAL_EVENTS[step_name]
        logging = self.logging
        modes, logging.running = module_modes(module), "val"
        # Lightning's on_validation_model_eval / on_test_model_eval (default: eval mode)
        getattr(module, _mode_hook_name(step_name, "eval"))()
        check_dataloader_idx(module, self.callbacks, step_name, (batch_start.value, batch_end.value), len(loaders))
        logging.loader_of = {}
        self.fire(start)
        self.fire(epoch_start)
        with torch.no_grad():
            step = self.accelerator.step_function(model, step_name)
            loss_name = pipeline_loss_name(step_name) if self.strategy.pipelined else None
            for dataloader_idx, loader in enumerate(loaders):
                self._run_loader(
                    module, model, loader, step, step_name, dataloader_idx, len(loaders), max_batches, loss_name
                )
            logging.dataloader_idx = None
        metrics = logging.stores["val"].pop_epoch_metrics(self.strategy, compute=not sanity)
        if not sanity:
            # the sanity check's values are dropped (Lightning)
            logging.emit(metrics, hold=True)  # one LOG event with what on_*_epoch_end logs (Lightning's row)
        logging.fire_epoch_end(epoch_end, drop=sanity)
        logging.fire_epoch_end(end, drop=sanity)
        logging.running = "train"
        _restore(module, step_name, modes)

    def _run_loader(
        self,
        module: TrainingModule,
        model: Any,
        loader: Any,
        step: Any,
        step_name: str,
        dataloader_idx: int,
        loader_count: int,
        max_batches: Optional[int],
        loss_name: Optional[str],
    ) -> None:
        _, _, batch_start, batch_end, _, _ = EVAL_EVENTS[step_name]
        # each loader's index goes to the step and batch hooks when there are several (Lightning)
        several = loader_count > 1
        extra = (dataloader_idx,) if several else ()
        self.logging.dataloader_idx = dataloader_idx if several else None
        loader_step = step if not several else functools.partial(_with_index, step, dataloader_idx)
        # each loop its own limit (Lightning): test is not cut by validation's
        name = _LIMITS[step_name]
        limit = limited(loader_length(loader), getattr(self.config, name), name)
        if max_batches is not None and max_batches >= 0:
            limit = min(limit, max_batches)
        transfer = self.transfer
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= limit:
                break
            if transfer is not None:
                batch = transfer(batch, dataloader_idx)
            self.logging.batch = batch
            self.fire(batch_start, batch, batch_idx, *extra)
            out = self.strategy.evaluate_batch(model, loader_step, batch, batch_idx)
            if loss_name is not None:
                # a pipeline's loss through the stages
                module.log(loss_name, out, sync_dist=True)
            self.fire(batch_end, out, batch, batch_idx, *extra)

    def predict(
        self, module: TrainingModule, model: Any, loaders: List[Any], return_predictions: Optional[bool]
    ) -> List[List[Any]]:
        """The ``predict_step`` outputs of every batch, one list per loader (empty with
        ``return_predictions=False``)."""
        start, epoch_start, batch_start, batch_end, epoch_end, end = EVAL_EVENTS["predict_step"]
        check_dataloader_idx(module, self.callbacks, "predict_step", (batch_start.value, batch_end.value), len(loaders))
        outputs: List[List[Any]] = []
        modes = module_modes(module)
        module.on_predict_model_eval()
        self.fire(start)
        self.fire(epoch_start)
        step = self.accelerator.step_function(model, "predict_step")
        with torch.no_grad():
            for dataloader_idx, loader in enumerate(loaders):
                outputs.append(self._predict_loader(step, loader, dataloader_idx, len(loaders), return_predictions))
        self.fire(epoch_end)
        self.fire(end)
        restore_modes(modes)
        return outputs

    def _predict_loader(
        self, step: Any, loader: Any, dataloader_idx: int, loader_count: int, return_predictions: Optional[bool]
    ) -> List[Any]:
        _, _, batch_start, batch_end, _, _ = EVAL_EVENTS["predict_step"]
        # Lightning: dataloader_idx passed, and one list of outputs per loader
        extra = (dataloader_idx,) if loader_count > 1 else ()
        outputs: List[Any] = []
        transfer = self.transfer
        prepared = keep_on_host(self.accelerator.prepare_data_loader(loader), transfer)
        limit = limited(loader_length(prepared), self.config.limit_predict_batches, "limit_predict_batches")
        for batch_idx, batch in enumerate(prepared):
            if batch_idx >= limit:
                break
            if transfer is not None:
                batch = transfer(batch, dataloader_idx)
            self.fire(batch_start, batch, batch_idx, *extra)
            with self.accelerator.autocast():
                out = step(batch, batch_idx, *extra)
            if return_predictions is not False:
                outputs.append(out)
            self.fire(batch_end, out, batch, batch_idx, *extra)
        return outputs
