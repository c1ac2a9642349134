"""The dispatching MSA kernels (`m3_eagle_plugin.msa.kernels`: Triton on CUDA, the torch references
elsewhere) under hostile metadata, on a NaN-poisoned pool, against the torch references.

Hostile here means what only the device sees: kv corrections above the staged lengths, below qo
or negative (applied by the fused `on_update_kv_lens`), an unmapped (-1) page inside a request's
range in a device-resident block table, and a selection naming blocks a token cannot see. The
kernel must never write or read a slot it does not own, and must agree with the reference.
Shapes respect the kernels' tiling (block and head dim >= 16, powers of two).
"""
from __future__ import annotations

import importlib

import pytest
import torch

from ._counts import bump
from ._poison import PoisonedPool, blocks_for, distinct_block_tables

B, HKV, HQ, D, DI, TOPK = 16, 2, 16, 32, 32, 2
MAX_REQ, MAX_TOK, MAX_BLOCKS, PAGES = 4, 32, 5, 24
DEVICES = [
    pytest.param("cpu", id="dispatch-cpu"),
    pytest.param("cuda", id="triton-cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


def _mods(device: str):
    """(torch references, the kernel dispatcher module)."""
    msa = importlib.import_module("m3_eagle_plugin.msa")
    backend = importlib.import_module("m3_eagle_plugin.msa.kernels.backend")
    if device == "cuda" and not backend.use_triton("cuda"):
        pytest.skip("Triton kernels cannot run on this CUDA device")
    return msa, backend


class _Step:
    """One step's inputs on `device`, a poisoned pool, and both implementations run on copies."""

    def __init__(self, msa, kernels, device: str, qo, kv, *, seed: int, table: torch.Tensor | None = None,
                 nan_tails: bool = False, own: bool = True):
        self.msa, self.kernels, self.device = msa, kernels, device
        self.qo, self.kv = qo, kv
        self.table = table if table is not None else distinct_block_tables(
            [blocks_for(k, B) for k in kv], MAX_BLOCKS, PAGES, seed)
        self.pool = PoisonedPool(PAGES, HKV, B, D, DI, seed=seed)
        for r, (q, k) in enumerate(zip(qo, kv) if own else ()):
            self.pool.own_request(self.table[r].tolist(), k, k - q)
        if own and not nan_tails:
            self.pool.mark_tails(1.0e4)
        g = torch.Generator().manual_seed(seed)
        t = sum(qo)
        self.k, self.v = torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
        self.ik, self.iq = torch.randn(t, DI, generator=g), torch.randn(t, HKV, DI, generator=g)
        self.q = torch.randn(t, HQ, D, generator=g)

    def meta(self, table_on_device: bool = False, device: str | None = None):
        device = device or self.device
        meta = self.msa.MsaDecodeMetadata(MAX_REQ, MAX_TOK, MAX_BLOCKS, B, device, max_draft_len=3,
                                          num_index_heads=HKV)
        table = self.table.to(device) if table_on_device else self.table
        meta.prepare(self.qo, self.kv, table)
        return meta

    def run(self, impl, meta, selection=None):
        """Write K/V/index-K, select, attend with `impl` on a fresh copy of the pool (on the device)."""
        dev = self.device
        k_cache, v_cache, ik_cache = (x.clone().to(dev) for x in (self.pool.k, self.pool.v, self.pool.index_k))
        slots = meta.cache_slots
        self.msa.write_kv(k_cache, v_cache, slots, self.k.to(dev), self.v.to(dev))
        self.msa.write_index_k(ik_cache, slots, self.ik.to(dev))
        if selection is None:
            selection = impl.select_blocks_paged(self.iq.to(dev), ik_cache, meta, topk=TOPK)
        selection = selection.to(dev).to(torch.int32).contiguous()
        sparse = impl.sparse_attention(self.q.to(dev), k_cache, v_cache, meta, selection, scale=D ** -0.5)
        dense = impl.dense_attention(self.q.to(dev), k_cache, v_cache, meta, scale=D ** -0.5)
        written = PoisonedPool(PAGES, HKV, B, D, DI)
        written.k, written.v, written.index_k = k_cache.cpu(), v_cache.cpu(), ik_cache.cpu()
        written.owned, written.sentinel = self.pool.owned, self.pool.sentinel
        written.sentinel_value = self.pool.sentinel_value
        return {"selection": selection.cpu(), "sparse": sparse.cpu(), "dense": dense.cpu(), "pool": written}


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m: f"{what}: kernel != reference\n{m}")


def _ints(t) -> list[int]:
    return [int(x) for x in torch.as_tensor(t).cpu().flatten().tolist()]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_step_matches_reference_and_stays_in_bounds(device):
    msa, kernels = _mods(device)
    step = _Step(msa, kernels, device, qo=[4, 1, 16, 3], kv=[20, 35, 16, 50], seed=1)
    meta = step.meta()
    ref, ker = step.run(msa, meta), step.run(kernels, meta)
    ker["pool"].assert_unowned_untouched()
    ker["pool"].assert_owned_finite()
    for name in ("sparse", "dense"):
        assert torch.isfinite(ker[name]).all(), f"kernel {name} attention read a poisoned slot"
        _same(ker[name], ref[name], name)
    for t in range(sum(step.qo)):
        for h in range(HKV):
            assert set(_ints(ker["selection"][h, t])) == set(_ints(ref["selection"][h, t])), (t, h)


CORRECTIONS = {
    "above staged": lambda kv: [k + 7 for k in kv],
    "zero": lambda kv: [0 for _ in kv],
    "negative": lambda kv: [-5 for _ in kv],
    "below qo": lambda kv: [1, 0, 2, 1],
    "one rejection each": lambda kv: [k - 1 for k in kv],
}


@pytest.mark.parametrize("case", sorted(CORRECTIONS))
@pytest.mark.parametrize("device", DEVICES)
def test_fused_correction_matches_the_metadata_and_stays_in_bounds(device, case):
    msa, kernels = _mods(device)
    step = _Step(msa, kernels, device, qo=[4, 4, 1, 4], kv=[20, 33, 16, 50], seed=2)
    corrected = torch.tensor(CORRECTIONS[case](step.kv), dtype=torch.int32)
    fused, host = step.meta(), step.meta(device="cpu")  # on CUDA the metadata itself runs the fused kernel
    bump("faults.injected")
    kernels.on_update_kv_lens(fused, corrected.to(device))
    host.on_update_kv_lens(corrected)  # the torch derivation, independent of the kernel
    for name in ("cache_slots", "valid_blocks", "token_kv_lens", "positions", "kv_lens"):
        assert _ints(getattr(fused, name)) == _ints(getattr(host, name)), f"{case}: {name} differs"
    live = [t for t, p in enumerate(_ints(fused.positions)) if p >= 0]
    ref, ker = step.run(msa, fused), step.run(kernels, fused)
    ker["pool"].assert_unowned_untouched()
    for name in ("sparse", "dense"):
        assert torch.isfinite(ker[name][live]).all(), f"{case}: kernel {name} read a poisoned slot"
        _same(ker[name][live], ref[name][live], f"{case} {name}")


@pytest.mark.parametrize("device", DEVICES[1:])  # CPU tables never get here: prepare() refuses them (test_hostile_metadata)
def test_unmapped_page_in_a_device_table_is_never_read(device):
    """A device-resident table is not checked on the host: a -1 page inside kv must read as unmapped."""
    msa, kernels = _mods(device)
    table = torch.full((2, MAX_BLOCKS), -1, dtype=torch.int32)
    table[0, :3] = torch.tensor([3, -1, 5])  # request 0: block 1 (positions 16..31) unmapped
    table[1, :2] = torch.tensor([7, 8])
    step = _Step(msa, kernels, device, qo=[2, 3], kv=[40, 20], seed=3, table=table, own=False)
    step.pool.own(3, range(B))
    step.pool.own(5, range(40 - 32))
    step.pool.own(7, range(B))
    step.pool.own(8, range(20 - 16))
    step.pool.mark_tails(1.0e4)
    meta = step.meta(table_on_device=True)
    bump("faults.injected")
    ref = step.run(msa, meta)
    ker = step.run(kernels, meta, selection=ref["selection"])  # the same blocks, so outputs compare
    ker["pool"].assert_unowned_untouched()
    for name in ("sparse", "dense"):
        assert torch.isfinite(ref[name]).all(), f"reference {name} read through a -1 page"
        assert torch.isfinite(ker[name]).all(), f"kernel {name} read through a -1 page"
        _same(ker[name], ref[name], name)


@pytest.mark.parametrize("device", DEVICES)
def test_selection_of_blocks_a_token_cannot_see_is_ignored(device):
    msa, kernels = _mods(device)
    step = _Step(msa, kernels, device, qo=[3], kv=[35], seed=4)  # positions 32..34, blocks 0..2 mapped
    meta = step.meta()
    honest = torch.tensor([[[0, 2, -1], [1, 2, -1], [0, 2, -1]]] * HKV, dtype=torch.int32)
    hostile = honest.clone()
    hostile[:, :, 2] = 3  # block 3 (positions 48..63) is unmapped and in every token's future
    bump("faults.injected")
    a, b = step.run(kernels, meta, honest), step.run(kernels, meta, hostile)
    assert torch.isfinite(b["sparse"]).all(), "a poisoned slot leaked into the kernel's attention"
    _same(b["sparse"], a["sparse"], "hostile selection")


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_the_unwritten_tail_of_a_page_never_reaches_the_output(device):
    """Tail slots hold stale data in a real cache (NaN after torch.empty, or an fp8 NaN pattern)."""
    msa, kernels = _mods(device)
    step = _Step(msa, kernels, device, qo=[4, 1, 16, 3], kv=[20, 35, 16, 50], seed=1, nan_tails=True)
    ker = step.run(kernels, step.meta())
    bump("faults.injected")
    for name in ("sparse", "dense"):
        bad = (~torch.isfinite(ker[name])).flatten(1).any(1).nonzero().flatten().tolist()
        assert not bad, f"{name}: NaN from an unwritten tail slot reached tokens {bad}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_package_dispatchers_stay_functions_after_use():
    msa, backend = _mods("cuda")
    kernels = importlib.import_module("m3_eagle_plugin.msa.kernels")
    step = _Step(msa, backend, "cuda", qo=[2], kv=[20], seed=5)
    meta = step.meta()
    step.run(kernels, meta)  # first use through the package
    for name in ("select_blocks_paged", "sparse_attention", "dense_attention", "on_update_kv_lens"):
        assert callable(getattr(kernels, name)), f"m3_eagle_plugin.msa.kernels.{name} is now {getattr(kernels, name)!r}"
