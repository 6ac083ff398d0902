"""Lightning's ``rank_zero_only``/``rank_zero_info``/``rank_zero_warn`` (``lightning.pytorch.utilities``) from
``trainforge.lightning.utilities``, with the rank of real processes (trainer/compat/lightning/rank_zero.py)."""

from __future__ import annotations

import logging
import warnings

import pytest

from tests.helpers.procs import REPO, run, trainforge_launch
from trainforge.lightning.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from trainforge.strategies.errors import ConfigurationError


@pytest.fixture
def rank_one():
    rank_zero_only.rank = 1
    yield
    rank_zero_only.rank = None


def test_a_plain_process_is_rank_zero_and_runs_the_function():
    calls = []
    assert rank_zero_only.rank == 0
    assert rank_zero_only(lambda: calls.append(1) or "done")() == "done"
    assert calls == [1]


def test_an_assigned_rank_wins_and_other_ranks_get_the_default(rank_one, caplog):
    assert rank_zero_only(lambda: "done")() is None
    assert rank_zero_only(lambda: "done", default=7)() == 7
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="trainforge"):
        warnings.simplefilter("always")
        rank_zero_warn("not here")
        rank_zero_info("nor here")
    assert caught == [] and "nor here" not in caplog.text


def test_rank_zero_warn_and_info_on_rank_zero(caplog):
    with pytest.warns(UserWarning, match="careful"):
        rank_zero_warn("careful")
    with caplog.at_level(logging.INFO, logger="trainforge"):
        rank_zero_info("hello %s", "there")
    assert "hello there" in caplog.text


def test_a_bad_rank_is_refused_naming_the_value():
    with pytest.raises(ConfigurationError, match=r"rank_zero_only.rank='1' must be a global rank"):
        rank_zero_only.rank = "1"
    with pytest.raises(ConfigurationError, match="decorate a function"):
        rank_zero_only(3)


@pytest.mark.slow
def test_each_launched_rank_knows_its_rank_before_any_trainer():
    out = run(trainforge_launch(REPO / "tests/scripts/rank_zero_names.py"), timeout=120).stdout
    assert "rank=0 result=ran default=1 warned=1" in out, out
    assert "rank=1 result=None default=-1 warned=0" in out, out
    assert out.count("info from rank zero") == 1, out
