"""The callbacks a Trainer installs: those its settings ask for, and the defaults unless the user gave their own
of the same kind. With profiling.py, the only modules of the loop that name concrete callbacks: the loop reaches
callbacks through the seams of callbacks/base.py (``tests/callbacks/test_events.py`` checks it)."""

from __future__ import annotations

from typing import Any, List, Optional

from trainforge.callbacks.base import Callback, Checkpointer
from trainforge.callbacks.hang_watchdog import hang_callbacks
from trainforge.trainer.loop.profiling import with_profiler


def setting_callbacks(callbacks: List[Callback], profiler: Any, hang_timeout: Optional[float]) -> List[Callback]:
    """The callbacks of ``Trainer(profiler=...)`` (None, "simple", "pytorch", an instance) and
    ``Trainer(hang_timeout=...)`` (None: off), added to the user's."""
    return hang_callbacks(hang_timeout, with_profiler(profiler, callbacks))


def default_callbacks(
    user: List[Callback], progress_bar: bool, checkpointing: bool, tracker: bool = True, model_summary: bool = False
) -> List[Callback]:
    from trainforge.callbacks.checkpoint import ModelCheckpoint
    from trainforge.callbacks.model_summary import ModelSummary
    from trainforge.callbacks.progress import ProgressBar
    from trainforge.callbacks.trackers.base import TrackerCallback

    out = list(user)
    if progress_bar and not any(isinstance(c, ProgressBar) for c in out):
        out.append(ProgressBar())
    if model_summary and not any(isinstance(c, ModelSummary) for c in out):
        out.append(ModelSummary())  # Lightning's: the layer table at fit start (enable_model_summary=False: none)
    if tracker and not any(isinstance(c, TrackerCallback) for c in out):
        out.append(default_logger())
    if checkpointing and not any(isinstance(c, Checkpointer) for c in out):
        out.append(ModelCheckpoint())  # Lightning's default: every epoch end (and the end of fit), the newest kept
    # Checkpointing callbacks run last, whatever the list order (Lightning does the same): a checkpoint
    # written at an event holds every other callback's state of that event (EarlyStopping's count).
    return [c for c in out if not isinstance(c, Checkpointer)] + [c for c in out if isinstance(c, Checkpointer)]


def default_logger() -> Callback:
    """Lightning's default logger: ``TensorBoardLogger`` when tensorboard is installed, else ``CSVLogger``, both
    under ``<default_root_dir>/lightning_logs/version_<N>`` (their ``save_dir`` is the Trainer's root)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        from trainforge.callbacks.trackers.tensorboard import TensorBoardLogger

        return TensorBoardLogger()
    from trainforge.callbacks.trackers.csv import CSVLogger

    return CSVLogger()
