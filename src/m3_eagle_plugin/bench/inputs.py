"""Random, M3-shaped verify-step inputs on a paged cache that mimics the production pool layout.

Why: kernels must be checked and timed on the layout they meet in production: K and V pages are
strided views into one pool storage `[P, sub_pages, page_elems]` (K, V and other layers' pages
interleaved), the index-K pages likewise, and page tables are shuffled so no request's pages are
contiguous.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .step_meta import StepMeta, build_step_meta


@dataclass(frozen=True)
class Geometry:
    """Per-rank attention geometry (defaults: MiniMax-M3 under TP4)."""

    q_heads: int = 16
    kv_heads: int = 1
    head_dim: int = 128
    index_heads: int = 1
    index_dim: int = 128
    block: int = 128
    topk: int = 16


@dataclass
class PagedCache:
    k: torch.Tensor          # [P, Hkv, B, D] strided view
    v: torch.Tensor          # [P, Hkv, B, D] strided view
    index_k: torch.Tensor    # [P, B, Di] strided view
    k_scale: float
    v_scale: float
    storage: list[torch.Tensor] = field(default_factory=list)


def _randn(shape, dtype, device, generator, std=1.0) -> torch.Tensor:
    x = torch.randn(shape, device=device, generator=generator, dtype=torch.float32) * std
    return x.to(dtype)


def make_cache(num_pages: int, geo: Geometry, *, kv_dtype: torch.dtype, index_dtype: torch.dtype,
               device, generator: torch.Generator, sub_pages: int = 3) -> PagedCache:
    """K/V/index-K as strided views into pools with `sub_pages` sub-pages per slot (K at 0, V at 1)."""
    page_elems = geo.kv_heads * geo.block * geo.head_dim
    is_fp8 = kv_dtype not in (torch.float32, torch.float16, torch.bfloat16)
    pool = _randn((num_pages, sub_pages, page_elems), torch.float32, device, generator)
    k_scale = v_scale = 1.0
    if is_fp8:
        k_scale, v_scale = 0.05, 0.04
        pool[:, 0] /= k_scale * 8
        pool[:, 1] /= v_scale * 8
    pool = pool.to(kv_dtype)
    shape = (num_pages, geo.kv_heads, geo.block, geo.head_dim)
    k = pool[:, 0].view(shape)
    v = pool[:, 1].view(shape)
    index_pool = _randn((num_pages, 2, geo.block * geo.index_dim), index_dtype, device, generator)
    index_k = index_pool[:, 1].view(num_pages, geo.block, geo.index_dim)
    return PagedCache(k=k, v=v, index_k=index_k, k_scale=k_scale, v_scale=v_scale, storage=[pool, index_pool])


def shuffled_block_tables(kv_lens: list[int], block: int, num_pages: int, generator: torch.Generator,
                          width: int | None = None) -> torch.Tensor:
    """int32 `[R, width]`: each request gets distinct random pages, unused entries -1."""
    need = [-(-kv // block) for kv in kv_lens]
    width = max(need) if width is None else width
    if sum(need) > num_pages:
        raise ValueError(f"{sum(need)} pages needed, pool has {num_pages}")
    perm = torch.randperm(num_pages, generator=generator)
    table = torch.full((len(kv_lens), width), -1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[start:start + n].to(torch.int32)
        start += n
    return table


def verify_queries(num_requests: int, qo_len: int, heads: int, dim: int, dtype, device,
                   generator: torch.Generator, correlation: float = 0.0) -> torch.Tensor:
    """`[R * qo_len, heads, dim]`; with `correlation` in (0, 1) a request's tokens share a base vector
    (consecutive verify tokens look alike, so their block selections mostly agree)."""
    base = _randn((num_requests, 1, heads, dim), torch.float32, device, generator)
    noise = _randn((num_requests, qo_len, heads, dim), torch.float32, device, generator)
    q = correlation * base + (1.0 - correlation ** 2) ** 0.5 * noise
    return q.reshape(num_requests * qo_len, heads, dim).to(dtype)


def shared_selection(meta: StepMeta, geo: Geometry, generator: torch.Generator) -> torch.Tensor:
    """int32 `[Hkv, T, topk]` like the anchors' runs: a base set of topk-1 blocks per request, which
    the first verify token keeps and each later one changes by swapping one of them for another
    visible block, plus its own local block; a token that sees at most topk blocks selects all of
    them, as a top-k does."""
    kv_lens = meta.kv_lens.tolist()
    cu = meta.cu_qo_lens.tolist()
    num_tokens = meta.positions.shape[0]
    out = torch.full((geo.kv_heads, num_tokens, geo.topk), -1, dtype=torch.int32)
    positions = meta.positions.tolist()
    for h in range(geo.kv_heads):
        for r, kv in enumerate(kv_lens):
            first_local = positions[cu[r]] // geo.block
            pool = first_local  # blocks strictly before every token's local block
            base = torch.randperm(max(pool, 1), generator=generator)[: geo.topk - 1].tolist() if pool else []
            for t in range(cu[r], cu[r + 1]):
                local = positions[t] // geo.block
                chosen = list(base)
                if t > cu[r] and pool > len(base) and chosen:
                    spare = [b for b in torch.randperm(pool, generator=generator)[: geo.topk + 1].tolist()
                             if b not in chosen]
                    if spare:
                        chosen[int(torch.randint(len(chosen), (1,), generator=generator))] = spare[0]
                ids = sorted(set(chosen + [local]))[-geo.topk:]
                if local < geo.topk:  # every visible block fits: a top-k selects them all
                    ids = list(range(local + 1))
                out[h, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out.to(meta.positions.device)


def _union_ids(selection: torch.Tensor, meta: StepMeta):
    """(request, distinct selected block ids) for every (KV head, request) of `selection`."""
    cu = meta.cu_qo_lens.tolist()
    sel = selection.cpu()
    for h in range(sel.shape[0]):
        for r in range(len(cu) - 1):
            ids = sel[h, cu[r]:cu[r + 1]].flatten()
            yield r, torch.unique(ids[ids >= 0])


def union_blocks(selection: torch.Tensor, meta: StepMeta) -> int:
    """Sum over (request, KV head) of the number of distinct selected blocks."""
    return sum(int(ids.numel()) for _, ids in _union_ids(selection, meta))


def selected_tokens(selection: torch.Tensor, meta: StepMeta) -> int:
    """Sum over (request, KV head) of the valid tokens in the distinct selected blocks: a block
    counts `block_size` tokens, the request's partly filled last block only its `kv_len` share."""
    kv_lens, block = meta.kv_lens.tolist(), meta.block_size
    return sum(int((kv_lens[r] - ids * block).clamp(0, block).sum()) for r, ids in _union_ids(selection, meta))


def make_step(batch: int, context: int, qo_len: int, geo: Geometry, *, kv_dtype, index_dtype, q_dtype,
              device, seed: int = 0, spare_pages: int = 0) -> dict:
    """One verify step: meta, cache, queries, index queries and a shared-style selection."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    kv_lens = [context] * batch
    num_pages = batch * (-(-context // geo.block)) + spare_pages
    tables = shuffled_block_tables(kv_lens, geo.block, num_pages, gen)
    meta = build_step_meta([qo_len] * batch, kv_lens, tables, geo.block, device=device)
    cache = make_cache(num_pages, geo, kv_dtype=kv_dtype, index_dtype=index_dtype, device=device, generator=dgen)
    q = verify_queries(batch, qo_len, geo.q_heads, geo.head_dim, q_dtype, device, dgen)
    index_q = verify_queries(batch, qo_len, geo.index_heads, geo.index_dim, index_dtype, device, dgen,
                             correlation=0.97)
    selection = shared_selection(meta, geo, gen)
    return {"meta": meta, "cache": cache, "q": q, "index_q": index_q, "selection": selection}
