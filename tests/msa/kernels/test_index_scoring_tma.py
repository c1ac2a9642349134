"""Index scoring with pages loaded whole through a TMA tensor descriptor (`page_descriptor`) vs
the exact float64 block maxima, and its fallback to per-thread copies where TMA cannot apply.

Device-agnostic: on a CUDA GPU the checks run here; on CPU `tests._interpreter` runs them through
Triton's interpreter (which emulates tensor descriptors), so CI executes the kernel's TMA path.
"""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.bench.inputs import Geometry
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import exact_block_scores, random_step

GEO = Geometry(q_heads=16, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=4)


def _step(device, qo_lens, kv_lens, seed):
    # fp16, not the production bf16: Triton's interpreter has no bf16 dot (it multiplies the raw bits).
    meta, cache, _, index_q = random_step(GEO, qo_lens, kv_lens, kv_dtype=torch.float16, index_dtype=torch.float16,
                                          seed=seed, device=device)
    return meta, cache.index_k, index_q


def _assert_exact(scores, index_q, index_k, meta):
    for t, want in enumerate(exact_block_scores(index_q, index_k, meta)):
        got = scores[:, t, : want.shape[1]].double().cpu()
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-3), f"token {t}: {got} vs {want}"


def check_tma_scores_match_exact_maxima(device, *, blocks_per_program=None, num_stages=None,
                                        qo_lens=(4, 1, 3), kv_lens=(150, 16, 97), seed=0, max_qo_len=None):
    """Uneven requests (a run of pages ends inside a request, a partial last page) over 1-3 pages
    a program. `max_qo_len` (default: the longest request) is only a hint: one below a request's
    tokens must not lose any."""
    from m3_eagle_plugin.msa.kernels.index_select import index_block_scores, page_descriptor

    meta, index_k, index_q = _step(device, list(qo_lens), list(kv_lens), seed)
    assert page_descriptor(index_k) is not None, "the bench's index-K layout should take the TMA path"
    scores = index_block_scores(index_q, index_k, meta, max_qo_len=max_qo_len or max(qo_lens), tma=True,
                                blocks_per_program=blocks_per_program, num_stages=num_stages)
    _assert_exact(scores, index_q, index_k, meta)


def check_unaligned_cache_falls_back(device):
    """A cache whose pages are not 16-byte aligned (or fp32) gets no descriptor: `tma=True` is
    refused with the reason, the default takes per-thread copies and stays exact."""
    from m3_eagle_plugin.msa.kernels import KernelInputError
    from m3_eagle_plugin.msa.kernels.index_select import index_block_scores, page_descriptor

    meta, index_k, index_q = _step(device, [2, 1], [40, 20], 1)
    pages, block, dim = index_k.shape
    buf = torch.empty(pages * block * dim + 1, dtype=index_k.dtype, device=device)
    buf[1:] = index_k.contiguous().flatten()
    odd = buf[1:].view(pages, block, dim)
    assert page_descriptor(odd) is None and page_descriptor(index_k.float()) is None
    wide = torch.zeros(2, GEO.block, 256, dtype=index_k.dtype, device=device)  # 512-byte rows: past one box
    assert page_descriptor(wide) is None and page_descriptor(wide[:, :, :128]) is not None
    with pytest.raises(KernelInputError, match="tma"):
        index_block_scores(index_q, odd, meta, tma=True)
    _assert_exact(index_block_scores(index_q, odd, meta), index_q, odd, meta)


#: The interpreter's share (small launches: CI has two cores).
INTERPRETER_CASES = [
    (check_tma_scores_match_exact_maxima, dict()),
    (check_tma_scores_match_exact_maxima, dict(blocks_per_program=3, num_stages=2, seed=1)),
    # a request's tokens past one 16-token tile, at one page a program: the general program, then the
    # one-tile program (decode / verify) under a hint that understates them
    (check_tma_scores_match_exact_maxima, dict(qo_lens=(20, 1, 35), kv_lens=(150, 16, 97), seed=3)),
    (check_tma_scores_match_exact_maxima, dict(qo_lens=(20, 1, 35), kv_lens=(150, 16, 97), seed=4, max_qo_len=4)),
    (check_unaligned_cache_falls_back, dict()),
]


def _has_tma() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not _has_tma(), reason="needs a CUDA GPU with TMA (SM90+)")
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES + [
    (check_tma_scores_match_exact_maxima, dict(blocks_per_program=2, num_stages=3, qo_lens=(4, 4, 4, 1),
                                               kv_lens=(900, 33, 400, 128), seed=2)),
])
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_index_scoring_tma")
