"""The Triton kernels checked on CPU through Triton's interpreter, so CI (which has no GPU) runs
the kernels' own code against the torch references on the hostile cases (stale tail slots,
unmapped pages, selections of invisible blocks) and not only the reference path."""
from __future__ import annotations

from tests._interpreter import interpreter_case_lines, needs_interpreter


@needs_interpreter
def test_triton_kernels_pass_the_hostile_cases_in_the_interpreter():
    lines = interpreter_case_lines("tests.msa.kernels.interpret_hostile")
    assert len(lines) >= 6, lines  # three cases x both sparse layouts


@needs_interpreter
def test_topk_program_breaks_ties_like_the_sort_oracle_in_the_interpreter():
    from tests.msa.kernels.interpret_topk import CASES

    lines = interpreter_case_lines("tests.msa.kernels.interpret_topk")
    assert len(lines) == len(CASES), lines


@needs_interpreter
def test_fused_kv_lens_update_does_not_wrap_near_int32_max_in_the_interpreter():
    assert interpreter_case_lines("tests.msa.kernels.interpret_kv_lens") == ["PASS kv lengths near 2^31"]
