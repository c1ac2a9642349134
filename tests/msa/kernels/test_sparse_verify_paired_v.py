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
from tests._interpreter import module_cases_lines, needs_interpreter

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
    lines = module_cases_lines("tests.msa.kernels.test_sparse_verify_paired_v")
    assert len(lines) == len(INTERPRETER_CASES), lines
