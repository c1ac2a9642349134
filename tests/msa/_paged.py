"""Test helpers: a pooled paged cache with strided per-role views, and naive python references.

The pool mimics the "mega-slot" layout: one tensor ``[P, sub_pages, elems]`` whose K, V and
index-K pages are strided sub-views, so the code under test never sees contiguous caches.
"""

from __future__ import annotations

import math

import torch


class PooledCache:
    def __init__(self, num_pages: int, block_size: int, kv_heads: int, head_dim: int, index_dim: int) -> None:
        elems = max(kv_heads * block_size * head_dim, block_size * index_dim)
        self.pool = torch.full((num_pages, 3, elems + 5), float("nan"))  # +5: pages are not back to back
        kv_elems = kv_heads * block_size * head_dim
        self.k = self.pool[:, 0, :kv_elems].unflatten(-1, (kv_heads, block_size, head_dim))
        self.v = self.pool[:, 1, :kv_elems].unflatten(-1, (kv_heads, block_size, head_dim))
        self.index_k = self.pool[:, 2, : block_size * index_dim].unflatten(-1, (block_size, index_dim))
        if num_pages > 1:
            assert not self.k.is_contiguous() and not self.index_k.is_contiguous()


def random_page_tables(kv_lens: list[int], block_size: int, num_pages: int, seed: int) -> list[list[int]]:
    """Disjoint random pages for each request, enough for its kv length."""
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for kv in kv_lens:
        need = math.ceil(kv / block_size)
        tables.append(order[used : used + need])
        used += need
    return tables


def padded_table(tables: list[list[int]], width: int) -> torch.Tensor:
    out = torch.full((len(tables), width), -1, dtype=torch.int32)
    for r, pages in enumerate(tables):
        out[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return out


def naive_selection(
    index_q: torch.Tensor, index_k: torch.Tensor, position: int, block_size: int, topk: int, local: int, init: int
) -> list[frozenset[int]]:
    """Per index head, the selected block set of one query (python loops, float64 scores)."""
    own = position // block_size
    out = []
    for h in range(index_q.shape[0]):
        scores = {}
        for b in range(own + 1):
            keys = range(b * block_size, min((b + 1) * block_size, position + 1))
            scores[b] = max(float(index_q[h].double() @ index_k[j].double()) for j in keys)
        forced = {b for b in range(own + 1) if b > own - local or b < init}
        rest = sorted((b for b in scores if b not in forced), key=lambda b: -scores[b])
        out.append(frozenset(forced | set(rest[: max(0, topk - len(forced))])))
    return out


def naive_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: list[list[int]], scale: float
) -> torch.Tensor:
    """Attention of one token: ``q [Hq, D]``, sequence ``keys/values [S, Hkv, D]``,
    ``allowed[kv_head]`` = key positions that head may read. float64, zeros when nothing allowed."""
    num_q, dim = q.shape
    group = num_q // keys.shape[1]
    out = torch.zeros(num_q, dim, dtype=torch.float64)
    for h in range(num_q):
        idx = allowed[h // group]
        if not idx:
            continue
        kk = keys[idx, h // group].double()
        vv = values[idx, h // group].double()
        w = torch.softmax((kk @ q[h].double()) * scale, dim=0)
        out[h] = w @ vv
    return out
