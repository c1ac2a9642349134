"""Triton index scoring + per-token top-k vs an exact float64 oracle and the naive torch reference.

The `check_*` functions are device-agnostic: on CUDA they run here (`test_on_gpu`); on CPU
`tests._interpreter` runs `INTERPRETER_CASES` through Triton's interpreter, so CI executes the
scoring and top-k programs end to end (`select_blocks_verify`). The interpreter's `tl.dot` is
wrong for bf16 operands (Triton 3.6), so those cases use fp32 index queries and keys.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from .kernel_case_helpers import (
    M3,
    SMALL,
    assert_valid_selection,
    exact_block_scores,
    msa_metadata,
    needs_gpu,
    one_request_step,
    random_step,
    seeded_draws,
    seeded_requests,
)
from m3_eagle_plugin.bench import torch_reference as ref
from tests._interpreter import check_module_cases, needs_interpreter


def _select(index_q, cache, meta, **kw):
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    return select_blocks_verify(index_q, cache.index_k, meta, **kw)


def check_matches_reference(device, *, qo_lens=(4, 4, 1, 3), kv_lens=(100, 37, 16, 70), topk=3, local_blocks=1,
                            init_blocks=0, pad_tokens=0, max_qo_len=None, seed=0):
    """The selection equals `torch_reference.select_blocks` (same forced local/init blocks); graph
    padding rows are all -1. Most requests have more blocks than `topk`, so the scores decide."""
    meta, cache, _, index_q = random_step(SMALL, list(qo_lens), list(kv_lens), index_dtype=torch.float32,
                                          seed=seed, pad_tokens=pad_tokens, device=device)
    kw = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    sel = _select(index_q, cache, meta, max_qo_len=max_qo_len, **kw)
    live = sum(qo_lens)
    expect = ref.select_blocks(index_q, cache.index_k, meta, **kw)
    assert sel.shape == (SMALL.index_heads, live + pad_tokens, topk) and sel.dtype == torch.int32
    assert torch.equal(sel[:, :live].cpu(), expect[:, :live].cpu())
    assert (sel[:, live:].cpu() == -1).all(), "graph-padding rows are not -1"


def check_seeded_random_step(device, *, seed):
    """`check_matches_reference` on a seeded random step: requests, lengths, top-k, forced local and
    init blocks, graph padding and the q_len hint drawn from `seed` (the property test's, for CI)."""
    draw = seeded_draws(seed)
    qo_lens, kv_lens = seeded_requests(draw, max_requests=4, max_qo=6, max_extra=150)
    topk = draw(1, 6)
    local = draw(0, min(2, topk))
    check_matches_reference(device, qo_lens=qo_lens, kv_lens=kv_lens, topk=topk, local_blocks=local,
                            init_blocks=draw(0, topk - local), pad_tokens=draw(0, 2),
                            max_qo_len=(None, max(qo_lens))[draw(0, 1)], seed=seed)


#: The interpreter's share (CI has two cores): verify and decode rows, a top-k wider than some
#: requests' visible blocks, forced local and init blocks with graph padding under a q_len hint.
INTERPRETER_CASES = [
    (check_matches_reference, dict()),
    (check_matches_reference, dict(qo_lens=(2, 4, 1), kv_lens=(90, 20, 61), topk=4, local_blocks=1, init_blocks=1,
                                   pad_tokens=2, max_qo_len=4, seed=1)),
    (check_seeded_random_step, dict(seed=21)),
]


@needs_gpu
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES)
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_index_select")


@needs_gpu
def test_matches_reference_small_geometry():
    meta, cache, _, index_q = random_step(SMALL, [4, 4, 1, 3], [200, 37, 16, 130], index_dtype=torch.float32)
    sel = _select(index_q, cache, meta, topk=SMALL.topk)
    expect = ref.select_blocks(index_q, cache.index_k, meta, topk=SMALL.topk)
    assert sel.shape == (SMALL.index_heads, 12, SMALL.topk) and sel.dtype == torch.int32
    assert torch.equal(sel.cpu(), expect.cpu())


@needs_gpu
def test_m3_geometry_bf16_with_graph_padding():
    meta, cache, _, index_q = random_step(M3, [4, 4, 4], [4000, 2100, 129], pad_tokens=3)
    sel = _select(index_q, cache, meta, topk=M3.topk, max_qo_len=4)
    live = int(meta.cu_qo_lens[-1])
    assert (sel[:, live:].cpu() == -1).all()
    scores = exact_block_scores(index_q, cache.index_k, meta)
    assert_valid_selection(sel[:, :live], scores, M3.topk)


@needs_gpu
def test_fp8_index_k_and_init_blocks():
    meta, cache, _, index_q = random_step(SMALL, [3, 2], [300, 90], index_dtype=torch.float8_e4m3fn,
                                          q_dtype=torch.bfloat16)
    index_q = index_q.to(torch.bfloat16)
    sel = _select(index_q, cache, meta, topk=SMALL.topk, local_blocks=2, init_blocks=1)
    scores = exact_block_scores(index_q, cache.index_k, meta)
    assert_valid_selection(sel, scores, SMALL.topk, local_blocks=2, init_blocks=1)


@needs_gpu
@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 400)), min_size=1, max_size=5),
    topk=st.integers(1, 8),
    local=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_property_any_step_is_a_valid_topk(reqs, topk, local, seed):
    qo_lens = [q for q, _ in reqs]
    kv_lens = [q + extra for q, extra in reqs]
    meta, cache, _, index_q = random_step(SMALL, qo_lens, kv_lens, index_dtype=torch.float32, seed=seed)
    sel = _select(index_q, cache, meta, topk=topk, local_blocks=local)
    assert_valid_selection(sel, exact_block_scores(index_q, cache.index_k, meta), topk, local_blocks=local,
                           tol=1e-4)


@needs_gpu
def test_matches_package_reference_on_msa_metadata():
    from m3_eagle_plugin.msa import select_blocks_paged

    step, cache, _, index_q = random_step(M3, [4, 4, 4, 1], [2000, 5000, 300, 129], index_dtype=torch.float32)
    meta = msa_metadata(step)
    sel = _select(index_q, cache, meta, topk=M3.topk, max_qo_len=4)
    expect = select_blocks_paged(index_q, cache.index_k, meta, topk=M3.topk)
    assert torch.equal(sel.cpu(), expect.cpu())


@needs_gpu
@pytest.mark.parametrize("index_dtype", [torch.float32, torch.bfloat16])
def test_a_nan_index_key_selects_its_block_as_the_package_reference_does(index_dtype):
    """A NaN key makes its block's score NaN (torch's amax; Triton's max dropped it) and a NaN
    score ranks first, as in transformers' MiniMax-M3 and `select_blocks_paged`."""
    from m3_eagle_plugin.msa import select_blocks_paged

    step, cache, _, index_q = random_step(M3, [4, 1, 3], [2000, 700, 1500], index_dtype=index_dtype, seed=3)
    cache.index_k[int(step.block_tables[0, 5]), 3] = float("nan")
    cache.index_k[int(step.block_tables[2, 9]), 127] = float("nan")
    meta = msa_metadata(step)
    sel = _select(index_q, cache, meta, topk=M3.topk, max_qo_len=4).cpu()
    assert (sel[:, :4] == 5).any(-1).all() and (sel[:, 5:] == 9).any(-1).all()
    if index_dtype == torch.float32:
        assert torch.equal(sel, select_blocks_paged(index_q, cache.index_k, meta, topk=M3.topk).cpu())


@needs_gpu
def test_topk_program_breaks_ties_like_the_sort_oracle():
    from .interpret_topk import CASES

    for case in CASES:
        case("cuda")


@needs_gpu
@pytest.mark.parametrize("blocks_per_program", [None, 1, 2, 3, 5])
def test_block_scores_match_exact_maxima_for_any_pages_per_program(blocks_per_program):
    """Programs own runs of 1-5 pages; requests of uneven length end inside a run."""
    from m3_eagle_plugin.msa.kernels.index_select import index_block_scores

    meta, cache, _, index_q = random_step(M3, [4, 1, 3], [1500, 640, 1000], index_dtype=torch.float32)
    scores = index_block_scores(index_q, cache.index_k, meta, max_qo_len=4, blocks_per_program=blocks_per_program)
    exact = exact_block_scores(index_q, cache.index_k, meta)
    for t, want in enumerate(exact):
        got = scores[:, t, : want.shape[1]].double().cpu()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"token {t}"


def test_a_top_k_grid_past_cudas_z_limit_is_refused_before_launch(monkeypatch):
    """The top-k grid's z is a request's token chunks (4 tokens each at most): a 262,144-token
    request needs 65,536 of them, past CUDA's 65535; refused as too large before any launch."""
    from m3_eagle_plugin.msa.kernels import KernelTooLargeError, index_select

    monkeypatch.setattr(index_select, "launch", lambda *a, **k: pytest.fail("launched"))
    tokens = 4 * 65536
    _, _, meta, _ = one_request_step(tokens)
    meta.valid_blocks = torch.ones(tokens, dtype=torch.int32)
    meta.block_tables = meta.block_tables[:, :1].contiguous()  # one block a token: one score column
    scores = torch.zeros(1, tokens, 1)
    with pytest.raises(KernelTooLargeError, match=r"block top-k: its grid \(1, 1, 65536\) \(requests, index heads, "
                                                  r"65536 chunks of 4 tokens\)"):
        index_select.topk_from_block_scores(scores, meta, topk=1)


def test_a_scoring_grid_past_cudas_y_limit_is_too_large_not_a_bad_input(monkeypatch):
    """The scoring grid's y is the step's requests: 65,536 of them are past CUDA's 65535, refused as
    too large (the error `auto` answers with the torch reference, as for every other grid) before
    any launch, not as a malformed input (a bare KernelInputError failed the step under `auto`)."""
    import types

    from m3_eagle_plugin.msa.kernels import KernelTooLargeError, index_select

    monkeypatch.setattr(index_select, "launch", lambda *a, **k: pytest.fail("launched"))
    requests = 65536
    meta = types.SimpleNamespace(
        block_tables=torch.zeros(requests, 1, dtype=torch.int32), kv_lens=torch.ones(requests, dtype=torch.int32),
        cu_qo_lens=torch.arange(requests + 1, dtype=torch.int32), positions=torch.zeros(requests, dtype=torch.int32),
        block_size=16, max_qo_len=1)
    with pytest.raises(KernelTooLargeError, match=r"block scoring: its grid \(1, 65536\) \(block groups, requests\)"):
        index_select.index_block_scores(torch.zeros(requests, 1, 16), torch.zeros(1, 16, 16), meta)
    meta.block_tables, meta.kv_lens = meta.block_tables[:65535], meta.kv_lens[:65535]  # at the limit: launched
    meta.cu_qo_lens, meta.positions = meta.cu_qo_lens[:65536], meta.positions[:65535]
    with pytest.raises(pytest.fail.Exception, match="launched"):
        index_select.index_block_scores(torch.zeros(65535, 1, 16), torch.zeros(1, 16, 16), meta)


def test_a_reset_that_fails_too_leaves_the_scorings_own_error_to_surface(monkeypatch):
    """A scoring that failed on a dead device (a sticky CUDA error, an invalidated graph capture) is
    followed by a reset that fails the same way: its error replaced the scoring's, which names the cause."""
    from m3_eagle_plugin.msa.kernels import index_select

    def dead(*args, **kwargs):
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def scoring(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    meta, cache, _, index_q = random_step(SMALL, [2, 1], [40, 17], device="cpu")
    monkeypatch.setattr(index_select, "reset_handoff", dead)
    monkeypatch.setattr(index_select, "index_block_scores", scoring)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        index_select.select_announcing(index_q, cache.index_k, meta, topk=SMALL.topk, handoff=True)
