"""`write_step_kv` takes the index-K cache and the index-K rows together on every path.

The fused writer refuses one without the other ("pass index_k_cache and index_k together"); the
dispatcher's CPU path (the torch writers) used to drop `index_k` silently when its cache was
missing (index-K left stale: later selections read old keys) and to fail with an AttributeError
after writing K/V when the rows were missing. Either way the call must be refused before anything
is written."""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.msa.kernels import KernelInputError, write_step_kv


def _inputs():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(3, 2, 8, 16, generator=gen), torch.randn(3, 2, 8, 16, generator=gen)
    index_k_cache = torch.randn(3, 8, 16, generator=gen)
    slots = torch.tensor([0, 9, 17])
    k, v = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    return k_cache, v_cache, index_k_cache, slots, k, v, torch.randn(3, 16, generator=gen)


@pytest.mark.parametrize("given", ["index_k only", "index_k_cache only"])
def test_half_an_index_write_is_refused_before_anything_is_written(monkeypatch, given):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")  # the torch writers, on any machine
    k_cache, v_cache, index_k_cache, slots, k, v, index_k = _inputs()
    before = [t.clone() for t in (k_cache, v_cache, index_k_cache)]
    extra = dict(index_k=index_k) if given == "index_k only" else dict(index_k_cache=index_k_cache)
    with pytest.raises(KernelInputError, match="together"):
        write_step_kv(k_cache, v_cache, slots, k, v, **extra)
    for got, want in zip((k_cache, v_cache, index_k_cache), before):
        assert torch.equal(got, want)


def test_both_or_neither_still_write(monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    k_cache, v_cache, index_k_cache, slots, k, v, index_k = _inputs()
    write_step_kv(k_cache, v_cache, slots, k, v)
    write_step_kv(k_cache, v_cache, slots, k, v, index_k_cache, index_k)
    for t, slot in enumerate(slots.tolist()):  # first principles: slot = page * 8 + offset
        page, off = divmod(slot, 8)
        assert torch.equal(k_cache[page, :, off], k[t]) and torch.equal(v_cache[page, :, off], v[t])
        assert torch.equal(index_k_cache[page, off], index_k[t])


@pytest.mark.parametrize("bad,match", [
    ("index_k rows", r"slots must be \[T=2\]"),        # 2 index-K rows for 3 slots
    ("index_k dim", r"index_k must be \[T, Di=16\]"),
    ("index cache pages", "slot 17 is past the cache's 16 slots"),  # fits K/V (3 pages), not index-K (2 pages)
    ("index block size", "index-K block size 4 differs from the K/V block size 8"),  # slot 17: page 2 or page 4?
])
def test_a_bad_index_k_is_refused_before_k_and_v_are_written(monkeypatch, bad, match):
    """All or nothing, as `msa.cache_write` and the fused writer: the torch path used to write K/V,
    then refuse the index-K."""
    from m3_eagle_plugin.msa.blocks import MsaInputError

    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    k_cache, v_cache, index_k_cache, slots, k, v, index_k = _inputs()
    if bad == "index_k rows":
        index_k = index_k[:2]
    elif bad == "index_k dim":
        index_k = torch.ones(3, 8)
    elif bad == "index cache pages":
        index_k_cache = index_k_cache[:2]
        slots = torch.tensor([0, 9, 17])  # page 2 exists in K/V only
    else:
        index_k_cache = torch.randn(6, 4, 16)  # as many slots, pages of 4
    before = [t.clone() for t in (k_cache, v_cache, index_k_cache)]
    with pytest.raises(MsaInputError, match=match):
        write_step_kv(k_cache, v_cache, slots, k, v, index_k_cache, index_k)
    for got, want in zip((k_cache, v_cache, index_k_cache), before):
        assert torch.equal(got, want)
