"""The byte floor of the kernel rows (GPU) and the CPU smoke table: one function, checked by hand."""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.bench.inputs import Geometry, selected_tokens, union_blocks
from m3_eagle_plugin.bench.kernel_suite import byte_floor
from m3_eagle_plugin.bench.step_meta import build_step_meta

# block 4, head dim 4, 2 q heads / 1 KV head, index dim 3; q fp32 (4 bytes), index bf16 (2), K/V fp16 (2)
GEO = Geometry(q_heads=2, kv_heads=1, head_dim=4, index_heads=1, index_dim=3, block=4, topk=2)


@pytest.fixture
def step():
    # request 0: 6 tokens on pages [0, 1] (page 1 holds 2); request 1: 9 tokens on [2, 3, 4] (page 4 holds 1)
    tables = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)
    meta = build_step_meta([2, 2], [6, 9], tables, GEO.block, device="cpu")  # positions 4, 5 and 7, 8
    q = torch.zeros(4, 2, 4, dtype=torch.float32)
    index_q = torch.zeros(4, 1, 3, dtype=torch.bfloat16)
    # token 0: blocks 0, 1; token 1: 1; token 2: 1; token 3: 1, 2 -> unions {0, 1} (4 + 2 tokens), {1, 2} (4 + 1)
    selection = torch.tensor([[[0, 1], [1, -1], [1, -1], [1, 2]]], dtype=torch.int32)
    return meta, q, index_q, selection


def floor(name, step, **kw):
    meta, q, index_q, selection = step
    return byte_floor(name, meta, GEO, q=q, index_q=index_q, kv_dtype=torch.float16, index_dtype=torch.bfloat16,
                      selection=kw.get("selection", selection))


def test_byte_floor_by_hand_with_partial_last_pages(step):
    q_read = out_written = 4 * 2 * 4 * 4      # 4 tokens x 2 heads x dim 4 x fp32 = 128
    index_q_read = 4 * 1 * 3 * 2              # 24
    index_k = (6 + 9) * 3 * 2                 # valid tokens only: 90 (5 whole pages would be 120)
    dense_kv = (6 + 9) * 2 * 4 * 2            # K and V of 15 tokens: 240
    sparse_kv = (4 + 2 + 4 + 1) * 2 * 4 * 2   # 11 selected valid tokens: 176 (4 whole pages: 256)
    selection = 1 * 4 * 2 * 4                 # int32 [1, 4, 2]: 32
    assert floor("index_select", step) == (index_q_read + index_k + selection, 0)
    assert floor("sparse_attn", step) == (q_read + selection + sparse_kv + out_written, 4)
    assert floor("sparse_step", step) == (index_q_read + index_k + q_read + sparse_kv + out_written, 4)
    assert floor("dense_attn", step) == (q_read + dense_kv + out_written, 0)
    assert floor("kv_lens_update", step) == (0, 0)


def test_selected_tokens_counts_each_union_block_once(step):
    meta, _, _, selection = step
    assert union_blocks(selection, meta) == 4 and selected_tokens(selection, meta) == 11
    two_heads = torch.cat([selection, torch.full_like(selection, -1)])  # the second head selects nothing
    assert union_blocks(two_heads, meta) == 4 and selected_tokens(two_heads, meta) == 11


def test_sparse_rows_need_the_selection(step):
    with pytest.raises(ValueError, match="needs the selection"):
        floor("sparse_attn", step, selection=None)
