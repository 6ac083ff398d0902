"""``python -m trainforge`` is the ``trainforge`` command line."""

import sys

from trainforge.trainer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
