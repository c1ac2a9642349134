"""Fused cache write (`kv_write`) vs the torch writers `msa.write_kv` / `msa.write_index_k`.

The checks are device-agnostic: on CUDA they run here; on CPU `tests._interpreter` runs them
through Triton's interpreter in a subprocess (`test_kernel_in_the_interpreter`), so CI executes
the kernel's own code. The caches are strided views into one pool tensor (as the mega-slot
layout gives them), filled with random finite values: every byte outside the written slots
must stay as it was, and skipped tokens (slot -1) must write nothing.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import m3_eagle_plugin.msa as msa
from m3_eagle_plugin.msa.kernels import KernelInputError, write_step_kv
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import needs_gpu

FP8 = getattr(torch, "float8_e4m3fn", None)


def _pool_views(pages, hkv, block, dim, index_dim, dtype, device, gen):
    """K, V, index-K caches as views of one `[P, sub-pages, ...]` pool (non-contiguous pages)."""
    elems = hkv * block * dim
    pool = torch.randn(pages, 3 * elems + block * index_dim, generator=gen).to(device)
    k = pool[:, :elems].view(pages, hkv, block, dim)
    v = pool[:, elems:2 * elems].view(pages, hkv, block, dim)
    ik = pool[:, 3 * elems:].view(pages, block, index_dim)
    return [t.to(dtype) if dtype != torch.float32 else t for t in (k, v, ik)], pool


def check_write_matches_torch(device, *, dtype=torch.bfloat16, tokens=7, hkv=2, block=16, dim=32, index_dim=16,
                              pages=5, skip=(1, 4), with_index=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    (k_cache, v_cache, ik_cache), _ = _pool_views(pages, hkv, block, dim, index_dim, dtype, device, gen)
    slots = torch.randperm(pages * block, generator=gen)[:tokens]
    slots[list(s for s in skip if s < tokens)] = -1
    slots = slots.to(device)
    k = torch.randn(tokens, hkv, dim, generator=gen).to(device).to(dtype)
    v = torch.randn(tokens, hkv, dim, generator=gen).to(device).to(dtype)
    ik = torch.randn(tokens, index_dim, generator=gen).to(device).to(dtype)
    want = [t.clone() for t in (k_cache, v_cache, ik_cache)]
    msa.write_kv(want[0], want[1], slots, k, v)
    if with_index:
        msa.write_index_k(want[2], slots, ik)
    from m3_eagle_plugin.msa.kernels.kv_write import write_step_kv_fused

    write_step_kv_fused(k_cache, v_cache, slots, k, v, *((ik_cache, ik) if with_index else ()))
    for name, got, exp in zip(("k", "v", "index_k"), (k_cache, v_cache, ik_cache), want):
        assert torch.equal(got.view(torch.uint8) if dtype == FP8 else got,
                           exp.view(torch.uint8) if dtype == FP8 else exp), f"{name} cache differs"
    # independent of the torch writers: each kept token's rows sit at its slot
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block, :, slot % block].float(), k[t].float())


def check_all_skipped_writes_nothing(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    (k_cache, v_cache, ik_cache), _ = _pool_views(3, 1, 8, 16, 16, dtype, device, gen)
    before = [t.clone() for t in (k_cache, v_cache, ik_cache)]
    from m3_eagle_plugin.msa.kernels.kv_write import write_step_kv_fused

    k = torch.full((4, 1, 16), float("nan"), device=device, dtype=dtype)
    write_step_kv_fused(k_cache, v_cache, torch.full((4,), -1, device=device), k, k,
                        ik_cache, torch.full((4, 16), float("nan"), device=device, dtype=dtype))
    for got, exp in zip((k_cache, v_cache, ik_cache), before):
        assert torch.equal(got, exp)


def check_slots_past_the_cache_write_nothing(device, dtype=torch.float32):
    """Caches that are the first pages of a longer pool: a slot past them must not land in the
    pages beyond (it is skipped), while the valid tokens are written."""
    gen = torch.Generator().manual_seed(3)
    (k_all, v_all, ik_all), pool = _pool_views(5, 1, 8, 16, 16, dtype, device, gen)
    k_cache, v_cache, ik_cache = k_all[:3], v_all[:3], ik_all[:3]
    before = pool.clone()
    slots = torch.tensor([3 * 8, 2, 3 * 8 + 9, 23], device=device)
    k = torch.randn(4, 1, 16, generator=gen).to(device).to(dtype)
    v = torch.randn(4, 1, 16, generator=gen).to(device).to(dtype)
    ik = torch.randn(4, 16, generator=gen).to(device).to(dtype)
    from m3_eagle_plugin.msa.kernels.kv_write import write_step_kv_fused

    write_step_kv_fused(k_cache, v_cache, slots, k, v, ik_cache, ik)
    assert torch.equal(pool[3:], before[3:]), "a slot past the cache wrote beyond it"
    for t, slot in ((1, 2), (3, 23)):
        assert torch.equal(k_cache[slot // 8, 0, slot % 8], k[t, 0]) and torch.equal(ik_cache[slot // 8, slot % 8], ik[t])
    want = before[:3].clone()
    want_k, want_v, want_ik = (x[:3] for x in _pool_views_of(want))
    for t, slot in ((1, 2), (3, 23)):
        want_k[slot // 8, 0, slot % 8], want_v[slot // 8, 0, slot % 8], want_ik[slot // 8, slot % 8] = k[t, 0], v[t, 0], ik[t]
    assert torch.equal(pool[:3], want), "only the valid tokens' rows may change"


def _pool_views_of(pool, hkv=1, block=8, dim=16, index_dim=16):
    elems = hkv * block * dim
    pages = pool.shape[0]
    return (pool[:, :elems].view(pages, hkv, block, dim), pool[:, elems:2 * elems].view(pages, hkv, block, dim),
            pool[:, 3 * elems:].view(pages, block, index_dim))


#: The interpreter's share (few, small launches: CI has two cores).
INTERPRETER_CASES = [
    (check_write_matches_torch, dict(dtype=torch.float32)),
    (check_write_matches_torch, dict(dtype=torch.float16, hkv=1, dim=128, index_dim=128, block=128, tokens=4,
                                     skip=(0,))),
    (check_write_matches_torch, dict(dtype=torch.float32, with_index=False, dim=24, index_dim=24, skip=())),
    (check_all_skipped_writes_nothing, dict()),
    (check_slots_past_the_cache_write_nothing, dict()),
]


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_kv_write")


# ------------------------------------------------------------------------------------------ inputs

def _small(device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    (kc, vc, ikc), _ = _pool_views(2, 1, 8, 16, 16, dtype, device, gen)
    k = torch.zeros(3, 1, 16, dtype=dtype, device=device)
    return kc, vc, ikc, k, torch.zeros(3, dtype=torch.long, device=device)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.update(k=a["k"].to(torch.float16)), "cast first"),
    (lambda a: a.update(v=a["v"][:2]), "v must be"),
    (lambda a: a.update(slots=a["slots"].float()), "integer"),
    (lambda a: a.update(slots=torch.zeros(6, dtype=torch.long)[::2]), "slots must be contiguous"),
    (lambda a: a.update(index_k=None), "together"),
    (lambda a: a.update(index_k_cache=a["index_k_cache"][:, :4]), "block size"),
    (lambda a: a.update(v_cache=a["v_cache"][..., :8]), "shapes differ"),
])
def test_bad_inputs_name_the_cause(mutate, match):
    from m3_eagle_plugin.msa.kernels.kv_write import write_step_kv_fused

    kc, vc, ikc, k, slots = _small()
    args = dict(k_cache=kc, v_cache=vc, slots=slots, k=k, v=k.clone(), index_k_cache=ikc,
                index_k=torch.zeros(3, 16))
    mutate(args)
    with pytest.raises(KernelInputError, match=match):
        write_step_kv_fused(**args)


def test_dispatcher_uses_the_torch_writers_on_cpu():
    gen = torch.Generator().manual_seed(2)
    (kc, vc, ikc), _ = _pool_views(4, 2, 8, 16, 8, torch.float32, "cpu", gen)
    want = [t.clone() for t in (kc, vc, ikc)]
    slots = torch.tensor([3, -1, 17, 30])
    k, v, ik = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen), torch.randn(4, 8, generator=gen)
    write_step_kv(kc, vc, slots, k, v, ikc, ik)
    msa.write_kv(want[0], want[1], slots, k, v)
    msa.write_index_k(want[2], slots, ik)
    for got, exp in zip((kc, vc, ikc), want):
        assert torch.equal(got, exp)
    assert torch.equal(kc[2, :, 1], k[2]) and torch.equal(ikc[0, 3], ik[0])  # slot 17 = page 2, offset 1


# ------------------------------------------------------------------------------------------- CUDA

@needs_gpu
def test_slots_past_the_cache_write_nothing_on_the_gpu():
    check_slots_past_the_cache_write_nothing("cuda")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32] + ([FP8] if FP8 else []))
@pytest.mark.parametrize("dim, index_dim, hkv", [(128, 128, 1), (64, 32, 4), (24, 16, 2)])
def test_matches_torch_writers(dtype, dim, index_dim, hkv):
    check_write_matches_torch("cuda", dtype=dtype, dim=dim, index_dim=index_dim, hkv=hkv, tokens=33,
                              block=128 if dim == 128 else 16, pages=9, skip=(0, 5, 32))


@needs_gpu
def test_all_skipped_writes_nothing():
    check_all_skipped_writes_nothing("cuda")


@needs_gpu
@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 40), seed=st.integers(0, 10_000), skip_every=st.integers(2, 9))
def test_random_slot_patterns(tokens, seed, skip_every):
    check_write_matches_torch("cuda", tokens=tokens, seed=seed, pages=6, skip=tuple(range(0, tokens, skip_every)))


@needs_gpu
def test_replays_in_a_cuda_graph():
    from m3_eagle_plugin.msa.kernels.kv_write import write_step_kv_fused

    gen = torch.Generator().manual_seed(3)
    (kc, vc, ikc), _ = _pool_views(4, 1, 16, 32, 16, torch.bfloat16, "cuda", gen)
    slots = torch.tensor([5, -1, 40], device="cuda")
    k = torch.randn(3, 1, 32, device="cuda").to(torch.bfloat16)
    ik = torch.randn(3, 16, device="cuda").to(torch.bfloat16)
    write_step_kv_fused(kc, vc, slots, k, k, ikc, ik)  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_step_kv_fused(kc, vc, slots, k, k, ikc, ik)
    slots.copy_(torch.tensor([63, 0, -1]))
    k.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc[3, :, 15], k[0]) and torch.equal(vc[0, :, 0], k[1])
