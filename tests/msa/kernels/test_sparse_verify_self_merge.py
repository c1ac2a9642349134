"""The per-token sparse attention merging its own splits (`self_merge`: a token's last split to
finish, found through an arrival counter it resets, folds the others by their LSE) vs the same
kernel followed by the merge launch and vs the torch reference.

Device-agnostic: on CUDA the checks run here (programs really race for the counter); on CPU
`tests._interpreter` runs them through Triton's interpreter, so CI executes the merge's
indexing, the graph-padding rows and the counter reset.
"""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import (assert_close_rel, capture_after_warmup, check_zeroed_shared_growing,
                                  poison_allocator_like, random_step)

GEO = Geometry(q_heads=16, kv_heads=2, head_dim=32, index_heads=1, index_dim=32, block=16, topk=4)


def _selection(meta, seed):
    """Each token: its local block plus random earlier ones, ascending, -1 padded."""
    gen = torch.Generator().manual_seed(seed)
    sel = torch.full((GEO.kv_heads, len(meta.positions), GEO.topk), -1, dtype=torch.int32)
    for t, pos in enumerate(meta.positions.tolist()):
        local = pos // GEO.block
        for h in range(GEO.kv_heads):
            ids = sorted(set(torch.randperm(local, generator=gen)[: GEO.topk - 1].tolist() + [local]))
            sel[h, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return sel


def _counters_zero(device, slots):
    from m3_eagle_plugin.msa.kernels.merge import split_arrivals

    assert (split_arrivals(device, slots).cpu() == 0).all(), "arrival counters left non-zero"


def check_self_merge_matches_merge_launch(device, *, splits=2, qo_lens=(4, 1, 3), kv_lens=(70, 9, 40), pad_tokens=2,
                                          seed=0):
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    meta, cache, q, _ = random_step(GEO, list(qo_lens), list(kv_lens), kv_dtype=torch.float16, q_dtype=torch.float16,
                                    seed=seed, pad_tokens=pad_tokens, device=device)
    sel = _selection(meta, seed).to(device)
    kw = dict(scale=GEO.head_dim ** -0.5, max_qo_len=max(qo_lens), layout="token", splits=splits)
    poison_allocator_like(q)
    merged = sparse_verify_attention(q, cache.k, cache.v, meta, sel, self_merge=True, **kw)
    _counters_zero(device, q.shape[0] * GEO.kv_heads)
    launched = sparse_verify_attention(q, cache.k, cache.v, meta, sel, self_merge=False, **kw)
    live = sum(qo_lens)
    assert (merged[live:] == 0).all(), "graph-padding rows must be zero"
    assert_close_rel(merged[:live], launched[:live], 1e-3)
    assert_close_rel(merged[:live], ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=kw["scale"])[:live],
                     2e-2)


#: The interpreter's share (small launches: CI has two cores).
INTERPRETER_CASES = [
    (check_self_merge_matches_merge_launch, dict()),
    (check_self_merge_matches_merge_launch, dict(splits=3, qo_lens=(2, 4), kv_lens=(100, 33), seed=1)),
]


def test_counters_are_zeroed_shared_and_grow():
    from m3_eagle_plugin.msa.kernels.merge import split_arrivals

    check_zeroed_shared_growing(split_arrivals)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES + [
    (check_self_merge_matches_merge_launch, dict(splits=2, qo_lens=(4,) * 24, kv_lens=tuple(300 + 37 * i for i in range(24)),
                                                 seed=2)),
])
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_cuda
def test_graph_replay_merges_the_same_and_resets_counters():
    """Captured once, replayed three times with the output poisoned in between: the same output as
    eager, counters zero after each replay."""
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    meta, cache, q, _ = random_step(GEO, [4, 1, 3, 4], [90, 30, 129, 200], pad_tokens=3)
    sel = _selection(meta, 4).cuda()
    kw = dict(scale=GEO.head_dim ** -0.5, max_qo_len=4, layout="token", splits=2, self_merge=True)
    eager = sparse_verify_attention(q, cache.k, cache.v, meta, sel, **kw)
    graph, replayed = capture_after_warmup(lambda: sparse_verify_attention(q, cache.k, cache.v, meta, sel, **kw))
    for _ in range(3):
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
        _counters_zero("cuda", q.shape[0] * GEO.kv_heads)


@needs_cuda
def test_capture_without_counters_takes_the_merge_launch():
    """Counters cannot be allocated inside a capture: that launch merges with `merge_splits`."""
    from m3_eagle_plugin.msa.kernels import merge

    graph = torch.cuda.CUDAGraph()
    have = merge.split_arrivals("cuda", 1).untyped_storage().nbytes() // 4
    with torch.cuda.graph(graph):
        assert merge.split_arrivals("cuda", have + 1) is None


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_sparse_verify_self_merge")
