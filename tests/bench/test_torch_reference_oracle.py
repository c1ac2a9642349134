"""The bench's torch references (the oracle of every kernel test) pinned independently of the package:
against transformers' MiniMax-M3 sparse layer (its indexer's selection, its attention output) on
paged verify steps, and against per-token loops written from the spec (selection with local and
init blocks, several index heads, graph padding rows; fp8 K/V with scales; GQA grouping).
Also the kernel rows' byte floor, counted token by token for M3-shaped steps."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry, make_cache, shuffled_block_tables, verify_queries
from m3_eagle_plugin.bench.kernel_suite import byte_floor
from m3_eagle_plugin.bench.step_meta import build_step_meta

hf = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")

Q_HEADS, KV_HEADS, HEAD_DIM, INDEX_DIM = 6, 2, 16, 16   # GQA groups of 3; index heads = KV heads


# ---------------------------------------------------------------- transformers oracle

def _hf_layers(block: int, topk: int, local: int, seed: int):
    """(sparse attention layer, dense attention layer, rotary) of a tiny random MiniMax-M3."""
    config = hf.MiniMaxM3VLTextConfig(
        vocab_size=64, hidden_size=48, intermediate_size=16, dense_intermediate_size=32,
        shared_intermediate_size=16, num_hidden_layers=2, num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        index_n_heads=KV_HEADS, index_head_dim=INDEX_DIM, index_block_size=block, index_topk_blocks=topk,
        index_local_blocks=local, layer_types=["full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse"], bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    sparse = hf.MiniMaxM3VLAttention(config, layer_idx=1).eval()
    dense = hf.MiniMaxM3VLAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for norm in (sparse.q_norm, sparse.k_norm, dense.q_norm, dense.k_norm, sparse.indexer.q_norm,
                     sparse.indexer.k_norm):
            norm.weight.normal_(0.0, 0.3)
        sparse.indexer.q_proj.weight.mul_(3.0)  # sharp index scores: top-k far from ties
    return sparse, dense, hf.MiniMaxM3VLRotaryEmbedding(config)


@torch.no_grad()
def _hf_run(attn, rotary, seq_len: int, seed: int) -> dict:
    """Token-major q/k/v (and index q/k, selection) as the HF layer computes them, and its output
    before o_proj, all from transformers' own modules."""
    hidden = torch.randn(1, seq_len, attn.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    position_ids = torch.arange(seq_len)[None]
    cos, sin = rotary(hidden, position_ids)
    shape = (1, seq_len, -1, HEAD_DIM)
    q = attn.q_norm(attn.q_proj(hidden).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
    v = attn.v_proj(hidden).view(shape).transpose(1, 2)
    q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    out = {"q": q[0].transpose(0, 1), "k": k[0].transpose(0, 1), "v": v[0].transpose(0, 1), "scale": attn.scaling}
    if attn.indexer is not None:
        ix = attn.indexer
        iq = ix.q_norm(ix.q_proj(hidden).view(1, seq_len, -1, INDEX_DIM)).transpose(1, 2)
        ik = ix.k_norm(ix.k_proj(hidden).view(1, seq_len, 1, INDEX_DIM)).transpose(1, 2)
        iq, ik = hf.apply_rotary_pos_emb(iq, ik, cos[..., :INDEX_DIM], sin[..., :INDEX_DIM])
        out.update(index_q=iq[0].transpose(0, 1), index_k=ik[0, 0],
                   selection=ix(hidden, (cos, sin), None, position_ids)[0])
    captured = {}
    hook = attn.o_proj.register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0]))
    try:
        mask = None if attn.indexer is not None else torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
        attn(hidden, (cos, sin), mask, cache=None, position_ids=position_ids)
    finally:
        hook.remove()
    out["attention"] = captured["x"][0].view(seq_len, Q_HEADS, HEAD_DIM)
    return out


def _paged_step(run: dict, qo_lens, kv_lens, block: int, seed: int, pad_tokens: int = 2):
    """Every request a prefix of the oracle's sequence: its K/V/index-K written into shuffled pages of
    the bench's pooled layout, its last `qo_len` tokens the verify rows (plus graph padding rows)."""
    gen = torch.Generator().manual_seed(seed)
    geo = Geometry(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, index_heads=KV_HEADS,
                   index_dim=INDEX_DIM, block=block, topk=1)
    num_pages = sum(-(-kv // block) for kv in kv_lens) + 2
    width = max(-(-kv // block) for kv in kv_lens) + 1
    tables = shuffled_block_tables(list(kv_lens), block, num_pages, gen, width=width)
    meta = build_step_meta(list(qo_lens), list(kv_lens), tables, block, device="cpu", pad_tokens=pad_tokens)
    cache = make_cache(num_pages, geo, kv_dtype=torch.float32, index_dtype=torch.float32, device="cpu", generator=gen)
    rows = []
    for r, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        for j in range(kv):
            page, off = int(tables[r, j // block]), j % block
            cache.k[page, :, off] = run["k"][j]
            cache.v[page, :, off] = run["v"][j]
            if "index_k" in run:
                cache.index_k[page, off] = run["index_k"][j]
        rows += range(kv - qo, kv)
    rows = torch.tensor(rows)
    q = torch.cat([run["q"][rows], torch.randn(pad_tokens, Q_HEADS, HEAD_DIM, generator=gen)])
    iq = torch.cat([run["index_q"][rows], torch.randn(pad_tokens, KV_HEADS, INDEX_DIM, generator=gen)]) \
        if "index_q" in run else None
    return meta, cache, q, iq, rows


def _sets(selection: torch.Tensor) -> list[list[frozenset]]:
    return [[frozenset(b for b in row if b >= 0) for row in head.tolist()] for head in selection]


# A long request, verify chunks straddling block boundaries, a prefill-like full chunk, one token.
REQUESTS = [((4, 37), (3, 21), (1, 9), (5, 5), (1, 1)), ((2, 30), (4, 16), (1, 40))]


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("qo_kv", REQUESTS)
def test_select_blocks_equals_transformers_indexer_on_a_paged_verify_step(local, qo_kv):
    block, topk = 4, 3
    sparse, _, rotary = _hf_layers(block, topk, local, seed=local)
    seq = max(kv for _, kv in qo_kv)
    run = _hf_run(sparse, rotary, seq, seed=7)
    qo_lens, kv_lens = [q for q, _ in qo_kv], [kv for _, kv in qo_kv]
    meta, cache, _, iq, rows = _paged_step(run, qo_lens, kv_lens, block, seed=3)
    sel = ref.select_blocks(iq, cache.index_k, meta, topk=topk, local_blocks=local)
    live = len(rows)
    assert sel.shape == (KV_HEADS, live + 2, topk) and sel.dtype == torch.int32
    assert (sel[:, live:] == -1).all()                     # graph padding rows select nothing
    assert _sets(sel[:, :live]) == _sets(run["selection"][:, rows])
    for row in sel[:, :live].reshape(-1, topk).tolist():   # ids ascending, then -1 padding
        ids = [b for b in row if b >= 0]
        assert ids == sorted(set(ids)) and row == ids + [-1] * (topk - len(ids))
    # sparsity is active: some rows select fewer blocks than they can see
    assert any(len(s) < int(meta.valid_blocks[t]) for head in _sets(sel[:, :live]) for t, s in enumerate(head))


@pytest.mark.parametrize("qo_kv", REQUESTS)
def test_sparse_and_dense_attention_equal_transformers_layers(qo_kv):
    block, topk = 4, 3
    sparse, dense, rotary = _hf_layers(block, topk, 1, seed=5)
    seq = max(kv for _, kv in qo_kv)
    qo_lens, kv_lens = [q for q, _ in qo_kv], [kv for _, kv in qo_kv]

    run = _hf_run(sparse, rotary, seq, seed=11)
    meta, cache, q, iq, rows = _paged_step(run, qo_lens, kv_lens, block, seed=4)
    live = len(rows)
    sel = ref.select_blocks(iq, cache.index_k, meta, topk=topk)
    got = ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=run["scale"])
    torch.testing.assert_close(got[:live], run["attention"][rows], rtol=1e-5, atol=1e-5)
    assert (got[live:] == 0).all()
    # and on HF's own selection (its order: local block first), the same output
    hf_sel = torch.cat([run["selection"][:, rows], torch.full((KV_HEADS, 2, topk), -1)], 1).to(torch.int32)
    torch.testing.assert_close(ref.sparse_attention(q, cache.k, cache.v, meta, hf_sel, scale=run["scale"]), got)
    # the dense reference differs where sparsity drops blocks
    assert (ref.dense_attention(q, cache.k, cache.v, meta, scale=run["scale"])[:live] - got[:live]).abs().max() > 1e-3

    run = _hf_run(dense, rotary, seq, seed=12)
    meta, cache, q, _, rows = _paged_step(run, qo_lens, kv_lens, block, seed=5)
    got = ref.dense_attention(q, cache.k, cache.v, meta, scale=run["scale"])
    torch.testing.assert_close(got[:live], run["attention"][rows], rtol=1e-5, atol=1e-5)
    assert (got[live:] == 0).all()


# ---------------------------------------------------------------- naive loops from the spec

def _naive_selection(index_q, index_k_cache, tables, qo_lens, kv_lens, block, topk, local, init, total):
    """Per request r, verify token t, index head h: the spec written out one key at a time."""
    heads = index_q.shape[1]
    out = torch.full((heads, total, topk), -1, dtype=torch.int32)
    row = 0
    for r, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        for t in range(qo):
            seen = min(kv - qo + t + 1, kv)                  # the token's own kv length
            n_valid = -(-seen // block)
            for h in range(heads):
                score = {}
                for j in range(seen):
                    key = index_k_cache[int(tables[r, j // block]), j % block].double()
                    s = float(index_q[row, h].double() @ key)
                    score[j // block] = max(score.get(j // block, -math.inf), s)
                forced = {b for b in range(n_valid) if b >= n_valid - local or b < init}
                ranked = sorted(range(n_valid), key=lambda b: (b not in forced, -score[b]))
                ids = sorted(ranked[:topk])
                out[h, row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            row += 1
    return out


@settings(max_examples=25, deadline=None, derandomize=True)
@given(reqs=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 30)), min_size=1, max_size=3),
       block=st.sampled_from([2, 4, 8]), topk=st.integers(1, 5), local=st.integers(0, 2), init=st.integers(0, 2),
       heads=st.integers(1, 3), pad=st.integers(0, 3), seed=st.integers(0, 999))
def test_select_blocks_equals_a_per_key_loop(reqs, block, topk, local, init, heads, pad, seed):
    local, init = min(local, topk), min(init, topk - min(local, topk))  # forced blocks fit in top-k
    qo_lens = [q for q, _ in reqs]
    kv_lens = [q + extra for q, extra in reqs]
    gen = torch.Generator().manual_seed(seed)
    geo = Geometry(q_heads=heads, kv_heads=heads, head_dim=4, index_heads=heads, index_dim=8, block=block, topk=topk)
    num_pages = sum(-(-kv // block) for kv in kv_lens) + 1
    tables = shuffled_block_tables(kv_lens, block, num_pages, gen)
    meta = build_step_meta(qo_lens, kv_lens, tables, block, device="cpu", pad_tokens=pad)
    cache = make_cache(num_pages, geo, kv_dtype=torch.float32, index_dtype=torch.float32, device="cpu", generator=gen)
    total = sum(qo_lens) + pad
    index_q = torch.randn(total, heads, 8, generator=gen)
    got = ref.select_blocks(index_q, cache.index_k, meta, topk=topk, local_blocks=local, init_blocks=init)
    expect = _naive_selection(index_q, cache.index_k, tables, qo_lens, kv_lens, block, topk, local, init, total)
    assert torch.equal(got, expect)


def _naive_attention(q, k_cache, v_cache, tables, qo_lens, kv_lens, selection, scale, k_scale, v_scale):
    """One (token, query head) at a time; fp8 pages dequantised key by key (value * scale)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    hq, hkv, block = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    row = 0
    for r, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        for t in range(qo):
            p = kv - qo + t
            for h in range(hq):
                g = h * hkv // hq                              # contiguous GQA groups
                keys = [j for j in range(p + 1) if selection is None or j // block in selection[g, row].tolist()]
                pages = [int(tables[r, j // block]) for j in keys]
                kk = torch.stack([k_cache[pg, g, j % block].double() * k_scale for pg, j in zip(pages, keys)])
                vv = torch.stack([v_cache[pg, g, j % block].double() * v_scale for pg, j in zip(pages, keys)])
                out[row, h] = torch.softmax(kk @ q[row, h].double() * scale, 0) @ vv
            row += 1
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_fp8_kv_with_scales_gqa_and_padding_equal_a_per_key_loop(kv_dtype):
    geo = Geometry(q_heads=6, kv_heads=2, head_dim=8, index_heads=2, index_dim=8, block=4, topk=2)
    qo_lens, kv_lens, pad = [3, 1, 4], [14, 6, 4], 3
    gen = torch.Generator().manual_seed(9)
    num_pages = sum(-(-kv // geo.block) for kv in kv_lens) + 2
    tables = shuffled_block_tables(kv_lens, geo.block, num_pages, gen)
    meta = build_step_meta(qo_lens, kv_lens, tables, geo.block, device="cpu", pad_tokens=pad)
    cache = make_cache(num_pages, geo, kv_dtype=kv_dtype, index_dtype=torch.float32, device="cpu", generator=gen)
    k_scale, v_scale = (cache.k_scale, cache.v_scale) if kv_dtype != torch.bfloat16 else (0.5, 2.0)
    total = sum(qo_lens) + pad
    q = verify_queries(1, total, geo.q_heads, geo.head_dim, torch.bfloat16, "cpu", gen)
    index_q = torch.randn(total, geo.index_heads, geo.index_dim, generator=gen)
    sel = ref.select_blocks(index_q, cache.index_k, meta, topk=geo.topk)
    live, scale = sum(qo_lens), 0.35
    for selection, fn in ((sel, lambda: ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=scale,
                                                             k_scale=k_scale, v_scale=v_scale)),
                          (None, lambda: ref.dense_attention(q, cache.k, cache.v, meta, scale=scale,
                                                             k_scale=k_scale, v_scale=v_scale))):
        got = fn()
        assert got.dtype == q.dtype and got.shape == q.shape
        expect = _naive_attention(q, cache.k, cache.v, tables, qo_lens, kv_lens, selection, scale, k_scale, v_scale)
        torch.testing.assert_close(got[:live].double(), expect[:live].to(torch.bfloat16).double(), rtol=2e-2, atol=2e-2)
        assert (got[live:] == 0).all()
    # the scales matter: without them the output is another one
    plain = ref.dense_attention(q, cache.k, cache.v, meta, scale=scale)
    assert (plain[:live].float() - got[:live].float()).abs().max() > 0.05


# ---------------------------------------------------------------- byte floor, counted token by token

def _count_bytes(name, meta, selection, geo, *, q_elem, kv_elem, index_elem, live):
    """Bytes each kernel must move, counted per token / per key from first principles."""
    kv_lens = meta.kv_lens.tolist()
    cu = meta.cu_qo_lens.tolist()
    q_rw = live * geo.q_heads * geo.head_dim * q_elem * 2              # queries read + output written
    index = live * geo.index_heads * geo.index_dim * index_elem + sum(kv_lens) * geo.index_dim * index_elem
    if name == "index_select":
        return index + geo.index_heads * live * geo.topk * 4
    if name == "dense_attn":
        return q_rw + sum(kv_lens) * geo.kv_heads * 2 * geo.head_dim * kv_elem
    needed = 0                                                          # K/V keys any token of the request uses
    for h in range(geo.kv_heads):
        for r, kv in enumerate(kv_lens):
            blocks = {b for t in range(cu[r], cu[r + 1]) for b in selection[h, t].tolist() if b >= 0}
            needed += sum(1 for j in range(kv) if j // geo.block in blocks)
    kv_bytes = needed * 2 * geo.head_dim * kv_elem
    if name == "sparse_attn":
        return q_rw + kv_bytes + geo.kv_heads * live * geo.topk * 4
    return q_rw + kv_bytes + index                                      # sparse_step


@pytest.mark.parametrize("geo,kv_lens,qo,kv_dtype", [
    (Geometry(), [512, 300], 4, torch.float8_e4m3fn),                                   # M3 per TP4 rank
    (Geometry(q_heads=64, kv_heads=4, head_dim=128, index_heads=4, block=128, topk=4), [700, 256, 129], 3,
     torch.bfloat16),                                                                    # M3 unsharded
])
def test_byte_floor_equals_a_per_key_count(geo, kv_lens, qo, kv_dtype):
    gen = torch.Generator().manual_seed(1)
    num_pages = sum(-(-kv // geo.block) for kv in kv_lens)
    tables = shuffled_block_tables(kv_lens, geo.block, num_pages, gen)
    meta = build_step_meta([qo] * len(kv_lens), kv_lens, tables, geo.block, device="cpu", pad_tokens=2)
    live = qo * len(kv_lens)
    q = torch.zeros(live + 2, geo.q_heads, geo.head_dim, dtype=torch.bfloat16)
    index_q = torch.zeros(live + 2, geo.index_heads, geo.index_dim, dtype=torch.bfloat16)
    # per head and token: local block plus random earlier ones, so unions differ by head and request
    sel = torch.full((geo.kv_heads, live + 2, geo.topk), -1, dtype=torch.int32)
    for h in range(geo.kv_heads):
        for t in range(live):
            local = int(meta.positions[t]) // geo.block
            ids = sorted(set(torch.randperm(local + 1, generator=gen)[: geo.topk - 1].tolist() + [local]))
            sel[h, t, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    for name in ("index_select", "sparse_attn", "sparse_step", "dense_attn"):
        got, _ = byte_floor(name, meta, geo, q=q, index_q=index_q, kv_dtype=kv_dtype, index_dtype=torch.bfloat16,
                            selection=sel)
        expect = _count_bytes(name, meta, sel, geo, q_elem=2, kv_elem=kv_dtype.itemsize, index_elem=2, live=live)
        assert got == expect, name
