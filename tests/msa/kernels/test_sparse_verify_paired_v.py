"""The sparse attention's paired-V read (`paired_v`: e4m3 V as 16-bit pairs of head dims, split
into even and odd dims and interleaved back) vs the torch reference, on hostile e4m3 caches.

Device-agnostic: on CUDA the checks run here (the inline-PTX convert); on CPU
`tests._interpreter` runs them through Triton's interpreter in a subprocess (the portable
convert), so CI executes the kernel's own indexing and interleave.
"""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import assert_close_rel, random_step

E4M3 = getattr(torch, "float8_e4m3fn", None)
GEO = Geometry(q_heads=16, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=4)
E4M3_NAN = 0x7F


def _hostile_step(device, qo_lens, kv_lens, seed):
    """A step on e4m3 K/V whose unwritten tail slots hold the e4m3 NaN pattern; each token selects
    its local block, random earlier blocks and one block past its request (an unmapped page)."""
    meta, cache, q, _ = random_step(GEO, qo_lens, kv_lens, kv_dtype=E4M3, seed=seed, spare_pages=2, device=device)
    tables = meta.block_tables.cpu()
    clean = [cache.k.clone(), cache.v.clone()]
    for r, kv in enumerate(kv_lens):
        page, used = int(tables[r, (kv - 1) // GEO.block]), (kv - 1) % GEO.block + 1
        for poisoned in (cache.k, cache.v):
            poisoned.view(torch.uint8)[page, :, used:] = E4M3_NAN
        for c in clean:
            c[page, :, used:] = 0
    gen = torch.Generator().manual_seed(seed)
    sel = torch.full((GEO.kv_heads, len(meta.positions), GEO.topk), -1, dtype=torch.int32)
    for t, pos in enumerate(meta.positions.tolist()):
        local = pos // GEO.block
        earlier = torch.randperm(local, generator=gen)[: GEO.topk - 2].tolist() if local else []
        beyond = [tables.shape[1] - 1]  # random_step leaves the tables' last entry -1 in every row
        ids = sorted(set(earlier + [local] + beyond))
        sel[:, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return meta, cache, clean, q, sel.to(device)


def check_paired_v_matches_reference(device, *, layout="token", splits=1, qo_lens=(4, 1, 3), kv_lens=(70, 9, 40),
                                     seed=0):
    from m3_eagle_plugin.msa.kernels.sparse_verify import paired_v_applies, sparse_verify_attention

    meta, cache, clean, q, sel = _hostile_step(device, list(qo_lens), list(kv_lens), seed)
    assert paired_v_applies(cache.v, True), "the bench cache layout should take the paired-V read"
    kw = dict(scale=GEO.head_dim ** -0.5, k_scale=cache.k_scale, v_scale=cache.v_scale)
    out = sparse_verify_attention(q, cache.k, cache.v, meta, sel, max_qo_len=max(qo_lens), layout=layout,
                                  splits=splits, paired_v=True, **kw)
    assert torch.isfinite(out).all(), "an e4m3 NaN tail or an unmapped page reached the output"
    expect = ref.sparse_attention(q, clean[0], clean[1], meta, sel, **kw)
    assert_close_rel(out, expect, 2e-2)
    plain = sparse_verify_attention(q, cache.k, cache.v, meta, sel, max_qo_len=max(qo_lens), layout=layout,
                                    splits=splits, paired_v=False, **kw)
    assert_close_rel(out, plain, 2e-3)  # the same MMAs up to the order of V's columns


def check_paired_v_refuses_odd_layouts(device):
    """An odd byte offset or a non-e4m3 V cannot be read in pairs: refused when asked for, and the
    default falls back to the byte read (still right)."""
    from m3_eagle_plugin.msa.kernels import KernelInputError
    from m3_eagle_plugin.msa.kernels.sparse_verify import paired_v_applies, sparse_verify_attention

    meta, cache, clean, q, sel = _hostile_step(device, [2], [20], 1)
    buf = torch.empty(cache.v.numel() + 1, dtype=torch.uint8, device=device)
    buf[1:] = cache.v.contiguous().view(torch.uint8).flatten()
    odd = buf[1:].view(E4M3).view(cache.v.shape)
    assert not paired_v_applies(odd, True) and not paired_v_applies(cache.v, False)
    assert not paired_v_applies(cache.v.to(torch.float8_e5m2), True)
    with pytest.raises(KernelInputError, match="paired_v"):
        sparse_verify_attention(q, cache.k, odd, meta, sel, scale=0.2, paired_v=True)
    out = sparse_verify_attention(q, cache.k, odd, meta, sel, scale=0.2)
    assert_close_rel(out, ref.sparse_attention(q, clean[0], clean[1], meta, sel, scale=0.2), 2e-2)


#: The interpreter's share (small launches: CI has two cores).
INTERPRETER_CASES = [
    (check_paired_v_matches_reference, dict(layout="token", splits=1)),
    (check_paired_v_matches_reference, dict(layout="token", splits=2, seed=1)),
    (check_paired_v_matches_reference, dict(layout="union", splits=1, seed=2)),
    (check_paired_v_refuses_odd_layouts, dict()),
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES + [
    (check_paired_v_matches_reference, dict(layout="token", splits=3, qo_lens=(4, 4, 4, 4),
                                            kv_lens=(300, 17, 129, 64), seed=3)),
    (check_paired_v_matches_reference, dict(layout="union", splits=2, qo_lens=(4, 2), kv_lens=(500, 33), seed=4)),
])
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_interpreter
@pytest.mark.skipif(E4M3 is None, reason="torch lacks float8_e4m3fn")
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_sparse_verify_paired_v")


def _tall_step(device, *, group, dim, block, qo_len, seed=5):
    """e4m3 K/V, 6 requests of `qo_len` tokens, 16 selected blocks each: a GQA group of 64 or a
    verify chunk x group of 64 makes a 64-row tile."""
    geo = Geometry(q_heads=2 * group, kv_heads=2, head_dim=dim, index_heads=2, index_dim=32, block=block, topk=16)
    kv_lens = [qo_len + 37 * block // 16 * i + 5 for i in range(6)]
    meta, cache, q, _ = random_step(geo, [qo_len] * 6, kv_lens, kv_dtype=E4M3, q_dtype=torch.float16, seed=seed,
                                    device=device)
    gen = torch.Generator().manual_seed(seed)
    sel = torch.full((2, len(meta.positions), 16), -1, dtype=torch.int32)
    for t, pos in enumerate(meta.positions.tolist()):
        for h in range(2):
            local = pos // block
            ids = sorted(set(torch.randperm(local, generator=gen)[:15].tolist() + [local]))
            sel[h, t, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return meta, cache, q, sel.to(device), dict(scale=dim ** -0.5, k_scale=cache.k_scale, v_scale=cache.v_scale)


def check_tall_narrow_tile_reads_v_as_bytes(device, *, layout, group, dim, block, qo_len=1, launch=True):
    """A 64-row tile of 64 keys or more below head dim 128 (where Triton 3.6's warp-group MMA
    miscomputes the paired read on sm_90) reads V as bytes by default and matches the reference;
    asking for the paired read there is refused by name, before any launch."""
    from m3_eagle_plugin.msa.kernels import KernelInputError
    from m3_eagle_plugin.msa.kernels.sparse_verify import paired_v_tile_ok, sparse_verify_attention

    meta, cache, q, sel, kw = _tall_step(device, group=group, dim=dim, block=block, qo_len=qo_len)
    assert not paired_v_tile_ok(64, dim, block)
    with pytest.raises(KernelInputError, match=f"paired_v: a tile of 64 query rows x {block} keys at head dim {dim}"):
        sparse_verify_attention(q, cache.k, cache.v, meta, sel, layout=layout, max_qo_len=qo_len, paired_v=True, **kw)
    if launch:
        out = sparse_verify_attention(q, cache.k, cache.v, meta, sel, layout=layout, max_qo_len=qo_len, **kw)
        assert_close_rel(out, ref.sparse_attention(q, cache.k, cache.v, meta, sel, **kw), 2e-2)


def test_paired_v_tile_rule():
    from m3_eagle_plugin.msa.kernels.sparse_verify import paired_v_tile_ok

    assert paired_v_tile_ok(16, 64, 128) and paired_v_tile_ok(32, 32, 64) and paired_v_tile_ok(64, 128, 128)
    assert paired_v_tile_ok(64, 64, 32) and paired_v_tile_ok(64, 32, 16)   # narrow key tiles: measured right
    assert not paired_v_tile_ok(64, 64, 64) and not paired_v_tile_ok(64, 32, 128)


@pytest.mark.skipif(E4M3 is None, reason="torch lacks float8_e4m3fn")
@pytest.mark.parametrize("layout,group,qo_len", [("token", 64, 1), ("union", 16, 4)])
def test_tall_narrow_tile_refuses_the_paired_read_on_any_device(layout, group, qo_len):
    check_tall_narrow_tile_reads_v_as_bytes("cpu", layout=layout, group=group, dim=64, block=64, qo_len=qo_len,
                                            launch=False)


@needs_cuda
@pytest.mark.parametrize("kw", [
    dict(layout="token", group=64, dim=64, block=64),      # wrong by 1.2 (relative) before: the fuzz case's tile
    dict(layout="token", group=64, dim=32, block=64),
    dict(layout="token", group=64, dim=64, block=128),     # an illegal address before
    dict(layout="union", group=16, dim=64, block=64, qo_len=4),
])
def test_tall_narrow_tile_on_gpu(kw):
    check_tall_narrow_tile_reads_v_as_bytes("cuda", **kw)


@needs_cuda
def test_tall_wide_tile_keeps_the_paired_read_on_gpu():
    """Head dim 128 at 64 rows (measured right), where the rule keeps the paired read: asked for
    and by default, it matches the reference."""
    from m3_eagle_plugin.msa.kernels.sparse_verify import paired_v_tile_ok, sparse_verify_attention

    assert paired_v_tile_ok(64, 128, 64)
    meta, cache, q, sel, kw = _tall_step("cuda", group=64, dim=128, block=64, qo_len=1)
    expect = ref.sparse_attention(q, cache.k, cache.v, meta, sel, **kw)
    for paired in (None, True):
        out = sparse_verify_attention(q, cache.k, cache.v, meta, sel, layout="token", max_qo_len=1, paired_v=paired,
                                      **kw)
        assert_close_rel(out, expect, 2e-2)
