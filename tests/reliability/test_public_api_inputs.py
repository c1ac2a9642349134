"""Hostile inputs to the public core API: each is refused with an error naming the argument,
never truncated, wrapped or turned into a silently different answer."""
import numpy as np
import pytest
import torch

from m3_eagle_plugin.eagle3.accept import forced_accept, forced_ratio, greedy_accept, rejection_accept
from m3_eagle_plugin.eagle3.draft_loop import run_draft_loop
from m3_eagle_plugin.kv import (
    BlockAllocator,
    BufferSpec,
    copy_pool_block_offsets,
    derive_shared_draft_layout,
    extend_attention_op_pools,
    minimax_m3_geometry,
)
from m3_eagle_plugin.msa import MsaInputError, per_token_valid_blocks, valid_blocks_from_positions
from m3_eagle_plugin.parallel import shard_heads, shard_width

# --- msa.blocks -------------------------------------------------------------------------------


def test_valid_blocks_refuses_float_and_bool_positions():
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        valid_blocks_from_positions(torch.tensor([2.5]), 1)  # was 3 blocks
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        valid_blocks_from_positions(torch.tensor([True]), 1)


def test_valid_blocks_int32_max_position_does_not_wrap():
    # position 2**31 - 1 sees 2**31 tokens = 2**30 blocks of 2 (int32 p + 1 wrapped to 0 blocks)
    out = valid_blocks_from_positions(torch.tensor([2**31 - 1], dtype=torch.int32), 2)
    assert out.tolist() == [2**30]


def test_valid_blocks_refuses_counts_past_int32_on_host():
    with pytest.raises(MsaInputError, match="past int32"):
        valid_blocks_from_positions(torch.tensor([2**40]), 1)  # came back as 1 block


@pytest.mark.parametrize("num_tokens", [1.0, True, "1"])
def test_per_token_valid_blocks_names_a_bad_num_tokens(num_tokens):
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        per_token_valid_blocks([1], [3], 1, num_tokens=num_tokens)


def test_per_token_valid_blocks_refuses_complex_and_int64_overflow():
    with pytest.raises(TypeError, match="qo_lens must be an integer tensor"):
        per_token_valid_blocks(torch.tensor([1 + 0j]), torch.tensor([3]), 1)
    with pytest.raises(MsaInputError, match="qo_lens entry 9223372036854775808 does not fit int64"):
        per_token_valid_blocks([2**63], [3], 1)


# --- kv.draft_layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [np.array([8] * 6), torch.tensor([8] * 6)])
def test_draft_layout_array_heads_are_not_a_scalar(heads):
    # a per-layer list of 6 (4 target + ... ) with num_layers=4 gives total 6: draft layer 5;
    # read as a scalar it gave ([4], 4)
    assert derive_shared_draft_layout(4, [8] * 6, 1) == ([5], 5)
    with pytest.raises(TypeError, match="num_kv_heads must be an int"):
        derive_shared_draft_layout(4, heads, 1)


def test_draft_layout_range_heads_are_per_layer():
    assert derive_shared_draft_layout(None, range(5), 1) == ([4], 4)


@pytest.mark.parametrize("kwargs, name", [
    ({"num_layers": 2.5}, "num_layers"), ({"num_layers": True}, "num_layers"),
    ({"num_layers": "4"}, "num_layers"), ({"num_draft_layers": None}, "num_draft_layers"),
    ({"num_draft_layers": float("nan")}, "num_draft_layers"), ({"num_kv_heads": None}, "num_kv_heads"),
    ({"num_kv_heads": "x"}, "num_kv_heads"),
])
def test_draft_layout_refuses_non_int_counts(kwargs, name):
    args = {"num_layers": 4, "num_kv_heads": 8, "num_draft_layers": 1, **kwargs}
    with pytest.raises(TypeError, match=name):
        derive_shared_draft_layout(args["num_layers"], args["num_kv_heads"], args["num_draft_layers"])


# --- kv.virtual_pools ---------------------------------------------------------------------------

_POINTERS = torch.tensor([[1000, 2000]], dtype=torch.int64)
_MAPPING = torch.tensor([[0, 0], [0, 1], [0, 2]], dtype=torch.int32)


@pytest.mark.parametrize("entry, name", [
    ((1.7, 5000, 5), "draft layer"), ((True, 5000, 5), "draft layer"),
    ((2, 5000.9, 5), "K base address"), ((2, 5000, 2.9), "sub_pages_per_slot"),
])
def test_extend_pools_refuses_non_int_entries(entry, name):
    with pytest.raises(TypeError, match=name):  # layer 1.7 remapped layer 1
        extend_attention_op_pools(_POINTERS, _MAPPING, [entry])


def test_extend_pools_refuses_lossy_or_unreadable_tables():
    with pytest.raises(TypeError, match="pool_pointers must be int64"):
        extend_attention_op_pools(_POINTERS.float(), _MAPPING, [(2, 2**40 + 1, 5)])  # rounded to 2**40
    with pytest.raises(TypeError, match="pool_mapping must be an integer tensor"):
        extend_attention_op_pools(_POINTERS, _MAPPING.float() + 0.5, [(2, 5000, 5)])
    with pytest.raises(ValueError, match="meta tensor"):
        extend_attention_op_pools(_POINTERS, _MAPPING.to("meta"), [(2, 5000, 5)])
    with pytest.raises(TypeError, match="num_pools must be an int"):
        extend_attention_op_pools(_POINTERS, _MAPPING, [], num_pools=1.5)


def test_extend_pools_range_errors_name_the_entry():
    with pytest.raises(ValueError, match=r"K base address must be in \(0, 2\*\*63\)"):
        extend_attention_op_pools(_POINTERS, _MAPPING, [(2, 2**63, 5)])
    with pytest.raises(ValueError, match="sub_pages_per_slot=2147483648 does not fit int32"):
        extend_attention_op_pools(_POINTERS, _MAPPING, [(2, 5000, 2**31)])
    with pytest.raises(ValueError, match="draft layer entries"):
        extend_attention_op_pools(_POINTERS, _MAPPING, [None])


_HOST = torch.tensor([[[0, 1, 2, -1], [0, 0, 0, 0]], [[3, 4, -1, -1], [0, 0, 0, 0]]], dtype=torch.int32)


def _dst():
    return torch.full((2, 2, 4), 7, dtype=torch.int32)


@pytest.mark.parametrize("index, error", [
    (torch.tensor([1.7, 0.2]), TypeError), (torch.tensor([True, False]), TypeError),
    (torch.tensor([-1, 0]), IndexError), (torch.tensor([[1], [0]]), TypeError), ([1, 0], TypeError),
])
def test_copy_offsets_refuses_bad_copy_index_and_leaves_dst(index, error):
    dst = _dst()
    with pytest.raises(error, match="copy_index"):  # -1 read the last host row
        copy_pool_block_offsets(dst, _HOST, index, 3, 1)
    assert dst.tolist() == [[[7] * 4] * 2] * 2


def test_copy_offsets_refuses_truncating_scales_and_negative_width():
    for kwargs, match in [({"index_scale": 2.5}, "index_scale"), ({"index_scale": True}, "index_scale"),
                          ({"index_scale": -1}, "index_scale"), ({"max_blocks": -1}, "max_blocks"),
                          ({"max_blocks": 1.5}, "max_blocks")]:
        args = {"index_scale": 3, "kv_offset": 1, "max_blocks": None, **kwargs}
        dst = _dst()
        with pytest.raises((TypeError, ValueError), match=match):
            copy_pool_block_offsets(dst, _HOST, torch.tensor([1, 0]), args["index_scale"], args["kv_offset"],
                                    args["max_blocks"])
        assert dst.tolist() == [[[7] * 4] * 2] * 2


def test_copy_offsets_refuses_float_slots_and_int32_wrap():
    with pytest.raises(TypeError, match="host_offsets must be an integer tensor"):
        copy_pool_block_offsets(_dst(), _HOST.float() - 0.5, torch.tensor([1, 0]), 3, 1)  # -0.5 -> slot 0
    host = torch.full((2, 2, 4), -1, dtype=torch.int32)
    host[0, 0, 0] = 2**30
    dst = _dst()
    with pytest.raises(ValueError, match="page index 4294967297 does not fit"):  # 2**30 * 4 wrapped to 0
        copy_pool_block_offsets(dst, host, torch.tensor([0, 1]), 4, 1)
    assert dst.tolist() == [[[7] * 4] * 2] * 2
    wide = torch.full((2, 2, 4), 7, dtype=torch.int64)
    copy_pool_block_offsets(wide, host, torch.tensor([0]), 4, 1)
    assert wide[0].tolist() == [[2**32, -1, -1, -1], [2**32 + 1, -1, -1, -1]]


# --- kv.allocator, kv.geometry --------------------------------------------------------------------


def test_blocks_for_refuses_negative_tokens():
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        BlockAllocator(4, 4).blocks_for(-5)  # was -1 blocks


@pytest.mark.parametrize("kwargs, name", [
    ({"num_kv_heads": 1.5}, "num_kv_heads"), ({"kv_bytes_per_elem": "2"}, "kv_bytes_per_elem"),
    ({"sparse_layer_ids": [2.7]}, "sparse layer id"), ({"draft_num_kv_heads": 2.5}, "draft_num_kv_heads"),
    ({"num_layers": True}, "num_layers"), ({"num_draft_layers": 1.5}, "num_draft_layers"),
    ({"sparse_layer_ids": None}, "sparse_layer_ids"),
])
def test_m3_geometry_refuses_non_int_shapes(kwargs, name):
    # kv_bytes_per_elem="2" made the page size the string "2222..." (string repetition)
    args = {"num_layers": 4, "sparse_layer_ids": [3], "num_kv_heads": 2, "head_dim": 4, "index_dim": 4,
            "block_size": 4, "num_draft_layers": 1, **kwargs}
    with pytest.raises(TypeError, match=name):
        minimax_m3_geometry(**args)


def test_geometry_lookups_do_not_truncate_or_wrap():
    g = minimax_m3_geometry(4, [3], 1, 4, 4, 4, num_draft_layers=1)
    assert len(g.pools) == 1  # 1 x 4 x 4 x 2 = 32 bytes for K/V and 4 x 4 x 2 = 32 for index-K
    with pytest.raises(IndexError, match="pool -1 is outside"):
        g.pool(-1)
    with pytest.raises(TypeError, match="layer must be an int"):
        g.locate(1.5, "k")  # found layer 1
    with pytest.raises(TypeError, match="buffer layer must be an int"):
        BufferSpec("3", "k", 8)
    with pytest.raises(TypeError, match="page_bytes must be an int"):
        BufferSpec(1, "k", 8.5)


# --- eagle3.accept / draft_loop ----------------------------------------------------------------


def test_accept_refuses_float_token_ids_and_lengths():
    drafts, target = torch.tensor([[1, 2]]), torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="draft_tokens must be an integer tensor"):
        greedy_accept(drafts.float() + 0.4, target)  # 1.4 was accepted as token 1
    with pytest.raises(TypeError, match="draft_lens must be an integer tensor"):
        greedy_accept(drafts, target, torch.tensor([1.9]))
    with pytest.raises(TypeError, match="draft_tokens must be an integer tensor"):
        rejection_accept(drafts.float() + 0.5, None, torch.full((1, 3, 4), 0.25))
    with pytest.raises(ValueError, match="target_tokens must be an integer"):
        greedy_accept(torch.tensor([[1], [2]]), torch.zeros(2, 2, 5, dtype=torch.long))


@pytest.mark.parametrize("num_forced", [1.5, float("nan"), float("inf"), True, None, "1", torch.tensor(1.7)])
def test_forced_accept_refuses_non_int_counts(num_forced):
    with pytest.raises(TypeError, match="num_forced must be an int"):
        forced_accept(torch.tensor([[1, 2]]), torch.tensor([[1, 2, 3]]), num_forced)


def test_forced_accept_huge_count_accepts_every_draft():
    out = forced_accept(torch.tensor([[5, 6]]), torch.tensor([[1, 2, 3]]), 2**63)
    assert out.num_accepted.tolist() == [2] and out.tokens.tolist() == [[5, 6, 3]]
    assert forced_accept(torch.tensor([[5, 6]]), torch.tensor([[1, 2, 3]]), np.int64(1)).tokens.tolist() == [[5, 2, 2]]


def test_forced_ratio_takes_numpy_ints():
    assert forced_ratio(np.int64(2)) == 2


class _Head:
    def __init__(self):
        self.calls = 0

    def forward(self, ids, hidden, meta, cache):
        self.calls += 1
        return torch.nn.functional.one_hot((ids + 1) % 5, 5).float(), hidden


def _loop(head, **kw):
    args = dict(first_meta=None, first_input_ids=torch.tensor([0, 1]), first_features=torch.zeros(2, 3),
                gather_index=torch.tensor([1]), step_metas=[], gathered_kv_lens=torch.tensor([3]),
                num_drafts=1, choose=lambda logits: (logits.argmax(-1), None))
    args.update(kw)
    return run_draft_loop(head, None, **args)


@pytest.mark.parametrize("kw, error, match", [
    ({"num_drafts": 2.5}, TypeError, "num_drafts must be an int"),
    ({"num_drafts": True}, TypeError, "num_drafts must be an int"),
    ({"gather_index": torch.tensor([1.0])}, TypeError, "gather_index"),
    ({"gather_index": torch.tensor([[1]])}, TypeError, "gather_index"),
    ({"gathered_kv_lens": torch.tensor([3, 4, 5])}, ValueError, "gathered_kv_lens"),
    ({"first_input_ids": torch.tensor([[0, 1]]), "first_features": torch.zeros(1, 3)}, TypeError,
     "first_input_ids"),
])
def test_draft_loop_checks_before_the_head_writes_the_cache(kw, error, match):
    head = _Head()
    with pytest.raises(error, match=match):
        _loop(head, **kw)
    assert head.calls == 0
    assert _loop(_Head()).tokens.tolist() == [[2]]  # token 1 -> (1 + 1) % 5


# --- parallel.sharding -------------------------------------------------------------------------


@pytest.mark.parametrize("total", [10.0, True, None])
def test_shard_width_refuses_non_int(total):
    with pytest.raises(TypeError, match="width must be an int"):
        shard_width("width", total, 2)  # 10.0 came back as 5.0


def test_shard_width_refuses_negative_and_heads_stay_int():
    from m3_eagle_plugin.parallel import ShardingError
    with pytest.raises(ShardingError, match="width must be >= 0"):
        shard_width("width", -8, 4)  # was -2
    with pytest.raises(TypeError, match="num_heads must be an int"):
        shard_heads(64.0, 4, 4, 4)
    shape = shard_heads(64, 4, 4, 4)
    assert (shape.q_heads, shape.kv_heads, shape.index_heads) == (16, 1, 1)
    with pytest.raises(TypeError, match="rank must be an int"):
        shape.q_head_range(True)
