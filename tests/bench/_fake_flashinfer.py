"""A naive, CPU-only stand-in for the slice of FlashInfer 0.7.4 the bench peer calls.

Written from the documented contracts (docstrings of flashinfer/msa_ops/*.py and
BatchPrefillWithPagedKVCacheWrapper), one token and one key at a time, so the peer's layout
conversions are checked against FlashInfer's semantics rather than against our own reference.
It also enforces the SM90 layout rules the real ops raise on (interleaved K/V, contiguous
int32 q2k_indices, contiguous one-head index cache).
"""
from __future__ import annotations

import math
import types

import torch


def _positions(cu_q, seqused_k):
    """(request, token, position) with queries right-aligned to each request's KV end."""
    cu, used = cu_q.tolist(), seqused_k.tolist()
    for r in range(len(used)):
        for t in range(cu[r], cu[r + 1]):
            yield r, t, used[r] - (cu[r + 1] - cu[r]) + (t - cu[r])


def _check_interleaved(k, v):
    d = k.shape[-1]
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr(), "K/V not one allocation"
    assert v.data_ptr() - k.data_ptr() == d * k.element_size(), "V is not the second half of K's rows"
    assert k.stride() == v.stride() and k.stride()[-1] == 1
    p, h, b, _ = k.shape
    assert k.stride() == (h * b * 2 * d, b * 2 * d, 2 * d, 1), "interleaved cache is not dense"


def make(refuse_decode: bool = False, broken: tuple[str, ...] = ()) -> tuple[types.ModuleType, types.ModuleType]:
    """(flashinfer, flashinfer.msa_ops) modules; `broken` names functions that raise."""
    calls: list[str] = []

    def maybe_break(name):
        calls.append(name)
        if name in broken:
            raise RuntimeError(f"fake {name} failure")

    def msa_proxy_score(q, k, cu_seqlens_q, cu_seqlens_k=None, *, page_table, seqused_k, causal=True,
                        max_seqlen_q=None, max_k_tiles=None, output=None, **_):
        maybe_break("msa_proxy_score")
        assert causal and k.is_contiguous() and k.shape[1] == 1
        block = k.shape[2]
        out = output if output is not None else torch.empty(q.shape[1], max_k_tiles, q.shape[0])
        out.fill_(-math.inf)
        for r, t, pos in _positions(cu_seqlens_q, seqused_k):
            for j in range(pos + 1):
                key = k[int(page_table[r, j // block]), 0, j % block].double()
                for h in range(q.shape[1]):
                    s = float(q[t, h].double() @ key)
                    out[h, j // block, t] = max(float(out[h, j // block, t]), s)
        return out

    def msa_topk_select(max_score, topk, num_valid_pages=None, output=None, force_begin_blocks=0,
                        force_end_blocks=0):
        maybe_break("msa_topk_select")
        heads, tiles, tokens = max_score.shape
        out = output if output is not None else torch.empty(tokens, heads, topk, dtype=torch.int32)
        out.fill_(-1)
        for t in range(tokens):
            n = tiles if num_valid_pages is None else (
                int(num_valid_pages[t]) if torch.is_tensor(num_valid_pages) else int(num_valid_pages))
            for h in range(heads):
                forced = set(range(min(force_begin_blocks, n))) | set(range(n - force_end_blocks, n))
                rest = [b for b in range(n) if b not in forced and max_score[h, b, t] > -math.inf]
                rest.sort(key=lambda b: -float(max_score[h, b, t]))
                ids = sorted(forced | set(rest[: topk - len(forced)]))
                out[t, h, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return out

    def _sparse(q, k, v, q2k, cu_q, page_table, seqused_k, softmax_scale, v_global_scale):
        _check_interleaved(k, v)
        assert q2k.dtype == torch.int32 and q2k.is_contiguous() and q2k.shape[:2] == (k.shape[1], q.shape[0])
        block, group = k.shape[2], q.shape[1] // k.shape[1]
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out = torch.zeros_like(q)
        for r, t, pos in _positions(cu_q, seqused_k):
            for h in range(q.shape[1]):
                g = h // group
                chosen = set(q2k[g, t].tolist()) - {-1}
                keys = [j for j in range(pos + 1) if j // block in chosen]
                pages = [int(page_table[r, j // block]) for j in keys]
                kk = torch.stack([k[p, g, j % block].double() for p, j in zip(pages, keys)])
                vv = torch.stack([v[p, g, j % block].double() for p, j in zip(pages, keys)])
                w = torch.softmax(kk @ q[t, h].double() * scale, 0)
                out[t, h] = (w @ vv * (v_global_scale or 1.0)).to(q.dtype)
        return out

    def msa_sparse_decode_attention(q, k, v, q2k_indices, *, page_table, seqused_k, seqlen_q=1, causal=True,
                                    softmax_scale=None, v_global_scale=None, **_):
        maybe_break("msa_sparse_decode_attention")
        if refuse_decode:
            raise ValueError("GQA group size must be <= 16 for decode")
        cu = torch.arange(0, q.shape[0] + 1, seqlen_q, dtype=torch.int32)
        return _sparse(q, k, v, q2k_indices, cu, page_table, seqused_k, softmax_scale, v_global_scale)

    def msa_sparse_attention(q, k, v, q2k_indices, cu_seqlens_q, cu_seqlens_k=None, causal=False,
                             softmax_scale=None, page_table=None, seqused_k=None, v_global_scale=None,
                             out=None, **_):
        maybe_break("msa_sparse_attention")
        assert causal
        got = _sparse(q, k, v, q2k_indices, cu_seqlens_q, page_table, seqused_k, softmax_scale, v_global_scale)
        return got if out is None else out.copy_(got)

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, **buffers):
            maybe_break("BatchPrefillWithPagedKVCacheWrapper")
            calls.append(f"prefill(use_cuda_graph={use_cuda_graph})")
            assert kv_layout == "HND"
            if use_cuda_graph:  # the real wrapper needs its fixed index buffers up front
                assert set(buffers) == {"qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf",
                                        "paged_kv_last_page_len_buf"}, buffers

        def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                 page_size, causal=False, sm_scale=None, **_):
            calls.append("prefill.plan")
            assert causal
            self.plan_args = (qo_indptr, kv_indptr, kv_indices, last_page_len, page_size, sm_scale)

        def run(self, q, paged_kv_cache, *, out=None, k_scale=None, v_scale=None, **_):
            maybe_break("prefill.run")
            qo_indptr, kv_indptr, kv_indices, last, page, sm_scale = self.plan_args
            k, v = paged_kv_cache
            group = q.shape[1] // k.shape[1]
            scale = (sm_scale if sm_scale is not None else q.shape[-1] ** -0.5) * (k_scale or 1.0)
            result = torch.zeros_like(q)
            for r in range(len(qo_indptr) - 1):
                pages = kv_indices[int(kv_indptr[r]):int(kv_indptr[r + 1])].tolist()
                kv_len = (len(pages) - 1) * page + int(last[r])
                q0, q1 = int(qo_indptr[r]), int(qo_indptr[r + 1])
                for t in range(q0, q1):
                    limit = kv_len - (q1 - q0) + (t - q0)
                    for h in range(q.shape[1]):
                        kk = torch.stack([k[pages[j // page], h // group, j % page].double() for j in range(limit + 1)])
                        vv = torch.stack([v[pages[j // page], h // group, j % page].double() for j in range(limit + 1)])
                        w = torch.softmax(kk @ q[t, h].double() * scale, 0)
                        result[t, h] = (w @ vv * (v_scale or 1.0)).to(q.dtype)
            return result if out is None else out.copy_(result)

    msa = types.ModuleType("flashinfer.msa_ops")
    for fn in (msa_proxy_score, msa_topk_select, msa_sparse_decode_attention, msa_sparse_attention):
        setattr(msa, fn.__name__, fn)
    fi = types.ModuleType("flashinfer")
    fi.__version__ = "0.7.4-fake"
    fi.msa_ops = msa
    fi.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    fi.calls = calls
    return fi, msa
