"""Files trainforge writes beside a user's (reports, traces): never over one that exists."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Tuple


def open_new(path: Path | str, limit: int = 1000) -> Tuple[IO[str], Path]:
    """``path`` created for writing, or ``<stem>-1<suffix>``, ``-2``... when it exists (a user's file, or
    an earlier run's report): exclusive creation, so nothing is overwritten, even by a concurrent writer."""
    path = Path(path)
    for i in range(limit):
        candidate = path if i == 0 else path.with_name(f"{path.stem}-{i}{path.suffix}")
        try:
            return open(candidate, "x"), candidate
        except FileExistsError:
            continue
    raise FileExistsError(
        f"{path} and {limit - 1} numbered variants of it exist; remove old reports from {path.parent}"
    )
