"""Cache pages past 2**31 and 2**32 elements from the cache view's base: every kernel that
addresses a cache (index scoring with and without TMA, the top-k, the sparse verify step and
attention in both layouts, the dense attention, the merges, the fused cache write) must compute
those offsets in 64 bits.

Why: a production rank's pool is tens of GB (`[pages, sub-pages, page bytes]`, a K/V view's
page stride the whole mega-slot), so `page * stride_page` passes 2**31 elements from a few
thousand pages on. Triton multiplies in int32 unless one operand is int64 (page ids come from
int32 tables, strides below 2**31 are passed as int32); an int32 product wraps silently.

How: one uint8 pool `[P, 3, SUB]` (K, V, index-K sub-pages of each slot, as the mega-slot
layout interleaves them) of about 8.6 GB, every byte 0xFF (NaN in bf16, fp16 and e4m3) except
the pages a step uses, which hold random values. The pages sit in four bands of byte offsets:
below 2**31, [2**31, 2**32), [2**32, 2**33) and past 2**33, so the 1-byte (fp8) and the 2-byte
(bf16) views both have pages past 2**31 and past 2**32 elements. An offset that wraps reads a
poisoned byte (NaN output; past 2**32 it wraps back inside the pool) or faults; a wrapped write
lands outside the pages written, which must be the only bytes that change. The oracles are the
torch references (`bench.torch_reference`), which gather only the step's pages from the same big views.

The same construction runs small on CPU through Triton's interpreter (`INTERPRETER_CASES`: the
"bands" there sit at 2**18 bytes, so no offset is large; it checks the test's own logic). On a
GPU: an 8 GiB pool (two, one after the other: bf16 K/V and index-K; fp8 K/V beside a bf16
index-K, as in production), 10 GiB of free memory or the tests skip; about a minute with a cold
Triton cache (mostly compiling), the pool's fills and checks take milliseconds.

    M3_EAGLE_PLUGIN=off python -m pytest -q -p no:cacheprovider tests/msa/kernels/test_large_cache_offsets.py
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry
from m3_eagle_plugin.bench.step_meta import StepMeta, build_step_meta
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import assert_close_rel, assert_valid_selection, exact_block_scores

FP8 = getattr(torch, "float8_e4m3fn", None)

#: Per-rank M3-like geometry of the GPU case (two KV heads, so the KV-head offset is exercised too).
GPU_GEO = Geometry(q_heads=32, kv_heads=2, head_dim=128, index_heads=2, index_dim=128, block=128, topk=16)
#: The interpreter's (small pages; fp16, which its dot supports, instead of bf16).
CPU_GEO = Geometry(q_heads=16, kv_heads=2, head_dim=32, index_heads=2, index_dim=32, block=16, topk=4)

SUB_PAGES = 3           # K, V, index-K
POISON = 0xFF           # NaN in bf16, fp16 and e4m3
BANDS = 4               # below 2**bits, [2**bits, 2**(bits+1)), [2**(bits+1), 2**(bits+2)), past 2**(bits+2) bytes
WRITE_PAGES_PER_BAND = 2


@dataclass
class FarCase:
    storage: torch.Tensor          # uint8 [P, SUB_PAGES, sub]
    k: torch.Tensor                # [P, Hkv, B, D] views into `storage`
    v: torch.Tensor
    index_k: torch.Tensor          # [P, B, Di]
    k_scale: float
    v_scale: float
    meta: StepMeta
    q: torch.Tensor
    index_q: torch.Tensor
    geo: Geometry
    attention_pages: list[int]
    write_pages: list[int]
    max_qo_len: int
    bits: int                      # bands of byte offsets start at 2**bits (31 on the GPU)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.geo.head_dim)

    @property
    def live(self) -> int:
        return int(self.meta.cu_qo_lens[-1])

    @property
    def tol(self) -> float:
        return 2e-2

    @property
    def kernel_scales(self) -> dict:
        """The fp8 dequant scales as the kernels take them (None for 16-bit K/V)."""
        fp8 = self.k.element_size() == 1
        return dict(k_scale=self.k_scale if fp8 else None, v_scale=self.v_scale if fp8 else None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _view(storage: torch.Tensor, sub: int, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """`[P, *shape]` of `dtype` over sub-page `sub` of every slot (a strided view, page stride = the slot)."""
    return storage[:, sub, :nbytes].view(dtype).view(storage.shape[0], *shape)


def build_far_case(device, *, geo: Geometry = GPU_GEO, kv_dtype=torch.bfloat16, index_dtype=torch.bfloat16,
                   q_dtype=torch.bfloat16, bits: int = 31, qo_lens=(4, 4, 4, 4), kv_lens=(3000, 2100, 4100, 700),
                   pad_tokens: int = 2, seed: int = 0) -> FarCase:
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    kv_size = torch.empty((), dtype=kv_dtype).element_size()
    ik_size = torch.empty((), dtype=index_dtype).element_size()
    kv_bytes = geo.kv_heads * geo.block * geo.head_dim * kv_size
    ik_bytes = geo.block * geo.index_dim * ik_size
    sub = max(kv_bytes, ik_bytes)
    slot = SUB_PAGES * sub
    need = [-(-kv // geo.block) for kv in kv_lens]
    per_band = -(-sum(need) // BANDS)
    # First page of each band of byte offsets (band 0 starts at page 2, well below 2**bits).
    starts = [2] + [-(-(1 << (bits + i)) // slot) for i in range(3)]
    for lo, hi in zip(starts, starts[1:]):
        assert hi >= lo + per_band + WRITE_PAGES_PER_BAND, "bands overlap: raise bits"
    attention_pages = [s + i for s in starts for i in range(per_band)]
    write_pages = [s + per_band + i for s in starts[1:] for i in range(WRITE_PAGES_PER_BAND)]
    num_pages = starts[-1] + per_band + WRITE_PAGES_PER_BAND   # the pool's last page is written too

    storage = torch.empty((num_pages, SUB_PAGES, sub), dtype=torch.uint8, device=device)
    storage.fill_(POISON)
    k = _view(storage, 0, kv_bytes, kv_dtype, (geo.kv_heads, geo.block, geo.head_dim))
    v = _view(storage, 1, kv_bytes, kv_dtype, (geo.kv_heads, geo.block, geo.head_dim))
    index_k = _view(storage, 2, ik_bytes, index_dtype, (geo.block, geo.index_dim))
    fp8 = kv_size == 1
    k_scale, v_scale = (0.05, 0.04) if fp8 else (1.0, 1.0)
    for p in attention_pages + write_pages:  # page by page: nothing but these pages is written
        k[p].copy_((torch.randn(k.shape[1:], generator=gen) / (k_scale * 8 if fp8 else 1.0)).to(kv_dtype))
        v[p].copy_((torch.randn(v.shape[1:], generator=gen) / (v_scale * 8 if fp8 else 1.0)).to(kv_dtype))
        index_k[p].copy_(torch.randn(index_k.shape[1:], generator=gen).to(index_dtype))

    perm = [attention_pages[i] for i in torch.randperm(len(attention_pages), generator=gen).tolist()]
    width = max(need) + 1  # one -1 column past the longest request, as random_step leaves
    tables = torch.full((len(kv_lens), width), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    meta = build_step_meta(list(qo_lens), list(kv_lens), tables, geo.block, device=device, pad_tokens=pad_tokens)
    total = sum(qo_lens) + pad_tokens
    q = torch.randn(total, geo.q_heads, geo.head_dim, generator=gen).to(q_dtype).to(device)
    index_q = torch.randn(total, geo.index_heads, geo.index_dim, generator=gen).to(q_dtype).to(device)
    return FarCase(storage, k, v, index_k, k_scale, v_scale, meta, q, index_q, geo, attention_pages, write_pages,
                   max(qo_lens), bits)


def small_case(device, kv_dtype="float16", seed=0) -> FarCase:
    """The same construction at interpreter size: bands at 2**18 bytes, fp16 queries and index-K."""
    return build_far_case(device, geo=CPU_GEO, kv_dtype=getattr(torch, kv_dtype), index_dtype=torch.float16,
                          q_dtype=torch.float16, bits=18, qo_lens=(4, 1, 3, 4), kv_lens=(150, 40, 97, 230),
                          pad_tokens=2, seed=seed)


# ---- checks (device-agnostic: `case` given on the GPU, built small otherwise) --------------------------------

def check_construction(device, case: FarCase | None = None, kv_dtype="float16"):
    """The step's pages sit where intended: some past 2**bits and past 2**(bits+1) elements of every view;
    each view reads the bytes of its own sub-page; the oracles' gathers (advanced indexing on the big
    views) return the same pages as plain per-page indexing."""
    case = case or small_case(device, kv_dtype)
    used = case.meta.block_tables[case.meta.block_tables >= 0].long().cpu()
    bits = case.bits
    for name, view in (("k", case.k), ("v", case.v), ("index_k", case.index_k)):
        offsets = used * view.stride(0) + (view.data_ptr() - case.storage.data_ptr()) // view.element_size()
        mid = (offsets >= (1 << bits)) & (offsets < (1 << (bits + 1)))
        assert mid.any() and (offsets >= (1 << (bits + 1))).any(), (
            f"{name}: no page in [2**{bits}, 2**{bits + 1}) and past 2**{bits + 1} elements")
        idx = used[::max(1, used.numel() // 12)].to(view.device)  # pages of every band
        assert torch.equal(_bits(view[idx]), _bits(torch.stack([view[int(p)] for p in idx]))), name
    p = int(used[0])
    assert torch.equal(_bits(case.k[p]).flatten(), case.storage[p, 0, :case.k[p].numel() * case.k.element_size()])
    assert torch.equal(_bits(case.index_k[p]).flatten(),
                       case.storage[p, 2, :case.index_k[p].numel() * case.index_k.element_size()])


def check_block_scores(device, case: FarCase | None = None, kv_dtype="float16"):
    """Index scoring reads the far index-K pages, through the TMA descriptor (where `page_descriptor`
    gives one: SM90+ and the interpreter) and through per-thread copies."""
    from m3_eagle_plugin.msa.kernels.index_select import index_block_scores, page_descriptor

    case = case or small_case(device, kv_dtype)
    exact = exact_block_scores(case.index_q, case.index_k, case.meta)
    for tma in (None, False):
        if tma is None and device != "cpu" and torch.cuda.get_device_capability()[0] >= 9:
            assert page_descriptor(case.index_k) is not None, "the TMA path should apply here"
        scores = index_block_scores(case.index_q, case.index_k, case.meta, max_qo_len=case.max_qo_len, tma=tma)
        for t, want in enumerate(exact):
            got = scores[:, t, : want.shape[1]].double().cpu()
            assert torch.allclose(got, want, rtol=1e-3, atol=2e-2), (
                f"tma={tma} token {t}: max error {(got - want).abs().max().item():.3e}")


def check_verify_step(device, case: FarCase | None = None, kv_dtype="float16", early=True):
    """The whole sparse step (`verify_step`: scoring, top-k, attention launched early or not) against
    the exact scores and the reference attention on its own selection."""
    from m3_eagle_plugin.msa.kernels.verify_step import sparse_verify_step

    case = case or small_case(device, kv_dtype)
    sel, out = sparse_verify_step(case.index_q, case.index_k, case.q, case.k, case.v, case.meta, topk=case.geo.topk,
                                  scale=case.scale, max_qo_len=case.max_qo_len, early=early, **case.kernel_scales)
    live = case.live
    assert (sel[:, live:].cpu() == -1).all(), "graph-padding selection rows must be -1"
    assert_valid_selection(sel[:, :live], exact_block_scores(case.index_q, case.index_k, case.meta), case.geo.topk)
    expect = ref.sparse_attention(case.q, case.k, case.v, case.meta, sel, scale=case.scale, k_scale=case.k_scale,
                                  v_scale=case.v_scale)
    assert_close_rel(out[:live].float(), expect[:live].float(), case.tol)
    assert (out[live:] == 0).all(), "graph-padding rows must be zero"


#: Sparse attention variants: per-token layout (two-page tiles, self-merged splits; one-page tiles
#: without prefetch, merged by `merge_splits`), union layout (split and not).
SPARSE_VARIANTS = (dict(layout="token", pages_per_tile=2, splits=3), dict(layout="token", prefetch=False, splits=5),
                   dict(layout="union"), dict(layout="union", splits=1))


def check_sparse_layouts(device, case: FarCase | None = None, kv_dtype="float16"):
    from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

    case = case or small_case(device, kv_dtype)
    sel = ref.select_blocks(case.index_q, case.index_k, case.meta, topk=case.geo.topk)
    expect = ref.sparse_attention(case.q, case.k, case.v, case.meta, sel, scale=case.scale, k_scale=case.k_scale,
                                  v_scale=case.v_scale)
    live = case.live
    for kw in SPARSE_VARIANTS:
        if kw.get("pages_per_tile") == 2 and case.k.element_size() > 1:
            continue  # two-page tiles are for 1-byte K/V at this page size (MAX_TWO_PAGE_TILE_BYTES)
        out = sparse_verify_attention(case.q, case.k, case.v, case.meta, sel, scale=case.scale,
                                      max_qo_len=case.max_qo_len, **case.kernel_scales, **kw)
        assert_close_rel(out[:live].float(), expect[:live].float(), case.tol)
        assert (out[live:] == 0).all(), f"{kw}: graph-padding rows must be zero"


def check_dense(device, case: FarCase | None = None, kv_dtype="float16"):
    """Dense attention over every page of each request: one split, split-K with the merge, the default."""
    from m3_eagle_plugin.msa.kernels.dense_verify import dense_verify_attention

    case = case or small_case(device, kv_dtype)
    expect = ref.dense_attention(case.q, case.k, case.v, case.meta, scale=case.scale, k_scale=case.k_scale,
                                 v_scale=case.v_scale)
    live = case.live
    for splits in (1, 3, None):
        out = dense_verify_attention(case.q, case.k, case.v, case.meta, scale=case.scale, max_qo_len=case.max_qo_len,
                                     splits=splits, **case.kernel_scales)
        assert_close_rel(out[:live].float(), expect[:live].float(), case.tol)
        assert (out[live:] == 0).all(), f"splits={splits}: graph-padding rows must be zero"


def _write_rows(case: FarCase, seed: int):
    """(slots int32, K, V, index-K rows): two slots in every write page, one skipped token (-1), one
    past the cache (skipped too)."""
    gen = torch.Generator().manual_seed(seed)
    block, geo = case.geo.block, case.geo
    slots = []
    for i, p in enumerate(case.write_pages):
        slots += [p * block + (3 * i) % block, p * block + block - 1 - i % block]
    slots += [-1, case.k.shape[0] * block + 5]
    n = len(slots)
    k = torch.randn(n, geo.kv_heads, geo.head_dim, generator=gen).to(case.k.dtype).to(case.k.device)
    v = torch.randn(n, geo.kv_heads, geo.head_dim, generator=gen).to(case.v.dtype).to(case.v.device)
    ik = torch.randn(n, geo.index_dim, generator=gen).to(case.index_k.dtype).to(case.index_k.device)
    return torch.tensor(slots, dtype=torch.int32, device=case.k.device), k, v, ik


def assert_poisoned_except(storage: torch.Tensor, keep: list[int], chunk_bytes: int = 1 << 29) -> None:
    """Every page of `storage` not in `keep` still holds only POISON bytes."""
    num_pages = storage.shape[0]
    skip = torch.zeros(num_pages, dtype=torch.bool)
    skip[torch.tensor(keep, dtype=torch.long)] = True
    step = max(1, chunk_bytes // storage[0].numel())
    for a in range(0, num_pages, step):
        b = min(num_pages, a + step)
        changed = (storage[a:b] != POISON).flatten(1).any(1).cpu() & ~skip[a:b]
        assert not changed.any(), f"pages {(changed.nonzero().flatten() + a)[:8].tolist()} were written"


def check_write(device, case: FarCase | None = None, kv_dtype="float16", seed=1):
    """The fused cache write puts each kept token's rows at its slot in the far pages, and no other
    byte of the pool changes (a wrapped offset would write inside it, or fault)."""
    from m3_eagle_plugin.msa.kernels.kv_write import write_step_kv_fused

    case = case or small_case(device, kv_dtype)
    slots, k, v, ik = _write_rows(case, seed)
    pages = torch.tensor(case.write_pages, device=case.storage.device)
    mirror = case.storage[pages].clone()  # the write pages as they should end up
    mk = _view(mirror, 0, case.k[0].numel() * case.k.element_size(), case.k.dtype, tuple(case.k.shape[1:]))
    mv = _view(mirror, 1, case.v[0].numel() * case.v.element_size(), case.v.dtype, tuple(case.v.shape[1:]))
    mi = _view(mirror, 2, case.index_k[0].numel() * case.index_k.element_size(), case.index_k.dtype,
               tuple(case.index_k.shape[1:]))
    block = case.geo.block
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < case.k.shape[0] * block:
            i, off = case.write_pages.index(slot // block), slot % block
            mk[i, :, off] = k[t]
            mv[i, :, off] = v[t]
            mi[i, off] = ik[t]
    write_step_kv_fused(case.k, case.v, slots, k, v, case.index_k, ik)
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < case.k.shape[0] * block:
            page, off = slot // block, slot % block
            assert torch.equal(_bits(case.k[page, :, off]), _bits(k[t])), f"token {t}: K not at slot {slot}"
            assert torch.equal(_bits(case.v[page, :, off]), _bits(v[t])), f"token {t}: V not at slot {slot}"
            assert torch.equal(_bits(case.index_k[page, off]), _bits(ik[t])), f"token {t}: index-K not at slot {slot}"
    assert torch.equal(case.storage[pages], mirror), "bytes of the write pages other than the written rows changed"
    assert_poisoned_except(case.storage, case.attention_pages + case.write_pages)


#: The interpreter's share: the same checks on the small construction (fp16 and e4m3 K/V).
INTERPRETER_CASES = [
    (check_construction, dict()),
    (check_block_scores, dict()),
    (check_verify_step, dict()),
    (check_verify_step, dict(kv_dtype="float8_e4m3fn", early=False)),
    (check_sparse_layouts, dict(kv_dtype="float8_e4m3fn")),
    (check_dense, dict()),
    (check_write, dict(kv_dtype="float8_e4m3fn")),
]


# ---- GPU -----------------------------------------------------------------------------------------------------

#: (K/V dtype, index-K dtype): bf16 throughout, and production's fp8 K/V beside a bf16 index-K.
GPU_DTYPES = [("bfloat16", "bfloat16"), ("float8_e4m3fn", "bfloat16")]

#: Free GPU memory the GPU tests need: the pool (about 8.6 GB) plus headroom for everything else.
NEEDED_BYTES = 10 << 30


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from m3_eagle_plugin.msa.kernels import triton_available

    if not triton_available("cuda"):
        return "Triton kernels cannot run on this GPU"
    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # this process's cached blocks
    if free < NEEDED_BYTES:
        return f"needs {NEEDED_BYTES / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.1f} GiB free"
    return None


@pytest.fixture(scope="module", params=GPU_DTYPES, ids=lambda p: f"kv_{p[0]}-index_{p[1]}")
def far_case(request):
    why = _gpu_skip_reason()
    if why:
        pytest.skip(why)
    kv_dtype, index_dtype = (getattr(torch, name) for name in request.param)
    case = build_far_case("cuda", kv_dtype=kv_dtype, index_dtype=index_dtype, q_dtype=torch.bfloat16)
    yield case
    for name in ("storage", "k", "v", "index_k", "q", "index_q"):  # pytest keeps `case` a while: free the pool now
        setattr(case, name, None)
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("check,kw", [
    (check_construction, {}),
    (check_block_scores, {}),
    (check_verify_step, dict(early=True)),
    (check_verify_step, dict(early=False)),
    (check_sparse_layouts, {}),
    (check_dense, {}),
    (check_write, {}),  # last: it writes into the pool (its own pages only)
], ids=lambda x: getattr(x, "__name__", None) or ",".join(f"{k}={v}" for k, v in x.items()) or "defaults")
def test_far_pages_on_gpu(far_case, check, kw):
    check("cuda", case=far_case, **kw)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_dispatchers_on_far_pages(far_case, monkeypatch):
    """What the model calls (`kernels.*` dispatchers, Triton forced) on the same far pages."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", "triton")
    from m3_eagle_plugin.msa import kernels

    case = far_case
    live = case.live
    sel = kernels.select_blocks_paged(case.index_q, case.index_k, case.meta, topk=case.geo.topk,
                                      max_qo_len=case.max_qo_len)
    exact = exact_block_scores(case.index_q, case.index_k, case.meta)
    assert_valid_selection(sel[:, :live], exact, case.geo.topk)
    want_sel = ref.select_blocks(case.index_q, case.index_k, case.meta, topk=case.geo.topk)
    expect = ref.sparse_attention(case.q, case.k, case.v, case.meta, want_sel, scale=case.scale,
                                  k_scale=case.k_scale, v_scale=case.v_scale)
    out = kernels.sparse_layer_attention(case.q, case.k, case.v, case.index_q, case.index_k, case.meta,
                                         topk=case.geo.topk, scale=case.scale, max_qo_len=case.max_qo_len,
                                         **case.kernel_scales)
    assert_close_rel(out[:live].float(), expect[:live].float(), case.tol)
    out = kernels.sparse_attention(case.q, case.k, case.v, case.meta, want_sel, scale=case.scale,
                                   max_qo_len=case.max_qo_len, **case.kernel_scales)
    assert_close_rel(out[:live].float(), expect[:live].float(), case.tol)
    dense = kernels.dense_attention(case.q, case.k, case.v, case.meta, scale=case.scale, max_qo_len=case.max_qo_len,
                                    **case.kernel_scales)
    expect = ref.dense_attention(case.q, case.k, case.v, case.meta, scale=case.scale, k_scale=case.k_scale,
                                 v_scale=case.v_scale)
    assert_close_rel(dense[:live].float(), expect[:live].float(), case.tol)
    slots, k, v, ik = _write_rows(case, seed=7)
    kernels.write_step_kv(case.k, case.v, slots, k, v, case.index_k, ik)
    block = case.geo.block
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < case.k.shape[0] * block:
            assert torch.equal(_bits(case.k[slot // block, :, slot % block]), _bits(k[t])), f"token {t}"
            assert torch.equal(_bits(case.index_k[slot // block, slot % block]), _bits(ik[t])), f"token {t}"
    assert_poisoned_except(case.storage, case.attention_pages + case.write_pages)
    torch.cuda.synchronize()


@needs_interpreter
def test_small_construction_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_large_cache_offsets")
