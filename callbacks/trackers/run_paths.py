"""A checkpoint's tracker state is data, never an instruction: where a tracker writes comes from the
current run, and a tracker writes over nothing that trainforge did not write.

- Paths saved in a checkpoint are relative to the run's directory (``default_root_dir``); restored,
  they are resolved against the *current* run's directory and dropped when they lead outside it. A
  copied run (``cp -r run_a run_b``) therefore writes only inside its copy, and a downloaded checkpoint
  cannot point a logger at another project's files.
- Files a tracker creates in a folder are listed in that folder's ``.trainforge-owned.json``; a file
  that exists but is not listed is the user's, and is neither overwritten nor moved. The list travels
  with a copied run, so the copy's own files stay writable.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, List, Optional

OWNED_LIST = ".trainforge-owned.json"


def run_relative(path: Optional[str], root: Optional[str]) -> Optional[str]:
    """``path`` as a checkpoint records it: relative to ``root``; None when it lies outside ``root``."""
    if not path or not root:
        return None
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    return None if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def resolve_in_run(saved: object, root: str) -> Optional[str]:
    """A path restored from a checkpoint, inside the current run's directory ``root``, or None.

    A relative path is joined to ``root``; an absolute one (written by an older version) is kept only
    when it already lies inside ``root``. Anything that leads outside is refused (None)."""
    if not isinstance(saved, str) or not saved:
        return None
    full = os.path.abspath(saved if os.path.isabs(saved) else os.path.join(root, saved))
    return full if run_relative(full, root) is not None else None


def owned_names(folder: str) -> List[str]:
    try:
        with open(os.path.join(folder, OWNED_LIST)) as f:
            names = json.load(f)
    except (OSError, ValueError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def foreign_files(paths: Iterable[str]) -> List[str]:
    """The paths that exist and were not written by trainforge (not in their folder's list)."""
    out = []
    for path in paths:
        if os.path.lexists(path) and os.path.basename(path) not in owned_names(os.path.dirname(path)):
            out.append(path)
    return out


def claim(paths: Iterable[str]) -> None:
    """Record that trainforge writes ``paths`` (call before creating them)."""
    by_folder: dict = {}
    for path in paths:
        by_folder.setdefault(os.path.dirname(os.path.abspath(path)), []).append(os.path.basename(path))
    for folder, names in by_folder.items():
        known = owned_names(folder)
        new = [n for n in names if n not in known]
        if not new:
            continue
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, OWNED_LIST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(known + new, f)
        os.replace(tmp, os.path.join(folder, OWNED_LIST))
