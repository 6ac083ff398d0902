"""Lightning's rank-zero helpers under `trainforge launch` on 2 processes (tests/trainer/test_lightning_utilities.py):
each rank prints what the decorated function returned and whether the warning was given on it."""

import logging
import warnings

from trainforge.lightning.utilities import rank_zero_info, rank_zero_only, rank_zero_warn


@rank_zero_only
def only_zero() -> str:
    return "ran"


logging.basicConfig(level=logging.INFO, format="%(message)s")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    rank_zero_warn("careful")
rank_zero_info("info from rank zero")
print(
    f"rank={rank_zero_only.rank} result={only_zero()} default={rank_zero_only(lambda: 1, default=-1)()} "
    f"warned={len(caught)}",
    flush=True,
)
