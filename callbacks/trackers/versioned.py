"""Lightning's directory layout for the loggers that write files (``CSVLogger``, ``TensorBoardLogger``):
``<save_dir>/<name>/<version>``, the version ``version_<N>`` with the next free ``N`` unless given.

- ``save_dir``: None means the Trainer's ``default_root_dir``, set when the Trainer settles the loggers at the
  start of each stage (``settle``; Lightning's default logger is ``TensorBoardLogger(default_root_dir)``).
- ``name``: ``"lightning_logs"`` by default; None or ``""``: the versions go straight into ``save_dir``.
- ``version``: None picks ``max(N) + 1`` over the existing ``version_<N>`` folders (0 when there are none) when it
  is first needed, once per logger, so a second run in the same folder gets ``version_1`` and its own files
  (never a renamed ``metrics.1.csv``); an int ``N`` is ``version_N``; a string is the folder's name as given.
  On several processes rank 0 picks it and broadcasts it (``settle``), so every rank names the same folder.
- ``log_dir``: ``<root_dir>/<version>`` (TensorBoard: then ``/<sub_dir>``); ``root_dir``: ``<save_dir>/<name>``.

The settled version is taken up for the checkpoints too: ModelCheckpoint without ``dirpath`` writes to
``<log_dir>/checkpoints``, as Lightning, so two Trainers in one script never share a checkpoint folder.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any, Callable, Dict, Mapping, Optional, Union

from trainforge.strategies.errors import ConfigurationError

_VERSION = re.compile(r"version_(\d+)")


def check_save_dir(value: Any, logger: str) -> Optional[str]:
    """``save_dir``: None (the Trainer's ``default_root_dir``) or a path; an existing file is refused."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(
            f"{logger}(save_dir={value!r}): save_dir must be a directory path (str or pathlib.Path) such as "
            "'logs', or None for the Trainer's default_root_dir"
        )
    if os.path.isfile(value):
        raise ConfigurationError(
            f"{logger}(save_dir={value!r}) is a file; save_dir is the folder the logger writes "
            f"<save_dir>/<name>/version_<N>/ into: pass a directory (a new one is made)"
        )
    return value


def check_name(value: Any, logger: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or os.path.isabs(value) or ".." in value.split("/"):
        raise ConfigurationError(
            f"{logger}(name={value!r}): name must be a folder name (str) such as 'lightning_logs', or None to "
            "write the versions straight into save_dir"
        )
    return value


def check_version(value: Any, logger: str) -> Optional[Union[int, str]]:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    if isinstance(value, str) and value.strip() and not os.path.isabs(value) and ".." not in value.split("/"):
        return value
    raise ConfigurationError(
        f"{logger}(version={value!r}): version must be None (the next free version_<N>), an int N >= 0 "
        "(the folder version_N) or a folder name (str) such as 'baseline'"
    )


def check_prefix(value: Any, logger: str) -> str:
    if not isinstance(value, str):
        raise ConfigurationError(
            f"{logger}(prefix={value!r}): prefix must be a string put before every metric name ('' for none)"
        )
    return value


def check_positive(value: Any, logger: str, arg: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{logger}({arg}={value!r}): {arg} must be an int >= 1")
    return value


def module_hparams(hparams: Mapping[str, Any]) -> Dict[str, Any]:
    """What Lightning's loggers write to ``hparams.yaml``: the module's (and datamodule's) hyperparameters,
    without the ``trainer`` settings that ``trainer.hparams`` adds for the other trackers."""
    return {k: v for k, v in hparams.items() if k != "trainer"}


def plain_params(params: Any, logger: str) -> Dict[str, Any]:
    """``log_hyperparams``'s argument: a mapping or an ``argparse.Namespace`` (Lightning's), as a dict."""
    if isinstance(params, argparse.Namespace):
        return dict(vars(params))
    if isinstance(params, Mapping):
        return {str(k): v for k, v in params.items()}
    raise ConfigurationError(
        f"{logger}.log_hyperparams({type(params).__name__}): pass a dict of name to value or an argparse.Namespace"
    )


def next_version(root_dir: str) -> int:
    """``max(N) + 1`` over the ``version_<N>`` folders of ``root_dir`` (0 when there are none), as Lightning."""
    try:
        names = os.listdir(root_dir)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    taken = [
        int(m.group(1))
        for m in (_VERSION.fullmatch(n) for n in names)
        if m and os.path.isdir(os.path.join(root_dir, m.group(0)))
    ]
    return max(taken, default=-1) + 1


class VersionedDir:
    """Lightning's ``save_dir`` / ``name`` / ``version`` / ``root_dir`` / ``log_dir`` of a file logger;
    ``sub_dir`` (TensorBoard) goes below the version folder."""

    def __init__(self, logger: str, save_dir: Any, name: Any, version: Any, sub_dir: Any = None) -> None:
        self.logger = logger
        self.save_dir: Optional[str] = check_save_dir(save_dir, logger)
        self.name = check_name(name, logger)
        self._version = check_version(version, logger)
        self._settled = version is not None  # given: the same on every rank, nothing to agree on
        self.sub_dir = check_name(sub_dir, logger) or None if sub_dir is not None else None

    @property
    def root_dir(self) -> str:
        return os.path.join(self.required_save_dir(), self.name) if self.name else self.required_save_dir()

    @property
    def version(self) -> Union[int, str]:
        if self._version is None:
            self._version = next_version(self.root_dir)
        return self._version

    @property
    def log_dir(self) -> str:
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        path = os.path.join(self.root_dir, version)
        return os.path.join(path, self.sub_dir) if self.sub_dir else path

    def settle(self, default_root_dir: str, broadcast: Callable[[Any, int], Any], continuing: bool = False) -> str:
        """At the start of a fit, on every rank: ``save_dir`` from the Trainer unless given, the version picked by
        rank 0 (the same on every rank), the log directory returned. ``continuing`` (``fit(ckpt_path="last")``,
        ``Trainer(resume="auto")``): the newest ``version_<N>``, where the run's last checkpoint is, instead of a
        new one (an unversioned Lightning run would look in a new, empty folder and start fresh)."""
        self.place(default_root_dir)
        if not self._settled:  # once per logger, on every rank together (rank 0's version, however it got one)
            if self._version is None:
                free = next_version(self.root_dir)
                self._version = free - 1 if continuing and free > 0 else free
            self._version = broadcast(self._version, 0)
            self._settled = True
        return self.log_dir

    def place(self, default_root_dir: str) -> None:
        """``save_dir`` from the Trainer unless given (this rank only; the version is picked when first read)."""
        if self.save_dir is None:
            self.save_dir = str(default_root_dir)

    def version_dir(self, default_root_dir: str) -> str:
        """``<save_dir>/<name>/<version>`` (no ``sub_dir``), where Lightning puts a run's ``checkpoints/``."""
        self.place(default_root_dir)
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        return os.path.join(self.root_dir, version)

    def required_save_dir(self) -> str:
        if self.save_dir is None:
            raise ConfigurationError(
                f"{self.logger}(save_dir=None) writes under the Trainer's default_root_dir, known once a Trainer "
                f"runs it: read log_dir during fit (self.logger.log_dir), or pass {self.logger}(save_dir=...)"
            )
        return self.save_dir
