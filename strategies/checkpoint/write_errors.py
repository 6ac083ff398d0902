"""Why a checkpoint could not be written, said once for every path that writes one.

A full disk surfaces as whatever the writing library raises: ``OSError`` from Python, a
``SafetensorError`` ("I/O error: ... (os error 28)") from safetensors, a ``RuntimeError``
("[enforce fail at inline_container.cc] unexpected pos") from ``torch.save``. ``save_failed`` turns
any of them into one ``CheckpointError`` naming the checkpoint, the cause, what is intact and what to
do; the asynchronous writer (``async_save.py``) and synchronous saves (``explain_write_errors``)
both use it. ``check_writable`` finds an unwritable checkpoint directory before any training.
"""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from safetensors import SafetensorError

from trainforge.strategies.checkpoint.verify import PathLike, locate, read_latest_pointer
from trainforge.strategies.errors import CheckpointError, ConfigurationError

_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file is larger than this process may write (see `ulimit -f`)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the filesystem is read-only",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EEXIST: "a part of the path is a file, not a directory",
}
_NOT_SPACE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST)
_TORCH_WRITE = ("inline_container", "PytorchStreamWriter", "file write failed")


def error_number(error: BaseException) -> Optional[int]:
    """The errno of an I/O failure, also when a library only wrote it into its message ("os error 28")."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    found = re.search(r"os error (\d+)", str(error))
    return int(found.group(1)) if found else None


def is_write_error(error: BaseException) -> bool:
    """An exception a write to disk raised (as opposed to a bug in the state being saved)."""
    if isinstance(error, (OSError, SafetensorError)):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _TORCH_WRITE)


def _free_space(path: Path) -> str:
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return f"{shutil.disk_usage(folder).free / 2**30:.2f} GiB free on {folder}"
            except OSError:
                return f"free space on {folder} unknown"
    return "free space unknown"


def save_failed(
    path: PathLike, error: BaseException, previous: Optional[PathLike], asynchronous: bool = False
) -> CheckpointError:
    """The error of a save of checkpoint ``path`` that ``error`` interrupted; ``previous``: the last
    checkpoint committed in that directory (None: none)."""
    path = Path(path)
    number = error_number(error)
    cause = _CAUSES.get(number, "") if number is not None else ""
    if number in _NOT_SPACE:
        fix = f"make {path.parent} a writable directory or save to another one"
    else:
        fix = (
            f"disk space: {_free_space(path.parent)}; free some, keep fewer checkpoints (save_top_k) or "
            f"save elsewhere (ModelCheckpoint(dirpath=...)); permissions"
        )
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint was committed"
    return CheckpointError(
        f"{'asynchronous ' if asynchronous else ''}save of {path} failed ({type(error).__name__}: "
        f"{str(error).strip()[:500]}){': ' + cause if cause else ''}; it was not committed, 'latest' was not "
        f"moved and {kept}. Fix the cause ({fix}) and save again"
    )


def last_committed(root: PathLike) -> Optional[Path]:
    """The checkpoint ``<root>/latest`` names, if it exists."""
    latest = read_latest_pointer(root)
    return locate(root, latest) if latest else None


@contextlib.contextmanager
def explain_write_errors(final_dir: PathLike, previous: Optional[PathLike]) -> Iterator[None]:
    """Around a synchronous save of ``final_dir``: a failed write raises ``save_failed``'s error
    (the raw one is its ``__cause__``); other exceptions pass unchanged."""
    try:
        yield
    except Exception as e:
        if not is_write_error(e):
            raise
        raise save_failed(final_dir, e, previous) from e


def check_writable(folder: PathLike, where: str, fix: str) -> None:
    """Create ``folder`` (and its parents) and write a file in it now, so that an unwritable checkpoint
    directory is an error before training instead of after the first epoch. ``where``: the setting and
    its value, e.g. "ModelCheckpoint(dirpath='ck')"; ``fix``: which setting to change."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".trainforge-write-test"):
            pass
    except OSError as e:
        cause = _CAUSES.get(e.errno or 0, "")
        raise ConfigurationError(
            f"{where} is not writable ({e.strerror or e}{': ' + cause if cause else ''}); no checkpoint could "
            f"be saved there. {fix} naming a directory this process can create and write to (on every rank "
            f"that saves)"
        ) from None
