"""The Trainer's evaluation loops: validation inside fit, the sanity check, ``validate``, ``test``
and ``predict`` (Lightning's hooks: ``on_<stage>_start``, ``_epoch_start``, ``_batch_start``,
``_batch_end``, ``_epoch_end``, ``_end``; see ``callbacks/events.py``).

Train/eval modes are restored per submodule after each loop, so a submodule the user put in eval
mode (a frozen encoder, batch-norm statistics) stays there (Lightning 2.2+)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from torch import nn

from trainforge.callbacks.events import EVAL_EVENTS, Event
from trainforge.strategies.errors import ConfigurationError
from trainforge.trainer.accelerator.seed import rng_state, set_rng_state
from trainforge.trainer.loop.eval_results import EvaluationInputs, print_results
from trainforge.trainer.loop.module_hooks import check_dataloader_idx
from trainforge.trainer.loop.settings import limited, loader_length

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.strategies.base import Strategy
    from trainforge.trainer.accelerator.accelerator import Accelerator
    from trainforge.trainer.loop.metrics import MetricStore
    from trainforge.trainer.loop.settings import LoopConfig
    from trainforge.trainer.module.training_module import TrainingModule


def _with_index(step: Any, dataloader_idx: int, batch: Any, batch_idx: int) -> Any:
    return step(batch, batch_idx, dataloader_idx)


def module_modes(module: nn.Module) -> Dict[nn.Module, bool]:
    return {m: m.training for m in module.modules()}


def restore_modes(modes: Dict[nn.Module, bool]) -> None:
    for m, training in modes.items():
        m.training = training


_LIMITS = {"validation_step": "limit_val_batches", "test_step": "limit_test_batches"}


class Evaluation(EvaluationInputs):
    """Mixed into ``Trainer``."""

    if TYPE_CHECKING:  # the Trainer's, for the type checker
        module: Optional[TrainingModule]
        model: Any
        accelerator: Accelerator
        strategy: Strategy
        config: LoopConfig
        stage: str
        num_sanity_val_steps: int
        val_dataloaders: List[Any]
        callbacks: List[Any]
        callback_metrics: Dict[str, Any]
        _metrics: Dict[str, MetricStore]
        _running: str
        _batch: Any
        _dataloader_idx: Optional[int]
        _loader_of: Dict[str, int]

        def _fire(self, event: Event, *args: Any) -> None: ...
        def _emit(self, metrics: Dict[str, float]) -> None: ...
        def _fire_epoch_end(self, event: Event) -> None: ...
        def _attach(self, module: TrainingModule, stage: str) -> None: ...
        def _loaders_for(self, stage: str, given: Any, datamodule: Any, required: bool = True) -> List[Any]: ...
        @staticmethod
        def _check_loader(loader: Any, name: str) -> None: ...
        def _setup_hooks(self, stage: str, datamodule: Any) -> None: ...
        def _pipeline_loss_name(self, step_name: str) -> str: ...

    def _run_validation(self, loaders: List[Any], step_name: str, max_batches: Optional[int] = None) -> None:
        start, epoch_start, batch_start, batch_end, epoch_end, end = EVAL_EVENTS[step_name]
        module = self.module
        assert module is not None, "a module is attached before its loops run"
        modes, self._running = module_modes(module), "val"
        module.eval()
        several = len(loaders) > 1  # each loader's index goes to the step and batch hooks (Lightning)
        check_dataloader_idx(module, self.callbacks, step_name, (batch_start.value, batch_end.value), len(loaders))
        self._loader_of = {}
        self._fire(start)
        self._fire(epoch_start)
        with torch.no_grad():
            step = self.accelerator.step_function(self.model, step_name)
            loss_name = self._pipeline_loss_name(step_name) if self.strategy.pipelined else None
            for dataloader_idx, loader in enumerate(loaders):
                extra = (dataloader_idx,) if several else ()
                self._dataloader_idx = dataloader_idx if several else None
                loader_step = step if not several else functools.partial(_with_index, step, dataloader_idx)
                count = loader_length(loader)
                name = _LIMITS[step_name]  # each loop its own limit (Lightning): test is not cut by validation's
                limit = limited(count, getattr(self.config, name), name)
                if max_batches is not None and max_batches >= 0:
                    limit = min(limit, max_batches)
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= limit:
                        break
                    self._batch = batch
                    self._fire(batch_start, batch, batch_idx, *extra)
                    out = self.strategy.evaluate_batch(self.model, loader_step, batch, batch_idx)
                    if loss_name is not None:  # a pipeline's loss through the stages
                        module.log(loss_name, out, sync_dist=True)
                    self._fire(batch_end, out, batch, batch_idx, *extra)
            self._dataloader_idx = None
        sanity = self.stage == "sanity_check"
        metrics = self._metrics["val"].pop_epoch_metrics(self.strategy, compute=not sanity)
        if not sanity:  # the sanity check's values are dropped (Lightning)
            self._emit(metrics)
        self._fire_epoch_end(epoch_end)
        self._fire_epoch_end(end)
        self._running = "train"
        restore_modes(modes)

    def _sanity_check(self) -> None:
        """``num_sanity_val_steps`` validation batches before training, so a broken validation_step
        fails in seconds. Callbacks see ``trainer.stage == "sanity_check"`` (and ``sanity_checking``)."""
        n = self.num_sanity_val_steps
        if n == 0 or not self.val_dataloaders or self.config.limit_val_batches == 0:
            return
        self.stage = "sanity_check"
        state = rng_state()  # isolated, as Lightning does: the same seed trains the same with or without it
        try:
            self._fire(Event.SANITY_CHECK_START)
            self._run_validation(self.val_dataloaders, "validation_step", max_batches=n)
            self._fire(Event.SANITY_CHECK_END)
        finally:
            self.stage = "fit"
            set_rng_state(state)

    @property
    def sanity_checking(self) -> bool:
        return self.stage == "sanity_check"

    def validate(
        self,
        model: Optional["TrainingModule"] = None,
        dataloaders: Any = None,
        ckpt_path: Optional[str] = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> List[Dict[str, float]]:
        """Lightning's ``validate``: the metrics logged, as a list of one dict (the table printed on
        rank 0 with ``verbose``); ``ckpt_path`` 'best'/'last'/a directory loads those weights first."""
        return self._evaluate(model, dataloaders, "validate", "validation_step", datamodule, ckpt_path, verbose)

    def test(
        self,
        model: Optional["TrainingModule"] = None,
        dataloaders: Any = None,
        ckpt_path: Optional[str] = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> List[Dict[str, float]]:
        return self._evaluate(model, dataloaders, "test", "test_step", datamodule, ckpt_path, verbose)

    def _evaluate(
        self, model: Any, dataloaders: Any, stage: str, step_name: str, datamodule: Any, ckpt_path: Any, verbose: bool
    ) -> List[Dict[str, float]]:
        module, dataloaders, datamodule, path = self._eval_inputs(stage, model, dataloaders, datamodule, ckpt_path)
        self._attach(module, stage)
        self._setup_hooks(stage, datamodule)
        loaders = self._loaders_for(stage, dataloaders, datamodule)
        for i, dl in enumerate(loaders):
            self._check_loader(dl, f"dataloaders[{i}]")
        try:
            self._prepare_eval(module, loaders)
            self._load_eval_weights(path)
            before = dict(self.callback_metrics)
            self._run_validation([self.accelerator.prepare_data_loader(dl) for dl in loaders], step_name)
            self._fire(Event.TEARDOWN, stage)
        except BaseException as exc:
            self._fire(Event.EXCEPTION, exc)
            self._fire(Event.TEARDOWN, stage)
            raise
        # one dict per loader: what it logged (with several, names end in /dataloader_idx_N), and what the
        # epoch-end hooks logged in each (Lightning)
        logged = {k: float(v) for k, v in self.callback_metrics.items() if before.get(k) is not v}
        results = [{k: v for k, v in logged.items() if self._loader_of.get(k, i) == i} for i in range(len(loaders))]
        if verbose and self.strategy.is_global_zero:
            print_results(results, stage)
        return results

    def predict(
        self,
        model: Optional["TrainingModule"] = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        return_predictions: Optional[bool] = None,
        ckpt_path: Optional[str] = None,
    ) -> Optional[List[Any]]:
        """Lightning's ``predict``: the ``predict_step`` outputs of every batch (None with
        ``return_predictions=False``)."""
        if return_predictions not in (None, True, False):
            raise ConfigurationError(f"return_predictions={return_predictions!r} must be True, False or None")
        module, dataloaders, datamodule, path = self._eval_inputs("predict", model, dataloaders, datamodule, ckpt_path)
        self._attach(module, "predict")
        self._setup_hooks("predict", datamodule)
        loaders = self._loaders_for("predict", dataloaders, datamodule)
        self._prepare_eval(module, loaders)
        self._load_eval_weights(path)
        start, epoch_start, batch_start, batch_end, epoch_end, end = EVAL_EVENTS["predict_step"]
        several = len(loaders) > 1  # Lightning: dataloader_idx passed, and one list of outputs per loader
        check_dataloader_idx(module, self.callbacks, "predict_step", (batch_start.value, batch_end.value), len(loaders))
        outputs: List[List[Any]] = []
        modes = module_modes(module)
        module.eval()
        self._fire(start)
        self._fire(epoch_start)
        step = self.accelerator.step_function(self.model, "predict_step")
        with torch.no_grad():
            for dataloader_idx, loader in enumerate(loaders):
                extra = (dataloader_idx,) if several else ()
                outputs.append([])
                prepared = self.accelerator.prepare_data_loader(loader)
                limit = limited(loader_length(prepared), self.config.limit_predict_batches, "limit_predict_batches")
                for batch_idx, batch in enumerate(prepared):
                    if batch_idx >= limit:
                        break
                    self._fire(batch_start, batch, batch_idx, *extra)
                    with self.accelerator.autocast():
                        out = step(batch, batch_idx, *extra)
                    if return_predictions is not False:
                        outputs[-1].append(out)
                    self._fire(batch_end, out, batch, batch_idx, *extra)
        self._fire(epoch_end)
        self._fire(end)
        restore_modes(modes)
        self._fire(Event.TEARDOWN, "predict")
        if return_predictions is False:
            return None
        return outputs if several else outputs[0]

    def _prepare_eval(self, module: "TrainingModule", loaders: Any = ()) -> None:
        if self.model is None or self.accelerator.unwrap_model(self.model) is not module:
            # a layout chosen from the model and the first loader's batches ("auto" sizes)
            self.strategy.plan_layout(module, loaders[0] if loaders else None)
            # the Trainer's own path (no optimizers here): the loops run the steps under autocast,
            # so the module's forward is not wrapped as Accelerator.prepare wraps a user's model
            self.model, _ = self.accelerator.prepare_model_with_optimizers(module, list)
