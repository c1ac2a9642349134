"""Head counts the kernels cannot tile (a GQA group or index-head count that is not a power of two):
the kernels refuse them by name before launching, and the dispatchers keep them on the torch
references (checked against the naive `bench.torch_reference`). Runs on CPU: nothing launches."""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry
from m3_eagle_plugin.msa import MsaDecodeMetadata
from m3_eagle_plugin.msa.kernels import KernelInputError, backend
from m3_eagle_plugin.msa.kernels.dense_verify import dense_verify_attention
from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify
from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

from .kernel_case_helpers import assert_close_rel, random_step

# GQA group 3, three index heads; head dim and block as the kernels take them
GEO = Geometry(q_heads=6, kv_heads=2, head_dim=32, index_heads=3, index_dim=32, block=16, topk=3)
SCALE = GEO.head_dim ** -0.5


def _step(geo=GEO):
    return random_step(geo, [3, 1, 2], [40, 17, 64], kv_dtype=torch.float32, index_dtype=torch.float32,
                       q_dtype=torch.float32, device="cpu")


def _package_meta(step_meta):
    """The dispatchers' torch path takes the package's metadata: the same step, prepared."""
    qo, kv, tables = step_meta.qo_lens.tolist(), step_meta.kv_lens.tolist(), step_meta.block_tables
    meta = MsaDecodeMetadata(len(qo), sum(qo), tables.shape[1], step_meta.block_size, "cpu", max_draft_len=2)
    meta.prepare(qo, kv, tables)
    return meta


def _selection(meta, cache, index_q, heads):
    sel = ref.select_blocks(index_q[:, :1], cache.index_k, meta, topk=GEO.topk)
    return sel.expand(heads, -1, -1).contiguous()


def test_kernels_refuse_a_group_or_index_head_count_they_cannot_tile():
    meta, cache, q, index_q = _step()
    with pytest.raises(KernelInputError, match="power of two, got 3"):
        dense_verify_attention(q, cache.k, cache.v, meta, scale=SCALE)
    with pytest.raises(KernelInputError, match="layout 'union'.*power of two, got 3"):
        sparse_verify_attention(q, cache.k, cache.v, meta, _selection(meta, cache, index_q, GEO.kv_heads),
                                scale=SCALE, layout="union")
    with pytest.raises(KernelInputError, match="index heads of a token: their count must be a power of two, got 3"):
        select_blocks_verify(index_q, cache.index_k, meta, topk=GEO.topk)


def test_a_group_too_tall_for_the_token_layout_and_not_a_power_of_two_is_refused_naming_both():
    geo = Geometry(q_heads=96, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=3)
    meta, cache, q, index_q = _step(geo)
    with pytest.raises(KernelInputError, match="got 96 .over 64, too tall for layout 'token'"):
        sparse_verify_attention(q, cache.k, cache.v, meta, _selection(meta, cache, index_q, 1), scale=SCALE)


def test_dispatchers_keep_untileable_head_counts_on_the_torch_references(monkeypatch):
    """Under a Triton backend the dispatchers would launch the kernels; these shapes must not reach them."""
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    meta, cache, q, index_q = _step()
    pmeta = _package_meta(meta)
    assert_close_rel(backend.dense_attention(q, cache.k, cache.v, pmeta, scale=SCALE),
                     ref.dense_attention(q, cache.k, cache.v, meta, scale=SCALE), 1e-4)
    got = backend.select_blocks_paged(index_q, cache.index_k, pmeta, topk=GEO.topk)
    expect = ref.select_blocks(index_q, cache.index_k, meta, topk=GEO.topk)
    assert torch.equal(got.sort(-1).values, expect.sort(-1).values)

    tall = Geometry(q_heads=96, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=3)
    meta, cache, q, index_q = _step(tall)
    pmeta = _package_meta(meta)
    sel = ref.select_blocks(index_q, cache.index_k, meta, topk=tall.topk)
    assert_close_rel(backend.sparse_attention(q, cache.k, cache.v, pmeta, sel, scale=SCALE),
                     ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=SCALE), 1e-4)
