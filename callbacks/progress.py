"""The default progress display: a tqdm bar on a terminal, a plain line per ``log_every_n_steps``
otherwise (CI logs, files). Main process only."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Dict, Optional

from trainforge.callbacks.base import Callback

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView


def _loss_of(outputs: Any) -> Any:
    return outputs.get("loss") if isinstance(outputs, dict) else outputs


class ProgressBar(Callback):
    """Shows the step, the loss and it/s. The loss is read (a device sync on GPU) only when the
    display refreshes, never every step."""

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
                desc=f"epoch {trainer.current_epoch}",
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
                self._bar.set_postfix(self._postfix(trainer, outputs), refresh=False)
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
        for name, value in trainer.progress_bar_metrics.items():
            out[name] = f"{float(value):.4g}"
        return out

    def on_train_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None:
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
