"""Move one request's KV pages between two caches (e.g. context -> generation server).

The unit of transfer is the slot: a slot of every pool carries K, V and index-K of every
target layer and the shared draft layer(s) alike, so copying a request's slots moves all of
them. The payload names the geometry it came from; importing into a cache with a different
geometry (pools, placements, shapes, dtype, block size) is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Hashable

import torch

from m3_eagle_plugin.kv.allocator import OutOfBlocksError
from m3_eagle_plugin.kv.manager import PagedKVCache


class GeometryMismatchError(ValueError):
    """The payload's cache geometry differs from the importing cache's."""


@dataclass(frozen=True, eq=False)
class KVTransferPayload:
    """A request's pages: ``pool_pages[p]`` is uint8 ``[num_pages, sub_pages, page_bytes]``."""

    fingerprint: str
    num_tokens: int
    pool_pages: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        # read once, here: a generator of pages was spent by the import's first check, and the
        # import then copied no page yet registered the request
        if isinstance(self.pool_pages, torch.Tensor):  # tuple() would split it into its pages
            raise TypeError("pool_pages must be a sequence of tensors, one per pool, got one Tensor")
        object.__setattr__(self, "pool_pages", tuple(self.pool_pages))

    @property
    def num_pages(self) -> int:
        return int(self.pool_pages[0].shape[0]) if self.pool_pages else 0


def cache_fingerprint(cache: PagedKVCache) -> str:
    """Everything that must agree for slot bytes to mean the same on both sides. Every rank of a
    tensor-parallel group has the same geometry, so a cache tagged with its ``shard`` adds it (an
    untagged cache's fingerprint is what it was before the tag existed)."""
    fields = {
        "geometry": json.loads(cache.geometry.fingerprint()),
        "block_size": cache.block_size,
        "dtype": str(cache.dtype),
        "head_dim": cache.head_dim,
        "index_dim": cache.index_dim,
        "kv_heads": sorted(cache.kv_heads.items()),
    }
    if cache.shard is not None:
        fields["shard"] = list(cache.shard)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def fingerprint_difference(got: str, expected: str) -> str:
    """The fields in which fingerprint ``got`` differs from ``expected``, each with both values."""
    if not isinstance(got, str):
        return f"its form: a {type(got).__name__} is not a cache fingerprint"
    try:
        a, b = json.loads(got), json.loads(expected)
    except (ValueError, RecursionError):  # RecursionError: arrays nested deeper than the parser goes
        return f"its form: {got[:80]!r} is not a cache fingerprint"
    if not isinstance(a, dict):
        return f"its form: {got[:80]!r} is not a cache fingerprint"
    keys = _differing_keys(a, b)
    if not keys:  # compared as text, like `import_request`
        return "its text only: the same fields, not written as this side writes them (sorted keys, no spaces)"
    return "; ".join(_field_difference(k, a.get(k), b.get(k)) for k in keys)


def _field_difference(name: str, got, expected) -> str:
    """One differing fingerprint field; a nested one (the pool geometry) by its own differing fields:
    cut to 120 characters as a whole, two geometries read alike as far as they were shown."""
    if isinstance(got, dict) and isinstance(expected, dict):
        return "; ".join(_field_difference(f"{name}.{k}", got.get(k), expected.get(k))
                         for k in _differing_keys(got, expected))
    return f"{name} (payload {json.dumps(got)[:120]}, cache {json.dumps(expected)[:120]})"


def _differing_keys(got: dict, expected: dict) -> list[str]:
    return sorted(k for k in got.keys() | expected.keys() if got.get(k) != expected.get(k))


def export_request(cache: PagedKVCache, rid: Hashable) -> KVTransferPayload:
    """Copy ``rid``'s pages out of ``cache`` (to host memory)."""
    pages = cache.pages(rid)
    index = torch.tensor(pages, dtype=torch.long, device=cache.device)
    pool_pages = tuple(
        cache.storage(p.pool_id).index_select(0, index).view(torch.uint8).cpu()
        for p in cache.geometry.pools
    )
    return KVTransferPayload(cache_fingerprint(cache), cache.num_tokens(rid), pool_pages)


def import_request(cache: PagedKVCache, rid: Hashable, payload: KVTransferPayload) -> torch.Tensor:
    """Allocate pages for ``rid`` in ``cache``, copy the payload in; returns its page table.

    ``rid`` must be new to ``cache``. All-or-nothing: on a mismatch or when blocks run out,
    ``cache`` is unchanged.
    """
    if not isinstance(payload, KVTransferPayload):
        raise TypeError(f"payload must be a KVTransferPayload, got {type(payload).__name__}")
    if rid in cache.allocator:  # first: into a cache it fills, the block count was named instead
        raise ValueError(f"request {rid!r} already exists in this cache")
    expected = cache_fingerprint(cache)
    if payload.fingerprint != expected:
        raise GeometryMismatchError("KV payload geometry differs from this cache's in "
                                    f"{fingerprint_difference(payload.fingerprint, expected)}")
    others = [type(t).__name__ for t in payload.pool_pages if not isinstance(t, torch.Tensor)]
    if others:  # a NumPy array was "not uint8, got [dtype('uint8')]", a list a bare AttributeError
        raise TypeError(f"payload pages must be torch tensors (as export_request writes them), got {others}")
    needed = cache.allocator.blocks_for(payload.num_tokens)
    shapes = [(needed, p.sub_pages, p.page_bytes) for p in cache.geometry.pools]
    if [tuple(t.shape) for t in payload.pool_pages] != shapes:
        raise ValueError(f"payload holds {[tuple(t.shape) for t in payload.pool_pages]} pages, "
                         f"expected {shapes} for {payload.num_tokens} tokens")
    dtypes = [t.dtype for t in payload.pool_pages]
    if any(dtype != torch.uint8 for dtype in dtypes):
        raise ValueError(f"payload pages must be uint8 bytes (as export_request writes them), got {dtypes}")
    if needed > cache.num_free_blocks:
        raise OutOfBlocksError(f"importing request {rid!r} needs {needed} blocks, "
                               f"only {cache.num_free_blocks} are free")
    # Copied as bytes into byte views of the storage: no kernel of the element dtype is needed
    # (CPU torch has no fp8 index_copy_), and a payload in any memory order is accepted.
    sources = [data.to(cache.device) for data in payload.pool_pages]
    try:
        # inside: CPython 3.10 raises a pending Ctrl-C as allocate returns, past its own clean-up
        pages = cache.allocator.allocate(rid, payload.num_tokens)
        # inside: a device allocation failing here (out of memory beside the staged pages) leaks nothing
        index = torch.tensor(pages, dtype=torch.long, device=cache.device)
        for pool, source in zip(cache.geometry.pools, sources):
            cache.storage(pool.pool_id).view(torch.uint8).index_copy_(0, index, source)
        table = torch.tensor(pages, dtype=torch.int32)  # inside too: the caller gets no request on an error
    except BaseException:
        if rid in cache.allocator:  # registered by this call (refused above when it was not new)
            cache.allocator.free(rid)  # no request registered over half-written pages
        raise
    return table
