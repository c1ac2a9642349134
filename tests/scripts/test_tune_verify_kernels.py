"""tune_verify_kernels' arithmetic on rows it would have timed (its sweeps run on a GPU): a
variant wrong in any round is not timed, and the summary prints each shape's fastest first."""
from __future__ import annotations

import math

import pytest
import torch

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


def test_a_variant_whose_output_differs_from_the_first_is_not_timed(tune, monkeypatch):
    monkeypatch.setattr(tune, "graph_us", lambda thunks: 1.0)   # every variant as fast: only the check decides
    x = torch.randn(64, 8, 128, generator=torch.Generator().manual_seed(0))
    state: dict = {}
    assert tune.time_variant("first", lambda t: t, [(x,)], state) == (1.0, 0.0)
    us, err = tune.time_variant("rounded", lambda t: t * (1 + 1e-3), [(x,)], state)
    assert us == 1.0 and err == pytest.approx(1e-3, rel=1e-3)     # rounding-order differences are timed
    us, err = tune.time_variant("one row wrong", lambda t: torch.cat([t[:1] * 0, t[1:]]), [(x,)], state)
    assert math.isnan(us) and err == pytest.approx((1 / 64) ** 0.5, rel=0.2)   # a row of 64 lost: ~1/8
    assert math.isnan(tune.time_variant("nan", lambda t: t * math.nan, [(x,)], state)[0])


def test_an_index_scoring_variant_with_other_scores_is_listed_last(tune, monkeypatch, capsys):
    import types

    launched = {}

    def scores(index_q, index_k, meta, *, max_qo_len, tma=True, blocks_per_program=1, **_):
        launched.update(tma=tma, bpp=blocks_per_program)
        wrong = tma is False and blocks_per_program == 16   # e.g. a miscompiled 16-page program
        return torch.full((1, 4, 256), 2.0 if wrong else 1.0)

    def timed(thunks):   # the wrong variant is the fastest
        thunks[0]()
        return 1.0 if (launched["tma"], launched["bpp"]) == (False, 16) else 5.0
    st = {"index_q": None, "cache": types.SimpleNamespace(index_k=None), "meta": None}
    monkeypatch.setattr(tune, "_fp8_step_sets", lambda *a, **k: (None, [st, st]))
    monkeypatch.setattr(tune, "index_k_bytes", lambda *a: 1e6)
    monkeypatch.setattr(tune, "index_block_scores", scores)
    monkeypatch.setattr(tune, "graph_us", timed)
    rows = [r for r in tune.scoring_sweep(tune.Geometry(), torch.device("cpu"), 1000.0)
            if (r["batch"], r["ctx"]) == (1, 8192)]
    wrong = [r for r in rows if "same=False" in r["variant"]]
    assert [r["variant"] for r in wrong] == ["tma=0 bpp=16 s=2 w=4 same=False", "tma=0 bpp=16 s=3 w=4 same=False"]
    assert all(math.isnan(r["us"]) for r in wrong) and all(r["us"] == 5.0 for r in rows if r not in wrong)
    tune.summary(rows)
    assert "same=False" not in capsys.readouterr().out   # not among the six fastest


def _run_main(tune, monkeypatch, *argv, ran=None):
    import sys

    ran = [] if ran is None else ran
    monkeypatch.setattr(sys, "argv", ["tune_verify_kernels.py", *argv])
    monkeypatch.setattr(tune, "copy_ceiling_gbps", lambda dev: ran.append("ceiling") or 4000.0)
    shape = {"kernel": "merge", "tokens": 4, "heads": 16, "splits": 64, "err_vs_first": 0.0}
    monkeypatch.setattr(tune, "merge_sweep", lambda dev: [dict(shape, variant="w=4", us=2.0, default=True),
                                                          dict(shape, variant="w=1", us=math.nan, default=False)])
    tune.main()
    return ran


def test_the_json_is_standard_with_a_wrong_variants_nan_time(tune, monkeypatch, tmp_path, capsys):
    import json

    out = tmp_path / "tune.json"
    _run_main(tune, monkeypatch, "--merge", "--json", str(out))

    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    data = json.loads(out.read_text(), parse_constant=refuse)   # jq refuses NaN likewise
    assert [r["us"] for r in data["rows"]] == [2.0, None]


@pytest.mark.parametrize("where", ["folder", "missing"])
def test_an_unwritable_json_path_is_refused_before_the_sweep(tune, monkeypatch, tmp_path, capsys, where):
    path = tmp_path if where == "folder" else tmp_path / "no" / "such" / "tune.json"
    ran: list = []
    with pytest.raises(SystemExit) as exc:
        _run_main(tune, monkeypatch, "--merge", "--json", str(path), ran=ran)
    assert exc.value.code == 2 and "--json" in capsys.readouterr().err and not ran
