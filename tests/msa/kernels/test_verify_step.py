"""The sparse layer's step in one call (`verify_step`): the attention launched early, each
program waiting for its own token's ready flag, against independent things: the selection
against a float64 top-k oracle and equal to two plain launches' (the top-k after the whole
scoring grid), and the torch reference attention on that selection. The flags must be zero again after every step (the next step's
attention trusts any other value), including after graph replays, reshaped batches and a
rejected call.

Device-agnostic: on a CUDA GPU (where the attention really launches early and polls) the checks
run here; on CPU `tests._interpreter` runs them through Triton's interpreter (programs run in
order there, so it checks the flag protocol's indexing and counts, not the race).
"""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import (assert_close_rel, assert_valid_selection, capture_after_warmup, exact_block_scores,
                                  poison_allocator_like, random_step, seeded_draws, seeded_requests)

GEO = Geometry(q_heads=16, kv_heads=2, head_dim=32, index_heads=2, index_dim=32, block=16, topk=4)
SCALE = GEO.head_dim ** -0.5


def _flags_zero(device, n):
    from m3_eagle_plugin.msa.kernels.handoff import ready_flags

    flags = ready_flags(device, n).cpu()
    assert (flags == 0).all(), f"ready flags left set: {flags.nonzero().flatten()[:8].tolist()}"


def _step(meta, cache, q, index_q, max_qo_len=4, **kw):
    from m3_eagle_plugin.msa.kernels.verify_step import sparse_verify_step

    return sparse_verify_step(index_q, cache.index_k, q, cache.k, cache.v, meta, topk=GEO.topk, scale=SCALE,
                              k_scale=cache.k_scale, v_scale=cache.v_scale, max_qo_len=max_qo_len, **kw)


def check_early_step_matches_plain_launches(device, *, qo_lens=(4, 1, 3), kv_lens=(150, 16, 97), splits=2,
                                            pad_tokens=2, local=1, init=0, seed=0, kv_dtype="float16"):
    """The early step's selection equals a plain launch's and its attention the reference. fp8
    K/V takes two-page tiles wherever a program gets two pages (`early_tiling`), fp16 one-page."""
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    # fp16 index-K and q, not the production bf16: Triton's interpreter has no bf16 dot.
    meta, cache, q, index_q = random_step(GEO, list(qo_lens), list(kv_lens), kv_dtype=getattr(torch, kv_dtype),
                                          index_dtype=torch.float16, q_dtype=torch.float16, seed=seed,
                                          pad_tokens=pad_tokens, device=device)
    want = select_blocks_verify(index_q, cache.index_k, meta, topk=GEO.topk, local_blocks=local, init_blocks=init,
                                max_qo_len=max(qo_lens), handoff=False)
    expect = ref.sparse_attention(q, cache.k, cache.v, meta, want, scale=SCALE, k_scale=cache.k_scale,
                                  v_scale=cache.v_scale)
    poison_allocator_like(q)
    sel, out = _step(meta, cache, q, index_q, max(qo_lens), early=True, splits=splits, local_blocks=local,
                     init_blocks=init)
    live = sum(qo_lens)
    assert_valid_selection(sel[:, :live], exact_block_scores(index_q, cache.index_k, meta), GEO.topk,
                           local_blocks=local, init_blocks=init)
    assert torch.equal(sel.cpu(), want.cpu())
    assert_close_rel(out[:live].float(), expect[:live].float(), 3e-3 if cache.k.element_size() > 1 else 2e-2)
    assert (out[live:] == 0).all(), "graph-padding rows must be zero"
    _flags_zero(device, GEO.kv_heads * q.shape[0])


def check_flags_reused_across_batches(device):
    """Growing, shrinking and reshaped batches, with 1 to 4 readers a row, share one set of flags."""
    for (qo_lens, kv_lens), splits in zip((((2, 3), (40, 70)), ((1,) * 6, (16, 17, 31, 48, 1, 90)),
                                           ((4, 4), (64, 33))), (1, 3, 4)):
        check_early_step_matches_plain_launches(device, qo_lens=qo_lens, kv_lens=kv_lens, splits=splits, pad_tokens=0)


def check_random_steps(device, *, seed, requests=(1, 6), max_kv=300):
    """Seeded random steps: request count, verify lengths 1-4, contexts, splits, forced blocks and
    fp16 or fp8 K/V drawn from `seed`; each checked as above."""
    draw = seeded_draws(seed)
    qo_lens, kv_lens = seeded_requests(draw, min_requests=requests[0], max_requests=requests[1], max_qo=4,
                                       max_extra=max_kv)
    local = draw(0, 2)
    check_early_step_matches_plain_launches(device, qo_lens=qo_lens, kv_lens=kv_lens, splits=draw(1, 4),
                                            pad_tokens=draw(0, 2), local=local, init=draw(0, GEO.topk - local),
                                            seed=seed, kv_dtype=("float16", "float8_e4m3fn")[draw(0, 1)])


#: The interpreter's share (small launches: CI has two cores).
INTERPRETER_CASES = [
    (check_early_step_matches_plain_launches, dict()),
    (check_early_step_matches_plain_launches, dict(splits=3, local=2, init=1, seed=1)),
    (check_flags_reused_across_batches, dict()),
    (check_early_step_matches_plain_launches, dict(splits=2, seed=2, kv_dtype="float8_e4m3fn")),
    (check_early_step_matches_plain_launches, dict(splits=1, qo_lens=(4, 4), kv_lens=(90, 31), seed=3,
                                                   kv_dtype="float8_e4m3fn")),
    (check_random_steps, dict(seed=11, requests=(2, 3), max_kv=120)),
]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES + [
    # M3-like: 32 requests of 4 verify tokens at 2-6K context, 4 readers a row.
    (check_early_step_matches_plain_launches, dict(qo_lens=(4,) * 32, kv_lens=tuple(2000 + 131 * i for i in range(32)),
                                                   splits=4, pad_tokens=5, seed=3)),
    # B64 q4 with fp8 K/V: 256 rows, past one a SM, one reader a row (the rule's largest early step).
    (check_early_step_matches_plain_launches, dict(qo_lens=(4,) * 64, kv_lens=tuple(1500 + 97 * i for i in range(64)),
                                                   splits=1, pad_tokens=3, seed=4, kv_dtype="float8_e4m3fn")),
] + [(check_random_steps, dict(seed=100 + i, requests=(1, 40), max_kv=3000)) for i in range(12)])
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_cuda
def test_graph_replay_matches_eager_and_leaves_flags_zero():
    meta, cache, q, index_q = random_step(GEO, [4, 2, 4, 1], [300, 45, 1000, 16], pad_tokens=2)
    eager_sel, eager = _step(meta, cache, q, index_q, early=True, splits=2)
    graph, (sel, out) = capture_after_warmup(lambda: _step(meta, cache, q, index_q, early=True, splits=2))
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(sel, eager_sel) and torch.equal(out, eager)
        _flags_zero("cuda", GEO.kv_heads * q.shape[0])


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_verify_step")


def test_early_splits_rule():
    """About two programs per SM, at most one page each; launched early from EARLY_MIN_UNITS rows:
    with 1-byte K/V up to two rows per SM, with two-page key tiles where a program gets two pages
    or more; with wider K/V only up to two pages a program, one-page tiles."""
    from m3_eagle_plugin.msa.kernels.verify_step import (EARLY_MIN_UNITS, early_order, early_rule, early_splits,
                                                         early_tiling)

    assert early_rule(EARLY_MIN_UNITS - 1, 1, "cpu") is None
    for units in (1, 15, EARLY_MIN_UNITS, 33, 34, 64, 100, 132, 264, 1000, 4096):
        for topk in (1, 4, 16):
            s = early_splits(units, topk, "cpu")
            assert 1 <= s <= topk
            assert s == 1 or units * s <= 2 * 132  # the default SM count without a GPU
            assert s == topk or units * (s + 1) > 2 * 132
            assert early_rule(units, topk, "cpu") == (s if EARLY_MIN_UNITS <= units <= 2 * 132 else None)
            assert early_rule(units, topk, "cpu", kv_bytes=2) == (s if units >= EARLY_MIN_UNITS and 2 * s >= topk
                                                                  else None)
            pages = -(-topk // s)
            assert early_tiling(s, topk) == ({"pages_per_tile": 2, "num_stages": 2} if pages >= 2 else {})
            assert early_tiling(s, topk, kv_bytes=2) == {}
    # The production shapes (top-16, one KV head, 132 SMs): B4 q4 and B16 q1 (16 rows) through B64
    # q4 (256 rows) early, B1 and B128 q4 (512 rows) not; B16 q1 one page a program, B16 q4 four,
    # B64 q4 all sixteen.
    assert ([early_rule(u, 16, "cpu") for u in (4, 16, 32, 64, 128, 133, 256, 264, 265, 512)]
            == [None, 16, 8, 4, 2, 1, 1, 1, None, None])
    assert early_tiling(16, 16) == {} and early_tiling(4, 16)["pages_per_tile"] == 2
    # 1-byte pages of 128 x 256 make a 128 KB two-page tile: past what fits, so one-page tiles
    assert early_tiling(4, 16, 1, block=128, dim=256) == {} and early_tiling(4, 16, 1, block=64, dim=256) != {}
    # Request-major programs for fp8 K/V only (bf16 lost every measured round).
    assert early_order(1) and not early_order(2)
    # bf16 K/V: B16 q1 and B8 q4 early (one-page tiles), B16 q4 not.
    assert [early_rule(u, 16, "cpu", kv_bytes=2) for u in (4, 16, 32, 64)] == [None, 16, 8, None]


def test_rejected_inputs_launch_nothing():
    """A q whose head dim differs from the cache's is refused before the selection is launched,
    so no flag is armed (a later attention would read a stale one)."""
    from m3_eagle_plugin.msa.kernels import KernelInputError

    meta, cache, q, index_q = random_step(GEO, [2, 3], [40, 70], kv_dtype=torch.float16, index_dtype=torch.float16,
                                          q_dtype=torch.float16, device="cpu")
    with pytest.raises(KernelInputError, match="head dim"):
        _step(meta, cache, q[..., :16].contiguous(), index_q, early=True, splits=2)
    with pytest.raises(KernelInputError, match="index_q has 4 tokens, q has 5"):
        _step(meta, cache, q, index_q[:4], early=True, splits=2)
    for splits in (0, -1, 2.0, True):  # an early attention of no split: named, not the measured rule instead
        with pytest.raises(KernelInputError, match="splits must be None or an int >= 1"):
            _step(meta, cache, q, index_q, early=True, splits=splits)
    _flags_zero("cpu", GEO.kv_heads * q.shape[0])


def test_a_numpy_split_count_is_taken_as_its_int(monkeypatch):
    """The package takes any integer as a count (`_ints`): an np.int64 split count reaches the early
    attention as that int (it was refused as "not an int >= 1", while the attention itself takes it)."""
    import numpy as np

    from m3_eagle_plugin.msa.kernels import verify_step

    meta, cache, q, index_q = random_step(GEO, [2, 3], [40, 70], kv_dtype=torch.float16, index_dtype=torch.float16,
                                          q_dtype=torch.float16, device="cpu")
    seen = []

    def announcing(*args, consumers, **kw):
        seen.append(consumers)
        raise LookupError("stop before any launch")

    monkeypatch.setattr(verify_step, "select_announcing", announcing)
    with pytest.raises(LookupError, match="stop before any launch"):
        _step(meta, cache, q, index_q, early=True, splits=np.int64(2))
    assert seen == [2] and type(seen[0]) is int


@needs_cuda
def test_layer_dispatcher_matches_the_reference():
    """`kernels.sparse_layer_attention` (what the model calls) runs `verify_step` on a GPU, early
    by the rule where it applies (32 requests x 4 tokens). (On CPU it calls the two torch
    references as before; the model tests cover that path.)"""
    device = "cuda"
    from m3_eagle_plugin.msa import kernels

    geo = Geometry(q_heads=16, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=4)
    qo_lens, kv_lens = [4] * 32, [200 + 37 * i for i in range(32)]
    meta, cache, q, index_q = random_step(geo, qo_lens, kv_lens, kv_dtype=torch.float16, index_dtype=torch.float16,
                                          q_dtype=torch.float16, device=device)
    sel = ref.select_blocks(index_q, cache.index_k, meta, topk=geo.topk)
    expect = ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=SCALE)
    out = kernels.sparse_layer_attention(q, cache.k, cache.v, index_q, cache.index_k, meta, topk=geo.topk,
                                         scale=SCALE)
    assert_close_rel(out.float(), expect.float(), 3e-3)
    _flags_zero(device, q.shape[0])


class _Cut(KeyboardInterrupt):
    """An interrupt raised as a launch returns."""


def _dead_device(*args, **kwargs):
    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


def test_a_reset_that_fails_too_leaves_the_steps_own_error_to_surface(monkeypatch):
    """After a sticky CUDA error, or a sync that invalidated a graph capture, every later launch fails,
    the hand-off's reset included: the reset's RuntimeError replaced the step's own error (a Ctrl-C
    became a traceback, the capture's real cause a "previous error during capture")."""
    from m3_eagle_plugin.msa.kernels import verify_step

    meta, cache, q, index_q = random_step(GEO, [2, 3], [40, 70], kv_dtype=torch.float16, index_dtype=torch.float16,
                                          q_dtype=torch.float16, device="cpu")
    monkeypatch.setattr(verify_step, "reset_handoff", _dead_device)
    monkeypatch.setattr(verify_step, "_step", lambda *a, **k: (_ for _ in ()).throw(_Cut("as a launch returned")))
    with pytest.raises(_Cut, match="as a launch returned"):
        _step(meta, cache, q, index_q, early=True, splits=2)

    class Flags:  # the top-k's ready flags on a device that refuses every launch now
        zero_ = staticmethod(_dead_device)

    monkeypatch.undo()
    monkeypatch.setattr(verify_step, "reset_handoff", _dead_device)
    monkeypatch.setattr(verify_step, "select_announcing", lambda *a, **k: (None, None, Flags()))
    monkeypatch.setattr(verify_step, "sparse_verify_attention", lambda *a, **k: (_ for _ in ()).throw(
        MemoryError("the attention's partials")))
    with pytest.raises(MemoryError, match="the attention's partials"):
        _step(meta, cache, q, index_q, early=True, splits=2)
