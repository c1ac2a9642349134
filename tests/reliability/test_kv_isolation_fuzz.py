"""KV isolation under fuzzed request schedules: joins, verify steps (some staged with optimistic
lengths and corrected on the device, as under the overlap scheduler), mixed steps (prompt chunks,
a joining request and verify rows together), rejections, finishes, transfers.

Hypothesis draws bounded, seeded schedules (derandomized, so CI is repeatable). After every
operation each live request's K, V, index-K and draft-layer KV must equal its single-request
shadow, no page may be shared by two live requests, and no block may be lost. A step whose later
row finds no free block (its earlier rows already reserved theirs) is given back whole: every
request keeps the pages it held before, and the fuzz must reach that case.
"""
from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import m3_eagle_plugin.kv as kv_api
import m3_eagle_plugin.msa as msa_api

from ._counts import bump
from ._shadow import KVWorld

GEOMETRIES = {
    # K page (1 head x 4 x 8) == index-K page (4 x 8): everything coalesces into one mega-slot pool
    "mega-slot": dict(num_layers=3, sparse=[1, 2], num_kv_heads=1, head_dim=8, index_dim=8),
    # K page (2 x 4 x 8) != index-K page (4 x 8): K/V and index-K live in separate pools
    "split-pools": dict(num_layers=2, sparse=[1], num_kv_heads=2, head_dim=8, index_dim=8),
}
BLOCK = 4
BLOCKS = (14, 10)


def _modules():
    """The modules under test; a missing export is an AttributeError here (a failure, not a skip)."""
    for name in ("PagedKVCache", "export_request", "import_request", "OutOfBlocksError"):
        getattr(kv_api, name)
    for name in ("write_kv", "write_index_k", "MsaDecodeMetadata"):
        getattr(msa_api, name)
    return kv_api, msa_api


def _fault(world: KVWorld, data, kv_mod) -> None:
    """Inject one bad call; it must raise a clear error and change nothing (checked by the caller)."""
    live = sorted(world.home)
    kind = data.draw(st.sampled_from(["rewind-past-end", "unknown-request", "duplicate-import",
                                      "negative-reserve", "duplicate-join"]), label="fault")
    bump("faults.injected")
    if kind == "unknown-request":
        with pytest.raises(KeyError, match="10000"):
            world.caches[0].rewind(10_000, 0)
        return
    if not live:
        return
    rid = data.draw(st.sampled_from(live), label="fault rid")
    cache = world.caches[world.home[rid]]
    if kind == "rewind-past-end":
        with pytest.raises(ValueError, match="rewind"):
            cache.rewind(rid, cache.num_tokens(rid) + 1)
    elif kind == "negative-reserve":
        with pytest.raises(ValueError):
            cache.reserve(rid, -1)
    elif kind == "duplicate-join":
        with pytest.raises(ValueError, match="exists"):
            cache.add_request(rid)
    else:  # import a request into the cache that already holds it
        payload = kv_mod.export_request(cache, rid)
        free = cache.num_free_blocks
        with pytest.raises(ValueError):
            kv_mod.import_request(cache, rid, payload)
        assert cache.num_free_blocks == free, "a refused import kept blocks"


def _first_short_row(cache, work, lengths) -> int | None:
    """Index of the first row of ``work`` whose reservation finds too few free blocks once the rows
    before it reserved theirs (None: every row fits), counted from the page tables alone."""
    free = cache.num_free_blocks
    for i, (rid, qo) in enumerate(work):
        need = max(-(-(lengths[rid] + qo) // cache.block_size) - len(cache.pages(rid)), 0)
        if need > free:
            return i
        free -= need
    return None


def _mixed_step(world: KVWorld, data, where: int, next_rid: int, reached) -> bool:
    """One step of prompt chunks and verify rows of cache ``where``'s live requests, with a new
    request joining at a drawn row; when a row finds no free block, the whole step must be given
    back (every request, the ones before that row too, keeps exactly the pages it held). Returns
    whether the new request joined."""
    cache = world.caches[where]
    live = [r for r in sorted(world.home) if world.home[r] == where]
    rows = data.draw(st.lists(st.sampled_from(live), max_size=4, unique=True), label="mixed rows") if live else []
    world.join(next_rid, where)
    rows.insert(data.draw(st.integers(0, len(rows)), label="join row"), next_rid)
    # verify rows of 1 + K <= 4 tokens, the new request's prompt chunk up to 4 blocks
    work = [(rid, data.draw(st.integers(1, 24 if rid == next_rid else 4), label="qo")) for rid in rows]
    lengths = {rid: world.shadow[rid].length for rid in rows}
    short = _first_short_row(cache, work, lengths)
    pages = {rid: cache.pages(rid) for rid in sorted(world.home) if world.home[rid] == where}
    free = cache.num_free_blocks
    ran = world.step(where, work)
    assert ran == (short is None), f"step ran {ran}, the page tables say row {short} finds no block"
    if not ran:
        reached["short-row-0" if short == 0 else "short-later-row"] += 1
        bump("fuzz.short_first_row" if short == 0 else "fuzz.short_later_row")
        assert cache.num_free_blocks == free, "a step given back kept blocks"
        assert {rid: cache.pages(rid) for rid in pages} == pages, "a step given back moved a request's pages"
        world.finish(next_rid)
    return ran


def test_fuzzed_schedules_keep_every_request_isolated():
    reached: collections.Counter = collections.Counter()

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(data=st.data(), geometry=st.sampled_from(sorted(GEOMETRIES)))
    def fuzz(data, geometry):
        _fuzzed_schedule(data, geometry, reached)

    fuzz()
    # the schedules must reach a step refused on a row after others took their blocks (the case a
    # host gives back part-done), not only on its first row; and transfers both ways of the
    # prediction (_shadow.migrate), and rejected drafts
    assert reached["short-later-row"] > 0, reached
    # (each > 0, not a count tuned to one draw: hypothesis' derandomized draws differ by its version,
    # and another machine's gave 2-4 refused migrations where this one gave 10)
    assert min(reached["migrated"], reached["migration refused"], reached["rewind"]) > 0, reached


def _fuzzed_schedule(data, geometry, reached):
    kv_mod, msa = _modules()
    world = KVWorld(kv_mod, msa, block_size=BLOCK, num_blocks=BLOCKS,
                    seed=data.draw(st.integers(0, 2 ** 16), label="seed"), **GEOMETRIES[geometry])
    next_rid = 0
    bump("fuzz.examples")
    for _ in range(data.draw(st.integers(6, 36), label="operations")):
        live = sorted(world.home)
        op = data.draw(st.sampled_from(["join", "verify", "verify", "mixed", "mixed", "finish", "migrate", "fault"]),
                       label="op")
        if op == "mixed":
            where = data.draw(st.integers(0, 1), label="cache")
            next_rid += 1
            bump("fuzz.requests", int(_mixed_step(world, data, where, next_rid - 1, reached)))
        elif op == "join" or not live:
            where = data.draw(st.integers(0, 1), label="cache")
            world.join(next_rid, where)
            prompt = data.draw(st.integers(1, 9), label="prompt")
            if not world.step(where, [(next_rid, prompt)]):
                world.finish(next_rid)
            next_rid += 1
            bump("fuzz.requests")
        elif op == "verify":
            where = world.home[data.draw(st.sampled_from(live), label="anchor")]
            rows = [r for r in live if world.home[r] == where]
            batch = data.draw(st.lists(st.sampled_from(rows), min_size=1, max_size=4, unique=True), label="batch")
            drafts = {rid: data.draw(st.integers(0, 3), label="draft_len") for rid in batch}
            before = {rid: world.shadow[rid].length for rid in batch}
            overshoot = {rid: data.draw(st.integers(0, 3), label="optimistic overshoot") for rid in batch}
            bump("fuzz.corrected_rows", sum(1 for x in overshoot.values() if x))
            if world.step(where, [(rid, 1 + drafts[rid]) for rid in batch], overshoot):
                for rid in batch:
                    accepted = data.draw(st.integers(0, drafts[rid]), label="accepted")
                    world.rewind(rid, before[rid] + 1 + accepted)
                    reached["rewind"] += accepted < drafts[rid]
                    bump("fuzz.rewinds", int(accepted < drafts[rid]))
        elif op == "finish":
            world.finish(data.draw(st.sampled_from(live), label="finish"))
        elif op == "migrate":
            moved = world.migrate(data.draw(st.sampled_from(live), label="migrate"))
            reached["migrated" if moved else "migration refused"] += 1
            bump("fuzz.migrations", int(moved))
        else:
            _fault(world, data, kv_mod)
        world.check()
        bump("fuzz.steps")
    for rid in sorted(world.home):
        world.finish(rid)
    world.check()
    for cache in world.caches:
        assert cache.num_free_blocks == cache.num_blocks, "blocks leaked after every request finished"


def test_import_into_a_different_geometry_is_refused_and_changes_nothing():
    kv_mod, msa = _modules()
    world = KVWorld(kv_mod, msa, block_size=BLOCK, num_blocks=BLOCKS, seed=1, **GEOMETRIES["mega-slot"])
    world.join(0, 0)
    assert world.step(0, [(0, 6)])
    payload = kv_mod.export_request(world.caches[0], 0)
    other = kv_mod.PagedKVCache.for_minimax_m3(2, [1], 2, 8, 8, BLOCK, 8, num_draft_layers=1, dtype=torch.float32)
    bump("faults.injected")
    with pytest.raises(ValueError, match="geometry"):
        kv_mod.import_request(other, 0, payload)
    assert other.num_free_blocks == other.num_blocks and 0 not in other.allocator


def test_truncated_payload_is_refused_and_changes_nothing():
    kv_mod, msa = _modules()
    world = KVWorld(kv_mod, msa, block_size=BLOCK, num_blocks=BLOCKS, seed=2, **GEOMETRIES["split-pools"])
    world.join(0, 0)
    assert world.step(0, [(0, 9)])  # 3 pages
    payload = kv_mod.export_request(world.caches[0], 0)
    cut = type(payload)(payload.fingerprint, payload.num_tokens, tuple(t[:-1] for t in payload.pool_pages))
    target = world.caches[1]
    bump("faults.injected")
    with pytest.raises(ValueError):
        kv_mod.import_request(target, 0, cut)
    assert target.num_free_blocks == target.num_blocks and 0 not in target.allocator


def test_payload_is_a_snapshot_not_a_view():
    """Writes after export (or after the source frees and reuses the pages) never reach the payload."""
    kv_mod, msa = _modules()
    world = KVWorld(kv_mod, msa, block_size=BLOCK, num_blocks=BLOCKS, seed=3, **GEOMETRIES["mega-slot"])
    world.join(0, 0)
    assert world.step(0, [(0, 7)])
    payload = kv_mod.export_request(world.caches[0], 0)
    world.finish(0)
    world.join(1, 0)  # reuses request 0's pages
    assert world.step(0, [(1, 8)])
    kv_mod.import_request(world.caches[1], 0, payload)
    world.home[0] = 1
    # request 0's expected values: a fresh world with the same seed writes the same numbers
    again = KVWorld(kv_mod, msa, block_size=BLOCK, num_blocks=BLOCKS, seed=3, **GEOMETRIES["mega-slot"])
    again.join(0, 0)
    assert again.step(0, [(0, 7)])
    world.shadow[0] = again.shadow[0]
    world.check()
