"""The callbacks a Trainer installs unless the user gave their own of the same kind."""

from __future__ import annotations

from typing import List

from trainforge.callbacks.base import Callback


def default_callbacks(
    user: List[Callback], progress_bar: bool, checkpointing: bool, tracker: bool = True, model_summary: bool = False
) -> List[Callback]:
    from trainforge.callbacks.checkpoint import ModelCheckpoint
    from trainforge.callbacks.model_summary import ModelSummary
    from trainforge.callbacks.progress import ProgressBar
    from trainforge.callbacks.trackers.base import TrackerCallback
    from trainforge.callbacks.trackers.csv import CSVLogger

    out = list(user)
    if progress_bar and not any(isinstance(c, ProgressBar) for c in out):
        out.append(ProgressBar())
    if model_summary and not any(isinstance(c, ModelSummary) for c in out):
        out.append(ModelSummary())  # Lightning's: the layer table at fit start (enable_model_summary=False: none)
    if tracker and not any(isinstance(c, TrackerCallback) for c in out):
        out.append(CSVLogger())  # always available; the default when no tracker is given
    if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in out):
        out.append(ModelCheckpoint())  # Lightning's default: every epoch end (and the end of fit), the newest kept
    # Checkpointing callbacks run last, whatever the list order (Lightning does the same): a checkpoint
    # written at an event holds every other callback's state of that event (EarlyStopping's count).
    return [c for c in out if not isinstance(c, ModelCheckpoint)] + [c for c in out if isinstance(c, ModelCheckpoint)]
