"""Runs the user's script in each worker: ``python -m trainforge.trainer.cli.bootstrap script.py [args...]``.

``trainforge launch`` makes torchrun start this module instead of the script so that the script
runs under torch elastic's ``@record``: an exception in a rank is written to torchrun's error file
and shown in the launcher's failure summary (rank, host, traceback). To the script everything looks
like ``python script.py args``: ``sys.argv``, ``__name__ == "__main__"`` and ``sys.path[0]`` (the
script's folder).
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List

from torch.distributed.elastic.multiprocessing.errors import record

from trainforge.trainer.cluster.stuck_process import watch_launcher


@record
def run_script(argv: List[str]) -> None:
    """Runs ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m trainforge.trainer.cli.bootstrap SCRIPT [ARGS...]")
    watch_launcher()  # from the start: a worker stuck before its Trainer exists ends with its launcher too
    run_script(sys.argv[1:])
