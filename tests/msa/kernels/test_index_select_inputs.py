"""The index scoring and top-k launchers refuse inputs their grids would misread (checked on the
host before any launch, so these run on any machine)."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from m3_eagle_plugin.msa.kernels import KernelInputError  # noqa: E402

from .kernel_case_helpers import SMALL, random_step  # noqa: E402


def _step():
    return random_step(SMALL, [4, 2], [70, 30], index_dtype=torch.float32, device="cpu")


def test_index_q_with_fewer_rows_than_the_metadata_is_refused():
    from m3_eagle_plugin.msa.kernels.index_select import index_block_scores

    meta, cache, _, index_q = _step()
    with pytest.raises(KernelInputError, match="index_q has 2 rows, fewer than the metadata's 6 tokens"):
        index_block_scores(index_q[:2], cache.index_k, meta)


def test_an_index_cache_of_another_block_size_is_refused():
    from m3_eagle_plugin.msa.kernels.index_select import index_block_scores

    meta, cache, _, index_q = _step()
    other = types.SimpleNamespace(**{f: getattr(meta, f) for f in ("block_tables", "kv_lens", "cu_qo_lens",
                                                                   "positions")}, block_size=2 * SMALL.block)
    with pytest.raises(KernelInputError, match=f"has {SMALL.block}-token pages but the metadata's block_size"):
        index_block_scores(index_q, cache.index_k, other)


def test_forced_blocks_past_topk_are_refused_as_the_reference_does():
    from m3_eagle_plugin.msa.kernels.index_select import topk_from_block_scores

    meta, _, _, _ = _step()
    scores = torch.zeros(1, 6, meta.block_tables.shape[1])
    with pytest.raises(KernelInputError, match="local_blocks 1 \\+ init_blocks 2 exceed topk 2"):
        topk_from_block_scores(scores, meta, topk=2, local_blocks=1, init_blocks=2)
