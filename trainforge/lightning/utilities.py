"""``lightning.pytorch.utilities`` (and ``.rank_zero``, ``lightning_utilities.core.rank_zero``): the rank-zero
helpers, with Lightning's semantics (trainer/compat/lightning/rank_zero.py says where the rank comes from)."""

from trainforge.trainer.compat.lightning.rank_zero import (
    rank_prefixed_message,
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)

__all__ = [
    "rank_zero_only",
    "rank_zero_debug",
    "rank_zero_info",
    "rank_zero_warn",
    "rank_zero_deprecation",
    "rank_prefixed_message",
]
