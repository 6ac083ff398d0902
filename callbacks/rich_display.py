"""Lightning's ``RichModelSummary`` and ``RichProgressBar``: trainforge's layer table and progress display,
drawn with `rich <https://pypi.org/project/rich/>`_ (``pip install rich``; imported only when one is built).

``RichModelSummary(max_depth=1)`` prints ``ModelSummary``'s rows as a rich table at fit start, then the totals as
``Trainable params: 17`` lines (Lightning's look; trainforge has no FLOPs column). ``RichProgressBar(refresh_rate=1,
leave=False, theme=None, console_kwargs=None)`` shows ``Epoch N/M`` with a bar, the batch count, elapsed and
remaining time, the rate, and the ``prog_bar`` metrics, refreshed every ``refresh_rate`` batches, and a bar for
each validation; rank 0 only. In ``Trainer(callbacks=[...])`` it replaces the default progress bar.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, Optional

from trainforge.callbacks.model_summary import ModelSummary, summary_rows, summary_totals
from trainforge.callbacks.progress import ProgressBar
from trainforge.strategies.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from trainforge import TrainingModule
    from trainforge.callbacks.view import TrainerView


def _rich(module: str, who: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigurationError(
            f"{who} draws with the 'rich' package, which is not installed: pip install rich (or pip install "
            f"'trainforge[rich]'); or use trainforge's plain {'ModelSummary' if 'Summary' in who else 'ProgressBar'}"
        ) from None


class RichModelSummary(ModelSummary):
    """``ModelSummary`` drawn as a rich table (see the module docstring)."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if summarize_kwargs:
            raise ConfigurationError(
                f"RichModelSummary{tuple(summarize_kwargs)}: trainforge's summary takes only max_depth (Lightning's "
                "other summary options, e.g. header_style, are not supported); pass RichModelSummary(max_depth=N)"
            )
        _rich("rich.table", "RichModelSummary")
        super().__init__(max_depth)

    def on_fit_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self.max_depth == 0 or not trainer.is_global_zero:
            return
        console = _rich("rich.console", "RichModelSummary").Console()
        table = _rich("rich.table", "RichModelSummary").Table(header_style="bold magenta")
        for title in (" ", "Name", "Type", "Params", "Mode"):
            table.add_column(title, justify="right" if title == "Params" else "left")
        for row in summary_rows(module, self.max_depth):
            table.add_row(*row)
        console.print(table)
        console.print("\n".join(f"{label}: {value}" for value, label in summary_totals(module)))


class RichProgressBar(ProgressBar):
    """The progress display drawn with rich (see the module docstring)."""

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        theme: Any = None,
        console_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ConfigurationError(f"RichProgressBar(refresh_rate={refresh_rate!r}) must be an int >= 0 (0: off)")
        if theme is not None:
            raise ConfigurationError(
                f"RichProgressBar(theme={theme!r}): trainforge's rich bar has one look; pass theme=None"
            )
        self._progress_module = _rich("rich.progress", "RichProgressBar")
        super().__init__(refresh_every_n_steps=refresh_rate or None)
        self.refresh_rate, self.leave = refresh_rate, leave
        self.console_kwargs = dict(console_kwargs or {})
        self._progress: Any = None
        self._train_task: Optional[int] = None
        self._val_task: Optional[int] = None
        self._metrics = ""

    def _enabled(self, trainer: TrainerView) -> bool:
        return self.refresh_rate > 0 and trainer.is_global_zero

    def _start(self) -> Any:
        if self._progress is None:
            rp = self._progress_module
            console = _rich("rich.console", "RichProgressBar").Console(**self.console_kwargs)
            self._progress = rp.Progress(
                rp.TextColumn("[progress.description]{task.description}"),
                rp.BarColumn(),
                rp.MofNCompleteColumn(),
                rp.TimeElapsedColumn(),
                rp.TextColumn("•"),
                rp.TimeRemainingColumn(),
                rp.TextColumn("{task.fields[metrics]}"),
                console=console,
                auto_refresh=False,
            )
            self._progress.start()
        return self._progress

    def _total(self, count: Any) -> Optional[float]:
        return None if count == float("inf") else count

    def on_train_epoch_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if not self._enabled(trainer):
            return
        progress = self._start()
        if self._train_task is not None and not self.leave:
            progress.remove_task(self._train_task)
        last = trainer.max_epochs
        epochs = f"{trainer.current_epoch}/{last - 1}" if last else f"{trainer.current_epoch}"
        self._train_task = progress.add_task(
            f"Epoch {epochs}",
            total=self._total(trainer.num_training_batches),
            completed=trainer.batch_idx,
            metrics=self._metrics,
        )
        progress.refresh()

    def on_train_batch_end(
        self, trainer: TrainerView, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._enabled(trainer) or self._train_task is None:
            return
        self._progress.advance(self._train_task)
        if (batch_idx + 1) % self.refresh_rate == 0:
            self._refresh_metrics(trainer, self._train_task)

    def on_train_epoch_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._enabled(trainer) and self._train_task is not None:
            self._refresh_metrics(trainer, self._train_task)

    def on_validation_start(self, trainer: TrainerView, module: TrainingModule) -> None:
        if not self._enabled(trainer):
            return
        progress = self._start()
        title = "Sanity Checking" if trainer.stage == "sanity_check" else "Validation"
        self._val_task = progress.add_task(f"[cyan]{title}", total=None, metrics="")

    def on_validation_batch_end(self, trainer: TrainerView, module: TrainingModule, *args: Any, **kwargs: Any) -> None:
        if self._enabled(trainer) and self._val_task is not None:
            self._progress.advance(self._val_task)
            self._progress.refresh()

    def on_validation_end(self, trainer: TrainerView, module: TrainingModule) -> None:
        if self._enabled(trainer) and self._val_task is not None:
            self._progress.remove_task(self._val_task)
            self._val_task = None
            if self._train_task is not None:
                self._refresh_metrics(trainer, self._train_task)

    def _refresh_metrics(self, trainer: TrainerView, task: int) -> None:
        values = trainer.progress_bar_metrics
        self._metrics = " ".join(f"{name}: {float(value):.3f}" for name, value in values.items())  # Lightning's
        self._progress.update(task, metrics=self._metrics)
        self._progress.refresh()

    def on_teardown(self, trainer: TrainerView, module: TrainingModule, stage: str) -> None:
        self._stop()

    def on_exception(self, trainer: TrainerView, module: TrainingModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.refresh()
            self._progress.stop()
            self._progress, self._train_task, self._val_task = None, None, None
