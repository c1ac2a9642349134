"""profile_sparse_verify's arguments (its profile runs on a GPU): the shape given is the shape
profiled, or the run stops with its usage before anything is built; one or two numbers (or a
flag) profiled the default B64/32K q4 shape without a word."""
from __future__ import annotations

import sys

import pytest

from tests.scripts._load import load_script


@pytest.mark.parametrize("argv", [["16"], ["16", "8192"], ["--help"], ["16", "8192", "4", "extra"],
                                  ["16", "8K", "4"], ["16", "2", "4"], ["0", "8192", "4"]])
def test_a_shape_that_is_not_three_numbers_stops_with_the_usage(argv, monkeypatch):
    from m3_eagle_plugin.bench import kernel_suite

    monkeypatch.setattr(sys, "argv", ["profile_sparse_verify.py", *argv])
    monkeypatch.setattr(kernel_suite, "StepSet", lambda *a, **k: pytest.fail("built inputs"))
    with pytest.raises(SystemExit) as exc:
        load_script("profile_sparse_verify")
    assert "usage: python scripts/profile_sparse_verify.py" in str(exc.value.code)
