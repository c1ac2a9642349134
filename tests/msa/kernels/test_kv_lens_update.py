"""Fused on_update_kv_lens vs MsaDecodeMetadata's own torch derivation (the contract), graph-safe.

The reference metadata always lives on the CPU: there `on_update_kv_lens` runs the torch ops. On a
CUDA device with Triton the metadata's own `on_update_kv_lens` *is* the fused kernel, so a reference
kept on the GPU would compare the kernel with itself. The checks are device-agnostic: on CUDA they
run here; on CPU `tests._interpreter` runs them through Triton's interpreter in a subprocess
(`test_kernel_in_the_interpreter`), so CI executes the kernel's own code.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench.inputs import shuffled_block_tables
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import needs_gpu, seeded_draws

FIELDS = ("_kv_lens", "_qo_offsets", "_positions", "_token_kv_lens", "_valid_blocks", "_cache_slots")


def _pair(qo_lens, kv_lens, block=16, max_draft_len=4, seed=0, device="cuda"):
    """Two identically prepared metadata objects: the torch reference on the CPU, the kernel's on
    `device`."""
    from m3_eagle_plugin.msa import MsaDecodeMetadata

    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-kv // block) for kv in kv_lens) + 2
    tables = shuffled_block_tables(kv_lens, block, pages, gen)
    metas = []
    for where in ("cpu", device):
        m = MsaDecodeMetadata(len(qo_lens) + 2, sum(qo_lens) + 5, tables.shape[1] + 1, block, where,
                              max_draft_len=max_draft_len)
        m.prepare(qo_lens, kv_lens, tables)
        metas.append(m)
    assert metas[0]._fused_kv_lens_update() is None  # the reference runs the torch ops
    return metas


def _poison(meta):
    for name in FIELDS[2:]:
        getattr(meta, name).fill_(12345)


def _assert_same(torch_meta, fused_meta):
    if fused_meta.device.type == "cuda":
        torch.cuda.synchronize()
    for name in FIELDS:
        a, b = getattr(torch_meta, name), getattr(fused_meta, name).cpu()
        assert torch.equal(a, b), f"{name}: torch {a.tolist()} vs fused {b.tolist()}"


def _fused(meta, kv=None):
    from m3_eagle_plugin.msa.kernels.kv_lens_update import on_update_kv_lens_fused

    on_update_kv_lens_fused(meta, kv)


def _lens(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


#: Corrections of the step qo [4, 4, 1, 4] / staged kv [70, 40, 17, 5]: mixed (one above the staged
#: length, one below qo), all above staged, zero, negative, below qo, one rejection each.
CORRECTIONS = {
    "mixed": [67, 100, 16, 3],
    "above staged": [77, 47, 24, 12],
    "zero": [0, 0, 0, 0],
    "negative": [-5, -1, -7, -2],
    "below qo": [1, 0, 2, 1],
    "one rejection each": [69, 39, 16, 4],
}


def check_correction_matches_metadata(device, *, case):
    ref_meta, meta = _pair([4, 4, 1, 4], [70, 40, 17, 5], device=device)
    new = CORRECTIONS[case]
    ref_meta.on_update_kv_lens(_lens(new, "cpu"))
    _poison(meta)
    _fused(meta, _lens(new, device))
    _assert_same(ref_meta, meta)


def check_without_new_lengths_rederives_current(device):
    ref_meta, meta = _pair([2, 5], [33, 80], device=device)
    ref_meta.on_update_kv_lens()
    _poison(meta)
    _fused(meta)
    _assert_same(ref_meta, meta)


def check_matches_metadata_and_is_idempotent(device, reqs, seed):
    """`reqs`: (qo, extra kv, shrink) per request; the correction shrinks each staged length."""
    qo_lens = [q for q, _, _ in reqs]
    kv_lens = [q + extra + (1 if q == 0 and extra == 0 else 0) for q, extra, _ in reqs]
    ref_meta, meta = _pair(qo_lens, kv_lens, seed=seed, device=device)
    new = [max(kv - s, 0) for kv, (_, _, s) in zip(kv_lens, reqs)]
    ref_meta.on_update_kv_lens(_lens(new, "cpu"))
    _poison(meta)
    _fused(meta, _lens(new, device))
    _assert_same(ref_meta, meta)
    _fused(meta, meta.kv_lens.clone())
    _assert_same(ref_meta, meta)


def check_seeded_random_steps(device, *, seed, count=4):
    """`check_matches_metadata_and_is_idempotent` on `count` seeded random steps (the property
    test's shapes, for the interpreter, where hypothesis would cost too much)."""
    draw = seeded_draws(seed)
    for i in range(count):
        reqs = [(draw(0, 5), draw(0, 90), draw(0, 6)) for _ in range(draw(1, 6))]
        check_matches_metadata_and_is_idempotent(device, reqs, seed * 100 + i)


#: The interpreter's share (one small launch each).
INTERPRETER_CASES = [(check_correction_matches_metadata, dict(case=case)) for case in CORRECTIONS] + [
    (check_without_new_lengths_rederives_current, dict()),
    (check_seeded_random_steps, dict(seed=1)),
]


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_kv_lens_update")


@needs_gpu
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES)
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_gpu
def test_correction_matches_metadata_and_replays_in_graph():
    ref_meta, meta = _pair([4, 4, 1, 4], [70, 40, 17, 5])
    new = _lens([67, 100, 16, 3], "cuda")  # 100 > staged; 3 < qo_len
    ref_meta.on_update_kv_lens(new.cpu())
    _poison(meta)
    _fused(meta, new)
    _assert_same(ref_meta, meta)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fused(meta, new)
    new.copy_(torch.tensor([66, 38, 15, 4], dtype=torch.int32))
    ref_meta.on_update_kv_lens(new.cpu())
    _poison(meta)
    graph.replay()
    _assert_same(ref_meta, meta)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 90), st.integers(0, 6)), min_size=1, max_size=6),
    seed=st.integers(0, 100),
)
@needs_gpu
def test_property_matches_metadata_and_is_idempotent(reqs, seed):
    check_matches_metadata_and_is_idempotent("cuda", reqs, seed)


def test_a_strided_kv_lens_is_refused_before_anything_runs():
    """The kernel reads `kv_lens` densely; a strided view would be read as other requests' lengths."""
    from m3_eagle_plugin.msa import MsaDecodeMetadata
    from m3_eagle_plugin.msa.kernels import KernelInputError
    from m3_eagle_plugin.msa.kernels.kv_lens_update import on_update_kv_lens_fused

    meta = MsaDecodeMetadata(3, 12, 4, 32, "cpu", max_draft_len=3)
    meta.prepare([4, 4, 4], [38, 67, 19], torch.arange(12, dtype=torch.int32).view(3, 4))
    staged = meta.kv_lens.tolist()
    with pytest.raises(KernelInputError, match="kv_lens must be contiguous"):
        on_update_kv_lens_fused(meta, torch.tensor([38, 0, 67, 0, 19, 0])[::2])
    assert meta.kv_lens.tolist() == staged


@needs_gpu
def test_kv_lengths_near_int32_max_do_not_wrap():
    from .interpret_kv_lens import near_int32_max_mismatches

    assert near_int32_max_mismatches("cuda") == []
