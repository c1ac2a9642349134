"""step_timeline's report on a hand-made timeline (the instrumented kernels run on a GPU): the
medians it prints are the medians of the program times, even counts included."""
from __future__ import annotations

import re
import sys

import pytest
import torch

from tests.scripts._load import load_script


def test_the_report_prints_the_median_program_time(capsys):
    timeline = load_script("step_timeline")
    buffer = torch.zeros(len(timeline.KERNELS) * timeline.MAX_PROGRAMS * 4, dtype=torch.int64)
    runs = buffer.view(len(timeline.KERNELS), timeline.MAX_PROGRAMS, 4)
    runs[0, 0] = torch.tensor([1_000, 2_000, 0, 0])     # scoring (start ns, end ns, SM, request)
    runs[1, 0] = torch.tensor([2_000, 3_000, 0, 0])     # top-k
    runs[2, 0] = torch.tensor([3_000, 4_000, 0, 0])     # attention: 1 us on SM 0 ...
    runs[2, 1] = torch.tensor([3_000, 6_000, 1, 0])     # ... and 3 us on SM 1, each alone on its SM
    timeline.report(buffer, batch=1)
    out = capsys.readouterr().out
    attention = next(line for line in out.splitlines() if line.startswith("_sparse_token_kernel"))
    assert re.search(r"median +2\.00 us", attention)    # (1 + 3) / 2
    assert "side by side: 1: 2.00 (2)" in out


@pytest.mark.parametrize("argv", [["16", "32768", "1", "--early", "16", "--plain"],   # --plain was dropped
                                  ["16", "32768", "1", "--early", "0"],               # the rule, with splits=0
                                  ["16", "32768", "1", "--plain", "--grid-order"],
                                  ["0", "32768", "1"], ["16", "2", "4"]])
def test_contradictory_or_empty_options_are_refused_before_the_gpu(argv, monkeypatch, capsys):
    timeline = load_script("step_timeline")
    monkeypatch.setattr(sys, "argv", ["step_timeline.py", *argv])
    monkeypatch.setattr(timeline, "instrument", lambda buffer: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exc:
        timeline.main()
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
