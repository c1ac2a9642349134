"""tune_verify_kernels' arithmetic on rows it would have timed (its sweeps run on a GPU): a
variant wrong in any round is not timed, and the summary prints each shape's fastest first."""
from __future__ import annotations

import math

import pytest

from m3_eagle_plugin.msa.kernels import launch
from tests.scripts._load import load_script


@pytest.fixture
def tune(monkeypatch):
    monkeypatch.setattr(launch, "RETRY_FEWER_STAGES", launch.RETRY_FEWER_STAGES)  # the import turns it off
    return load_script("tune_verify_kernels")


@pytest.mark.parametrize("rounds", [[5.0, math.nan, math.nan], [math.nan, 5.0, 4.0], [4.0, 3.0, math.nan]])
def test_a_variant_wrong_in_any_round_has_no_time(tune, rounds):
    assert math.isnan(tune.best_round(rounds))


def test_a_variant_right_in_every_round_takes_its_fastest(tune):
    assert tune.best_round([5.0, 3.0, 4.0]) == 3.0


def test_the_summary_lists_a_shape_fastest_first_and_a_wrong_variant_last(tune, capsys):
    shape = {"kernel": "sparse_step_pdl", "batch": 1, "ctx": 8192, "qo": 4, "pct": math.nan}
    rows = [dict(shape, variant=name, us=us, default=name == "b")
            for name, us in (("c", 3.0), ("wrong", math.nan), ("a", 1.0), ("b", 2.0))]
    tune.summary(rows)
    printed = [line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]]
    assert printed == ["a", "(default)", "c", "wrong"]
