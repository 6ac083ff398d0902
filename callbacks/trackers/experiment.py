"""``tracker.experiment`` (Lightning's ``logger.experiment``): the backend's own object, for what the
tracker does not write itself (``add_image``, ``add_histogram``, an MLflow artifact...).

It exists during fit on rank 0, opened at fit start on the tracker's writer thread (the property waits
for that, at most ``flush_timeout_s``): TensorBoardLogger's ``SummaryWriter``, MLflowLogger's
``MlflowClient`` (with ``tracker.run_id``), CometLogger's comet_ml ``Experiment``. On the other ranks it
is a stand-in whose every call does nothing, as Lightning's ``DummyExperiment``; so is it, with a
``TrackerWarning``, on rank 0 when the backend could not be opened or the run has ended (the failure
policy: a dead tracker never stops training). Calls on the real object go to the backend directly,
from the calling thread, outside the failure policy. Before fit it is an error naming when it exists.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional


class NoExperiment:
    """Every attribute is a call that does nothing and returns the stand-in (Lightning's DummyExperiment)."""

    def __getattr__(self, name: str) -> Any:
        return self._nothing

    def _nothing(self, *args: Any, **kwargs: Any) -> NoExperiment:
        return self

    def __getitem__(self, index: Any) -> NoExperiment:
        return self

    def __repr__(self) -> str:
        return "NoExperiment()"


NO_EXPERIMENT = NoExperiment()


def experiment_or_stand_in(name: str, found: Any, rank_zero: Optional[bool], warning: type) -> Any:
    """What ``tracker.experiment`` gives: ``found`` (the opened backend object, or None) on rank 0."""
    if rank_zero is None:
        from trainforge.strategies.errors import ConfigurationError

        raise ConfigurationError(
            f"{name}.experiment is opened at fit start (on rank 0, the process that writes) and exists "
            "during fit: use it from a step or a hook of trainer.fit (self.logger.experiment), not before"
        )
    if not rank_zero:
        return NO_EXPERIMENT
    if found is None:
        warnings.warn(
            f"{name}.experiment: the backend is not open (it could not be opened: see the first TrackerWarning; "
            "or the run has ended), so calls on it do nothing",
            warning,
            stacklevel=3,
        )
        return NO_EXPERIMENT
    return found
