"""What ``validate``/``test``/``predict`` take and give as Lightning's do: ``model=None`` (the module of
the previous run), a ``DataModule`` passed in place of the loaders, ``ckpt_path`` ("best", "last" or a
checkpoint directory: its weights are loaded before the loop), and the results table printed on rank 0
after ``validate``/``test`` (``verbose=True``)."""

from __future__ import annotations

import logging
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, cast

from trainforge.strategies.base import Strategy
from trainforge.strategies.checkpoint.remote_read import Location, resolve_on_ranks
from trainforge.strategies.errors import CheckpointError, ConfigurationError
from trainforge.trainer.module.datamodule import DataModule

if TYPE_CHECKING:  # pragma: no cover
    from trainforge.callbacks.base import Checkpointer
    from trainforge.trainer.module.training_module import TrainingModule

log = logging.getLogger("trainforge")
_LOADER_SUFFIX = re.compile(r"/dataloader_idx_\d+$")


class EvaluationInputs:
    """A part the Trainer builds: the module, loaders and checkpoint of a ``validate/test/predict`` call, and
    loading that checkpoint's weights. ``checkpoint_root``: where ``ckpt_path="last"`` and a relative path
    look (the Trainer's first ``Checkpointer``'s directory)."""

    def __init__(self, strategy: Strategy, checkpoint_root: Callable[[], Location]) -> None:
        self.strategy, self.checkpoint_root = strategy, checkpoint_root

    def resolve(
        self,
        stage: str,
        model: Any,
        dataloaders: Any,
        datamodule: Any,
        ckpt_path: Any,
        previous: Optional[TrainingModule],
        checkpointer: Optional[Checkpointer],
    ) -> Tuple[TrainingModule, Any, Any, Optional[Path]]:
        """(module, loaders, datamodule, checkpoint to load) of a ``validate/test/predict`` call;
        ``previous``: the module of the Trainer's previous run, ``checkpointer``: its first ``Checkpointer``."""
        if isinstance(dataloaders, DataModule):
            # passed where the loaders go, as Lightning detects
            if datamodule is not None:
                raise ConfigurationError(
                    f"Trainer.{stage}() got a DataModule as dataloaders and datamodule= too; pass one of them"
                )
            dataloaders, datamodule = None, dataloaders
        if dataloaders is not None and datamodule is not None:
            raise ConfigurationError(
                f"Trainer.{stage}() got both dataloaders and datamodule=; pass one of them (the loaders "
                f"of a DataModule are its {stage}_dataloader())"
            )
        given = model is not None
        if model is None:
            if previous is None:
                raise ConfigurationError(
                    f"Trainer.{stage}() got no model and this Trainer has run none: pass it, "
                    f"trainer.{stage}(model, ...)"
                )
            model = previous
            if ckpt_path is None:
                # Lightning: the best weights of the previous fit
                ckpt_path = "best"
                warnings.warn(
                    f"Trainer.{stage}(ckpt_path=None) was called without a model: the best checkpoint of the "
                    f"previous fit is loaded. Pass ckpt_path='best' or 'last' (a checkpoint), or the model to "
                    f"{stage} its current weights, to silence this warning",
                    UserWarning,
                    stacklevel=3,
                )
        return model, dataloaders, datamodule, self._checkpoint(stage, ckpt_path, given, checkpointer)

    def _checkpoint(self, stage: str, ckpt_path: Any, model_given: bool, cb: Optional[Checkpointer]) -> Optional[Path]:
        if ckpt_path is None:
            return None
        if str(ckpt_path) == "best":
            if cb is None:
                raise CheckpointError(
                    f"Trainer.{stage}(ckpt_path='best'): this Trainer has no ModelCheckpoint "
                    "(enable_checkpointing=False); pass a checkpoint directory, or the model to use its current "
                    "weights" + (f" (trainer.{stage}(model))" if not model_given else "")
                )
            if cb.monitor is None:
                # Lightning: without a monitor the best is the newest save
                return self._resolve(self.checkpoint_root(), "last")
            if cb.best_model_path is None:
                raise CheckpointError(
                    f"Trainer.{stage}(ckpt_path='best'): ModelCheckpoint(monitor={cb.monitor!r}) has saved no "
                    "checkpoint yet (fit first, or pass ckpt_path='last' or a checkpoint directory)"
                )
            return self._resolve(self.checkpoint_root(), cb.best_model_path)
        if not isinstance(ckpt_path, (str, Path)):
            raise ConfigurationError(
                f"ckpt_path={ckpt_path!r} must be 'best', 'last' or a checkpoint directory (str or pathlib.Path)"
            )
        return self._resolve(self.checkpoint_root(), ckpt_path)

    def _resolve(self, root: Any, ckpt_path: Any) -> Path:
        """``resolve_checkpoint``; in object storage, downloaded and verified (strategies/checkpoint/remote_read.py)."""
        s = self.strategy
        found = resolve_on_ranks(
            root, ckpt_path, rank=s.global_rank, broadcast=s.broadcast, world_size=s.world_size, barrier=s.barrier
        )
        return cast(Path, found)

    def load_weights(self, path: Optional[Path], model: Any) -> None:
        """The module's weights from ``path`` into the prepared ``model`` (only them, as Lightning restores
        for evaluation)."""
        if path is None:
            return
        self.strategy.load_checkpoint(path, model, [])
        if self.strategy.is_global_zero:
            log.info("trainforge: loaded model weights from the checkpoint at %s", path)


def print_results(results: List[Dict[str, float]], stage: str) -> None:
    """The table of the metrics of each dataloader (Lightning prints the same after validate/test)."""
    results = [{_LOADER_SUFFIX.sub("", k): v for k, v in r.items()} for r in results]  # as Lightning prints them
    names = sorted({k for r in results for k in r})
    if not names:
        return
    headers = [f"{stage.capitalize()} metric"] + [f"DataLoader {i}" for i in range(len(results))]
    width = max(25, max(len(n) for n in names), max(len(h) for h in headers))
    width = min(width, shutil.get_terminal_size(fallback=(120, 30)).columns // 2)
    bar = "─"
    try:
        bar.encode(sys.stdout.encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):  # a terminal without it
        bar = "-"
    rule = bar * (width * len(headers))
    lines = [rule, "".join(h.center(width) for h in headers), rule]
    for name in names:
        values = [str(r[name]) if name in r else " " for r in results]
        lines.append("".join(c.center(width) for c in [name] + values))
    lines.append(rule)
    print("\n".join(lines), flush=True)


def fit_datamodule(train_dataloaders: Any, val_dataloaders: Any, datamodule: Any) -> Tuple[Any, Any]:
    """``fit(model, dm)``: a DataModule where the training loaders go is the datamodule (Lightning)."""
    if isinstance(train_dataloaders, DataModule):
        if datamodule is not None:
            raise ConfigurationError(
                "Trainer.fit() got a DataModule as train_dataloaders and datamodule= too; pass one"
            )
        train_dataloaders, datamodule = None, train_dataloaders
    if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
        raise ConfigurationError(
            "Trainer.fit() got loaders and datamodule=; pass one of them (a DataModule's loaders are its "
            "train_dataloader() and val_dataloader())"
        )
    return train_dataloaders, datamodule
