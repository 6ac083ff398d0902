"""The default progress display: a tqdm bar on a terminal, a plain line per ``log_every_n_steps``
otherwise (CI logs, files). Main process only (rank 0), so lines of two ranks are never spliced together.

The bar shows what Lightning's TQDMProgressBar shows: ``Epoch N``, and in its postfix ``v_num`` (the logger's
version, when it has one) and the values logged with ``prog_bar=True`` (numbers as tqdm formats them, ``.3g``),
refreshed every ``log_every_n_steps``, at the epoch's end (with the epoch's values and the validation's) and
after validation. The plain lines add the step's loss (``loss=``) and the rate."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

from trainforge.callbacks.base import Callback
from trainforge.callbacks.trackers.base import TrackerCallback

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView


def _loss_of(outputs: Any) -> Any:
    return outputs.get("loss") if isinstance(outputs, dict) else outputs


def logger_version(trainer: TrainerView) -> Optional[Union[int, str]]:
    """Lightning's ``v_num``: the version of the loggers that have one (several different: joined by ``_``;
    a long name: its last four characters)."""
    found = [c.version for c in trainer.callbacks if isinstance(c, TrackerCallback) and c.version is not None]
    if not found:
        return None
    version = found[0] if len(found) == 1 else "_".join(dict.fromkeys(str(v) for v in found))
    return version[-4:] if isinstance(version, str) else version


class ProgressBar(Callback):
    """Shows the epoch's batches, ``v_num`` and the ``prog_bar`` metrics (and, as plain lines, the step, the
    loss and it/s). Values are read (a device sync on GPU) only when the display refreshes, never every step."""

    def __init__(self, refresh_every_n_steps: Optional[int] = None, stream: Any = None) -> None:
        self.refresh_every_n_steps = refresh_every_n_steps
        self.stream = stream
        self._bar: Any = None
        self._pending = 0  # batches not yet handed to tqdm
        self._last_step = 0
        self._t0 = 0.0

    def _enabled(self, trainer: TrainerView) -> bool:
        return trainer.is_global_zero

    def on_train_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if not self._enabled(trainer):
            return
        stream = self.stream if self.stream is not None else sys.stderr
        self._t0, self._last_step = time.perf_counter(), trainer.global_step
        if getattr(stream, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            total = trainer.num_training_batches
            total = None if total == float("inf") else total  # a loader without length
            initial = trainer.batch_idx if total is None else min(trainer.batch_idx, total)
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=f"Epoch {trainer.current_epoch}",
                file=stream,
                dynamic_ncols=True,
                leave=True,
                unit="batch",
            )

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._enabled(trainer):
            return
        every = self.refresh_every_n_steps or trainer.log_every_n_steps
        if self._bar is not None:
            self._pending += 1  # tqdm.update costs a few us: hand it the count in chunks
            refresh = trainer.global_step % every == 0 and trainer.global_step != self._last_step
            if refresh or self._pending >= 8:
                self._bar.update(self._pending)
                self._pending = 0
            if refresh:
                self._last_step = trainer.global_step
                self._bar.set_postfix(self._bar_postfix(trainer), refresh=False)
            return
        if trainer.global_step % every == 0 and trainer.global_step != self._last_step:
            now = time.perf_counter()
            rate = (trainer.global_step - self._last_step) / max(now - self._t0, 1e-9)
            self._t0, self._last_step = now, trainer.global_step
            fields = " ".join(f"{k}={v}" for k, v in self._postfix(trainer, outputs).items())
            stream = self.stream if self.stream is not None else sys.stderr
            print(
                f"epoch {trainer.current_epoch} step {trainer.global_step} {fields} {rate:.2f} it/s",
                file=stream,
                flush=True,
            )

    def _postfix(self, trainer: TrainerView, outputs: Any) -> Dict[str, str]:
        out: Dict[str, str] = {}
        loss = _loss_of(outputs)
        if loss is not None:
            out["loss"] = f"{float(loss.detach() if hasattr(loss, 'detach') else loss):.4g}"
        version = logger_version(trainer)
        if version is not None:
            out["v_num"] = str(version)
        for name, value in trainer.progress_bar_metrics.items():
            out[name] = f"{float(value):.4g}"
        return out

    def _bar_postfix(self, trainer: TrainerView) -> Dict[str, Any]:
        """Lightning's postfix: ``v_num``, then the ``prog_bar`` values (tqdm formats the numbers)."""
        version = logger_version(trainer)
        out: Dict[str, Any] = {} if version is None else {"v_num": version}
        out.update({name: float(value) for name, value in trainer.progress_bar_metrics.items()})
        return out

    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._bar is not None and self._enabled(trainer):
            self._bar.set_postfix(self._bar_postfix(trainer), refresh=False)

    def on_train_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._bar is not None and self._enabled(trainer):
            self._bar.set_postfix(self._bar_postfix(trainer), refresh=False)
        self._close()

    def on_teardown(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            if self._pending:
                self._bar.update(self._pending)
                self._pending = 0
            self._bar.close()
            self._bar = None
