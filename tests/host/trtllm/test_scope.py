"""Which calls count as MiniMax-M3, and the unified-KV marks."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.host.trtllm import scope


def test_reference_cases():
    assert scope.is_minimax_m3(SimpleNamespace(algorithm="minimax_m3"))
    assert scope.is_minimax_m3({"algorithm": "minimax_m3"})
    assert not scope.is_minimax_m3(None)
    assert not scope.is_minimax_m3(SimpleNamespace(algorithm="rocket"))
    assert not scope.is_minimax_m3(SimpleNamespace())
    spec, twin = SimpleNamespace(), SimpleNamespace()
    scope.mark_unified_draft_kv(spec)
    assert scope.wants_unified_draft_kv(spec) and not scope.wants_unified_draft_kv(twin)
    assert not scope.wants_unified_draft_kv(None)
    scope.clear_unified_marks()
    assert not scope.wants_unified_draft_kv(spec)


#: Names a loose comparison would take for M3 (case, spacing, prefix/suffix, substring, other
#: separators): random text alone practically never draws "minimax_m3" or anything near it.
NEAR_MISSES = ["minimax_m3", "MiniMax_M3", "MINIMAX_M3", "minimax_m3 ", " minimax_m3", "minimax-m3", "minimaxm3",
               "minimax_m3_vl", "minimax_m", "minimax", "m3", "xminimax_m3", "minimax_m3\n", "minimax_m4"]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(algorithm=st.one_of(st.none(), st.integers(), st.text(max_size=12), st.sampled_from(NEAR_MISSES),
                           st.builds(lambda name: name.encode(), st.sampled_from(NEAR_MISSES))),
       as_dict=st.booleans())
def test_only_the_exact_algorithm_name_is_m3(algorithm, as_dict):
    config = {"algorithm": algorithm} if as_dict else SimpleNamespace(algorithm=algorithm)
    assert scope.is_minimax_m3(config) == (algorithm == "minimax_m3")


def test_every_near_miss_but_the_exact_name_is_refused():
    assert [name for name in NEAR_MISSES if scope.is_minimax_m3(SimpleNamespace(algorithm=name))] == ["minimax_m3"]
