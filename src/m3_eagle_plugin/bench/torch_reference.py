"""Naive pure-torch versions of the verify-step kernels, written for clarity, not speed.

Why: the benchmark needs a pure-torch baseline to time against and a CPU-only smoke path, and the
kernel tests need an oracle written independently of the kernels. Every function works request
by request on gathered, contiguous copies of the pages, in float32.
"""
from __future__ import annotations

import torch

from .step_meta import StepMeta


def _gather(cache: torch.Tensor, table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Pages of one request, concatenated along tokens: `[kv_len, ...]` (cache is `[P, B, ...]`)."""
    block = cache.shape[1]
    num_blocks = -(-kv_len // block)
    pages = cache[table_row[:num_blocks].long()].float()
    return pages.reshape(num_blocks * block, *cache.shape[2:])[:kv_len]


def _requests(meta: StepMeta):
    cu = meta.cu_qo_lens.tolist()
    for r, kv in enumerate(meta.kv_lens.tolist()):
        yield r, cu[r], cu[r + 1], kv


def select_blocks(index_q: torch.Tensor, index_k_cache: torch.Tensor, meta: StepMeta, *, topk: int,
                  local_blocks: int = 1, init_blocks: int = 0) -> torch.Tensor:
    """int32 `[Hi, T, topk]`: per token, top-k blocks by max visible score; ascending, -1 padded."""
    num_tokens, num_heads, _ = index_q.shape
    block = index_k_cache.shape[1]
    out = torch.full((num_heads, num_tokens, topk), -1, dtype=torch.int32)
    for r, t0, t1, kv in _requests(meta):
        keys = _gather(index_k_cache, meta.block_tables[r], kv)                 # [kv, Di]
        pos = meta.positions[t0:t1].long()
        scores = torch.einsum("thd,kd->htk", index_q[t0:t1].float(), keys)    # [Hi, q, kv]
        scores = scores.masked_fill(torch.arange(kv, device=keys.device)[None, None, :] > pos[None, :, None],
                                    float("-inf"))
        num_blocks = -(-kv // block)
        padded = torch.full((num_heads, t1 - t0, num_blocks * block), float("-inf"), device=keys.device)
        padded[..., :kv] = scores
        block_scores = padded.view(num_heads, t1 - t0, num_blocks, block).amax(-1)
        ids = torch.arange(num_blocks, device=keys.device)
        nvalid = (pos // block + 1)[None, :, None]
        forced = (ids[None, None, :] < nvalid) & ((ids >= nvalid - local_blocks) | (ids < init_blocks))
        block_scores = torch.where(forced, torch.full_like(block_scores, float("inf")), block_scores)
        k = min(topk, num_blocks)
        vals, idx = block_scores.topk(k, dim=-1)
        idx = torch.where(vals != float("-inf"), idx, torch.full_like(idx, num_blocks + 1))  # NaN is kept
        idx = idx.sort(dim=-1).values
        idx = torch.where(idx > num_blocks, torch.full_like(idx, -1), idx)
        out[:, t0:t1, :k] = idx.to(torch.int32).cpu()
    return out.to(index_q.device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[t, Hkv, G, D]`, k/v `[kv, Hkv, D]`, visible `[Hkv, t, kv]` -> `[t, Hkv, G, D]`; a token
    that sees no key (an all -1 selection) gets zeros, as `msa.sparse_attention` and the kernels."""
    scores = torch.einsum("thgd,khd->htgk", q, k) * scale
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    sees_a_key = visible.any(-1)[:, :, None, None]  # the softmax of an all -inf row is NaN
    probs = torch.where(sees_a_key, scores.softmax(-1), 0.0)
    return torch.einsum("htgk,khd->thgd", probs, v)


def sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMeta,
                     selection: torch.Tensor, *, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """`[T, Hq, D]`: each token attends to keys of its own selected blocks up to its position."""
    num_tokens, num_heads, dim = q.shape
    hkv, block = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, dim, dtype=q.dtype, device=q.device)
    kc, vc = k_cache.transpose(1, 2), v_cache.transpose(1, 2)                  # [P, B, Hkv, D]
    for r, t0, t1, kv in _requests(meta):
        k = _gather(kc, meta.block_tables[r], kv) * k_scale
        v = _gather(vc, meta.block_tables[r], kv) * v_scale
        pos = meta.positions[t0:t1].long()
        key_block = torch.arange(kv, device=q.device) // block
        sel = selection[:, t0:t1].long()                                        # [Hkv, q, topk]
        chosen = (sel[..., None] == key_block).any(dim=2)                       # [Hkv, q, kv]
        visible = chosen & (torch.arange(kv, device=q.device)[None, None, :] <= pos[None, :, None])
        qr = q[t0:t1].float().view(t1 - t0, hkv, num_heads // hkv, dim)
        out[t0:t1] = _attend(qr, k, v, visible, scale).reshape(t1 - t0, num_heads, dim).to(q.dtype)
    return out


def dense_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMeta, *,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """`[T, Hq, D]`: causal ladder over each request's whole context."""
    num_tokens, num_heads, dim = q.shape
    hkv = k_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, dim, dtype=q.dtype, device=q.device)
    kc, vc = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    for r, t0, t1, kv in _requests(meta):
        k = _gather(kc, meta.block_tables[r], kv) * k_scale
        v = _gather(vc, meta.block_tables[r], kv) * v_scale
        pos = meta.positions[t0:t1].long()
        visible = (torch.arange(kv, device=q.device)[None, :] <= pos[:, None]).expand(hkv, -1, -1)
        qr = q[t0:t1].float().view(t1 - t0, hkv, num_heads // hkv, dim)
        out[t0:t1] = _attend(qr, k, v, visible, scale).reshape(t1 - t0, num_heads, dim).to(q.dtype)
    return out
