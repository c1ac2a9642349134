"""Two paged caches driven like a serving host, with a per-request shadow of what KV they must hold.

`KVWorld` owns two `PagedKVCache`s (think context and generation server). Every K, V and
index-K value written for a request (target layers and the shared draft layer) is also kept in
that request's shadow, indexed by position: the shadow is exactly what a fresh single-request
cache would hold. `check()` compares every live request's cache contents with its shadow and
checks that no page is shared between live requests or lost by the allocator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._reference import token_fields


@dataclass
class Shadow:
    """What one request's cache must hold: per (layer, role), the values of positions 0..n-1."""

    length: int = 0
    values: dict[tuple[int, str], list[torch.Tensor]] = field(default_factory=dict)

    def keep(self, n: int) -> None:
        self.length = n
        for key in self.values:
            del self.values[key][n:]


class KVWorld:
    def __init__(self, kv_mod, msa_mod, *, num_layers: int, sparse: list[int], num_kv_heads: int,
                 head_dim: int, index_dim: int, block_size: int, num_blocks: tuple[int, int],
                 draft_num_kv_heads: int | None = None, seed: int = 0) -> None:
        self.kv, self.msa = kv_mod, msa_mod
        self.block_size = block_size
        self.caches = [
            kv_mod.PagedKVCache.for_minimax_m3(
                num_layers, sparse, num_kv_heads, head_dim, index_dim, block_size, n,
                num_draft_layers=1, draft_num_kv_heads=draft_num_kv_heads, dtype=torch.float32)
            for n in num_blocks
        ]
        for cache in self.caches:  # poison: any read of a never-written slot is visible
            for pool in range(len(cache.geometry.pools)):
                cache.storage(pool).fill_(float("nan"))
        self.layers = list(range(num_layers))
        self.sparse = list(sparse)
        self.draft_layer = self.caches[0].draft_layer_ids[0]
        self.home: dict[int, int] = {}       # rid -> index of the cache holding it
        self.shadow: dict[int, Shadow] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.metadata = None
        if hasattr(msa_mod, "MsaDecodeMetadata"):
            self.metadata = msa_mod.MsaDecodeMetadata(64, 256, 64, block_size, torch.device("cpu"), max_draft_len=3)

    def _view(self, cache, layer: int, role: str) -> torch.Tensor:
        if role == "index_k":
            return cache.index_k(layer)
        return cache.k(layer) if role == "k" else cache.v(layer)

    # ---- host operations ------------------------------------------------------------------
    def join(self, rid: int, where: int) -> None:
        self.caches[where].add_request(rid)
        self.home[rid] = where
        self.shadow[rid] = Shadow()

    def step(self, where: int, work: list[tuple[int, int]], overshoot: dict[int, int] | None = None) -> bool:
        """One forward step in cache `where`: each (rid, qo) writes qo new tokens after its prefix.

        `overshoot[rid]` > 0 stages an optimistic kv length (as the overlap scheduler does) that
        `on_update_kv_lens` then corrects on the device; the request keeps the extra reserved
        pages until the caller rewinds it. False (and nothing changed) when blocks run out."""
        cache = self.caches[where]
        overshoot = overshoot or {}
        rids = [rid for rid, _ in work]
        qo = [q for _, q in work]
        kv = [self.shadow[rid].length + q for rid, q in work]
        staged = [n + overshoot.get(rid, 0) for rid, n in zip(rids, kv)]
        held = [cache.num_tokens(rid) for rid in rids]
        for i, (rid, n) in enumerate(zip(rids, staged)):
            try:
                cache.reserve(rid, n)
            except self.kv.OutOfBlocksError:
                assert cache.num_tokens(rid) == held[i], "a refused reserve changed the request"
                for done, before in zip(rids[:i], held[:i]):  # the host gives the step back
                    cache.rewind(done, before)
                return False
        table = cache.block_table(rids)
        slots = token_fields(qo, kv, table, self.block_size)["cache_slots"]
        if self.metadata is not None:
            self.metadata.prepare(qo, staged, table)
            if staged != kv:
                self.metadata.on_update_kv_lens(torch.tensor(kv, dtype=torch.int32))
            got = torch.as_tensor(self.metadata.cache_slots).to(torch.int64)
            assert got.tolist() == slots.tolist(), "metadata cache_slots differ from the page table's"
            slots = got  # write where the metadata says: the shadow check then catches any misplacement
        total = sum(qo)
        rows = [rid for rid, q in work for _ in range(q)]
        write_kv = getattr(self.msa, "write_kv", None) or self.msa.cache_write.write_kv
        write_index_k = getattr(self.msa, "write_index_k", None) or self.msa.cache_write.write_index_k
        written: dict[tuple[int, str], torch.Tensor] = {}
        for layer in self.layers + [self.draft_layer]:
            k_view, v_view = cache.k(layer), cache.v(layer)
            shape = (total, k_view.shape[1], k_view.shape[3])
            k = torch.randn(shape, generator=self.gen)
            v = torch.randn(shape, generator=self.gen)
            write_kv(k_view, v_view, slots, k, v)
            written[(layer, "k")], written[(layer, "v")] = k, v
        for layer in self.sparse:
            ik_view = cache.index_k(layer)
            ik = torch.randn(total, ik_view.shape[-1], generator=self.gen)
            write_index_k(ik_view, slots, ik)
            written[(layer, "index_k")] = ik
        for key, values in written.items():
            for t, rid in enumerate(rows):
                self.shadow[rid].values.setdefault(key, []).append(values[t])
        for rid, n in zip(rids, kv):
            self.shadow[rid].length = n
        return True

    def rewind(self, rid: int, n: int) -> None:
        self.caches[self.home[rid]].rewind(rid, n)
        self.shadow[rid].keep(n)

    def finish(self, rid: int) -> None:
        self.caches[self.home.pop(rid)].free(rid)
        del self.shadow[rid]

    def migrate(self, rid: int) -> bool:
        """Export `rid` from its cache and import it into the other; False if the target is full
        (predicted from the request's length and the target's free blocks, not taken on trust)."""
        src = self.home[rid]
        dst = 1 - src
        payload = self.kv.export_request(self.caches[src], rid)
        before = self.caches[dst].num_free_blocks
        needed = math.ceil(self.shadow[rid].length / self.block_size)
        try:
            self.kv.import_request(self.caches[dst], rid, payload)
        except self.kv.OutOfBlocksError:
            assert needed > before, f"an import of {needed} blocks was refused with {before} free"
            assert self.caches[dst].num_free_blocks == before, "a refused import kept blocks"
            assert rid not in self.caches[dst].allocator, "a refused import kept the request"
            return False
        assert needed <= before, f"an import of {needed} blocks succeeded with {before} free"
        self.caches[src].free(rid)
        self.home[rid] = dst
        return True

    # ---- the invariant ------------------------------------------------------------------
    def check(self) -> None:
        for index, cache in enumerate(self.caches):
            live = [rid for rid, home in self.home.items() if home == index]
            assert sorted(cache.allocator.request_ids) == sorted(live), "allocator and host disagree on live requests"
            pages = [p for rid in live for p in cache.pages(rid)]
            assert len(pages) == len(set(pages)), f"cache {index}: a page is shared by two live requests"
            assert len(pages) + cache.num_free_blocks == cache.num_blocks, f"cache {index}: blocks leaked"
            for rid in live:
                self._check_request(cache, rid)

    def _check_request(self, cache, rid: int) -> None:
        shadow = self.shadow[rid]
        n = shadow.length
        assert cache.num_tokens(rid) == n, f"request {rid}: cache holds {cache.num_tokens(rid)} tokens, expected {n}"
        assert len(cache.pages(rid)) == math.ceil(n / self.block_size), f"request {rid}: wrong page count"
        if n == 0:
            return
        table = cache.block_table([rid])
        slots = token_fields([n], [n], table, self.block_size)["cache_slots"]
        pages, offsets = slots // self.block_size, slots % self.block_size
        for (layer, role), written in shadow.values.items():
            view = self._view(cache, layer, role)
            got = view[pages, offsets] if role == "index_k" else view[pages, :, offsets]
            want = torch.stack(written[:n])
            if not torch.equal(got, want):
                bad = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
                raise AssertionError(f"request {rid} layer {layer} {role}: positions {bad} differ from its shadow")
