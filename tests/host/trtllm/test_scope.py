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


@settings(max_examples=25, deadline=None, derandomize=True)
@given(algorithm=st.one_of(st.none(), st.integers(), st.text(max_size=12)))
def test_only_the_exact_algorithm_name_is_m3(algorithm):
    assert scope.is_minimax_m3(SimpleNamespace(algorithm=algorithm)) == (algorithm == "minimax_m3")
