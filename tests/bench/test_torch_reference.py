"""The bench's naive torch references vs brute-force per-token loops and the package references."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry, make_step
from m3_eagle_plugin.msa import MsaDecodeMetadata, dense_attention, select_blocks_paged, sparse_attention

GEO = Geometry(q_heads=4, kv_heads=2, head_dim=8, index_heads=2, index_dim=8, block=4, topk=3)


def _step(batch, context, qo, seed):
    return make_step(batch, context, qo, GEO, kv_dtype=torch.float32, index_dtype=torch.float32,
                     q_dtype=torch.float32, device="cpu", seed=seed)


def _brute_attention(q, k, v, meta, selection, scale):
    """One (token, head) at a time, keys listed one by one."""
    out = torch.zeros_like(q, dtype=torch.float64)
    cu = meta.cu_qo_lens.tolist()
    group = q.shape[1] // k.shape[1]
    for r in range(len(cu) - 1):
        for t in range(cu[r], cu[r + 1]):
            p = int(meta.positions[t])
            for h in range(q.shape[1]):
                g = h // group
                keys = [j for j in range(p + 1)
                        if selection is None or j // GEO.block in selection[g, t].tolist()]
                pages = [int(meta.block_tables[r, j // GEO.block]) for j in keys]
                kk = torch.stack([k[pg, g, j % GEO.block].double() for pg, j in zip(pages, keys)])
                vv = torch.stack([v[pg, g, j % GEO.block].double() for pg, j in zip(pages, keys)])
                w = torch.softmax(kk @ q[t, h].double() * scale, 0)
                out[t, h] = w @ vv
    return out


def test_attention_references_match_brute_force():
    step = _step(2, 23, 3, 1)
    meta, cache, q = step["meta"], step["cache"], step["q"]
    sel = ref.select_blocks(step["index_q"], cache.index_k, meta, topk=GEO.topk)
    torch.testing.assert_close(ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.3).double(),
                               _brute_attention(q, cache.k, cache.v, meta, sel, 0.3), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref.dense_attention(q, cache.k, cache.v, meta, scale=0.3).double(),
                               _brute_attention(q, cache.k, cache.v, meta, None, 0.3), rtol=1e-5, atol=1e-6)


def test_a_nan_index_key_selects_its_block_as_the_package_reference_does():
    """A NaN key makes its block's score NaN (amax), and a NaN score ranks first (topk), as in
    transformers' MiniMax-M3 and `select_blocks_paged`; it was dropped as if invisible."""
    step = _step(2, 40, 3, 7)
    sm, cache = step["meta"], step["cache"]
    meta = MsaDecodeMetadata(2, 6, sm.block_tables.shape[1], GEO.block, "cpu", max_draft_len=3)
    meta.prepare(sm.qo_lens.tolist(), sm.kv_lens.tolist(), sm.block_tables)
    cache.index_k[int(sm.block_tables[0, 2]), 1] = float("nan")  # request 0, block 2: seen by all its tokens
    sel = ref.select_blocks(step["index_q"], cache.index_k, sm, topk=GEO.topk)
    assert (sel[:, :3] == 2).any(-1).all()
    assert torch.equal(sel, select_blocks_paged(step["index_q"], cache.index_k, meta, topk=GEO.topk))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(batch=st.integers(1, 3), context=st.integers(4, 40), qo=st.integers(1, 4), seed=st.integers(0, 999))
def test_property_agrees_with_package_references(batch, context, qo, seed):
    step = _step(batch, context, qo, seed)
    sm, cache, q = step["meta"], step["cache"], step["q"]
    meta = MsaDecodeMetadata(batch, batch * qo, sm.block_tables.shape[1], GEO.block, "cpu", max_draft_len=qo)
    meta.prepare(sm.qo_lens.tolist(), sm.kv_lens.tolist(), sm.block_tables)
    sel = ref.select_blocks(step["index_q"], cache.index_k, sm, topk=GEO.topk)
    assert torch.equal(sel, select_blocks_paged(step["index_q"], cache.index_k, meta, topk=GEO.topk))
    scale = 1 / math.sqrt(GEO.head_dim)
    torch.testing.assert_close(ref.sparse_attention(q, cache.k, cache.v, sm, sel, scale=scale),
                               sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.dense_attention(q, cache.k, cache.v, sm, scale=scale),
                               dense_attention(q, cache.k, cache.v, meta, scale=scale), rtol=1e-5, atol=1e-5)


def test_a_token_that_sees_no_key_gets_zeros_as_the_package_reference_gives():
    """An all -1 selection row is valid ("none"): `msa.sparse_attention` and the kernels give zeros
    there; the bench reference gave NaN, so every kernel row's error read NaN."""
    step = _step(1, 23, 3, 2)
    sm, cache, q = step["meta"], step["cache"], step["q"]
    meta = MsaDecodeMetadata(1, 3, sm.block_tables.shape[1], GEO.block, "cpu", max_draft_len=3)
    meta.prepare(sm.qo_lens.tolist(), sm.kv_lens.tolist(), sm.block_tables)
    sel = ref.select_blocks(step["index_q"], cache.index_k, sm, topk=GEO.topk)
    sel[:, 1] = -1  # token 1 attends nothing
    out = ref.sparse_attention(q, cache.k, cache.v, sm, sel, scale=0.3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.3))


def test_a_nan_key_makes_the_tokens_that_see_it_nan_as_a_plain_softmax_does():
    """A NaN K entry in a key a token attends makes its softmax NaN (the per-key loop's fp64
    softmax: NaN), so the reference output is NaN there (a kernel row's error then reads inf), not
    zeros; tokens and heads that do not attend that key stay finite."""
    step = _step(1, 23, 3, 2)
    sm, cache, q = step["meta"], step["cache"], step["q"]
    sel = ref.select_blocks(step["index_q"], cache.index_k, sm, topk=GEO.topk)
    page = int(sm.block_tables[0, 22 // GEO.block])
    cache.k[page, 0, 22 % GEO.block, 0] = float("nan")  # KV head 0, position 22: only the last token sees it
    for selection in (sel, None):
        out = (ref.sparse_attention(q, cache.k, cache.v, sm, sel, scale=0.3) if selection is not None
               else ref.dense_attention(q, cache.k, cache.v, sm, scale=0.3))
        expect = _brute_attention(q, cache.k, cache.v, sm, selection, 0.3)
        assert torch.equal(out.isnan(), expect.isnan())
        assert out[2, : GEO.q_heads // GEO.kv_heads].isnan().all() and torch.isfinite(out[:2]).all()
