"""Per-rank geometry vs hand-computed MiniMax-M3 production values (64 q / 4 KV / 4 index heads,
head and index dim 128, block 128, 60 layers of which 57 sparse)."""
import pytest
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.models.config import M3Config
from m3_eagle_plugin.parallel import (
    ShardingError,
    index_k_coalesced,
    rank_config,
    rank_pool_geometry,
    shard_heads,
)


def production_config() -> M3Config:
    pattern = (False,) * 3 + (True,) * 57
    return M3Config(
        vocab_size=200064, hidden_size=6144, num_layers=60, num_heads=64, num_kv_heads=4, head_dim=128,
        rotary_dim=64, rope_theta=5e6, rms_norm_eps=1e-6, sparse_layers=pattern, moe_layers=pattern,
        dense_intermediate_size=12288, moe_intermediate_size=3072, shared_intermediate_size=3072,
        num_experts=128, num_experts_per_tok=4, routed_scaling_factor=2.0, swiglu_alpha=1.702,
        swiglu_limit=7.0, index_heads=4, index_dim=128, block_size=128, topk_blocks=16, local_blocks=1,
        init_blocks=0,
    )


@pytest.mark.parametrize("tp, q, kv, idx", [(1, 64, 4, 4), (2, 32, 2, 2), (4, 16, 1, 1)])
def test_production_heads_per_rank(tp, q, kv, idx):
    shape = shard_heads(64, 4, 4, tp)
    assert (shape.q_heads, shape.kv_heads, shape.index_heads) == (q, kv, idx)
    assert list(shape.q_head_range(tp - 1)) == list(range(64 - q, 64))
    assert list(shape.kv_head_range(tp - 1)) == list(range(4 - kv, 4))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("method", ["q_head_range", "kv_head_range", "index_head_range"])
def test_a_rank_outside_the_group_is_refused(tp, method):
    """Ranks are 0 .. tp-1: rank tp (one past the last) and -1 name no rank and get no heads."""
    shape = shard_heads(64, 4, 4, tp)
    for rank in (tp, tp + 1, -1):
        with pytest.raises(ValueError, match=f"rank {rank} is outside \\[0, {tp}\\)"):
            getattr(shape, method)(rank)
    assert len(getattr(shape, method)(tp - 1)) == getattr(shape, method.replace("_range", "s"))


def test_production_rank_config_at_tp4():
    cfg = rank_config(production_config(), 4)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.index_heads) == (16, 1, 1)
    assert (cfg.dense_intermediate_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size) == (3072, 768, 768)
    assert (cfg.num_experts, cfg.hidden_size, cfg.head_dim, cfg.index_dim) == (128, 6144, 128, 128)


def test_mega_slot_coalesces_per_rank_at_tp4():
    # bf16: K page = 1 head x 128 tokens x 128 x 2 B = 32768 B = index-K page 128 x 128 x 2 B
    geometry = rank_pool_geometry(production_config(), 4, num_draft_layers=1, draft_num_kv_heads=4)
    assert [(p.page_bytes, p.sub_pages) for p in geometry.pools] == [(32768, 60 * 2 + 57 + 2)]
    assert index_k_coalesced(geometry)
    assert geometry.locate(2, "v").offset == 5
    assert [geometry.locate(3, r).offset for r in ("k", "v", "index_k")] == [6, 7, 8]
    assert geometry.locate(59, "index_k").offset == 6 + 3 * 56 + 2 == 176
    assert geometry.locate(60, "k").offset == 177  # the shared draft layer, 1 of its 4 KV heads per rank


@pytest.mark.parametrize("tp, kv_page", [(1, 131072), (2, 65536)])
def test_no_mega_slot_when_k_pages_are_bigger(tp, kv_page):
    geometry = rank_pool_geometry(production_config(), tp)
    assert [(p.page_bytes, p.sub_pages) for p in geometry.pools] == [(kv_page, 120), (32768, 57)]
    assert not index_k_coalesced(geometry)
    assert geometry.locate(3, "index_k").pool_id == 1


@pytest.mark.parametrize("tp, pools", [
    # fp8 K/V (1 B) with a bf16 index-K (2 B): K page = kv heads x 128 x 128 x 1 B, index-K page 128 x 128 x 2 B
    (4, [(16384, 120), (32768, 57)]),  # 1 KV head a rank: K/V pages are half the index-K's
    (2, [(32768, 120 + 57)]),           # 2 KV heads a rank: the same size, one mega-slot
])
def test_fp8_kv_beside_a_bf16_index_k(tp, pools):
    geometry = rank_pool_geometry(production_config(), tp, bytes_per_elem=1, index_bytes_per_elem=2)
    assert [(p.page_bytes, p.sub_pages) for p in geometry.pools] == pools
    assert index_k_coalesced(geometry) == (len(pools) == 1)


def test_indivisible_counts_name_the_cause():
    with pytest.raises(ShardingError, match="num_key_value_heads = 4 does not split over 8"):
        shard_heads(64, 4, 4, 8)
    with pytest.raises(ShardingError, match="index heads"):
        shard_heads(64, 4, 2, 2)
    with pytest.raises(ShardingError, match="tp_size"):
        shard_heads(64, 4, 4, 0)
    with pytest.raises(TypeError):
        shard_heads(64, 4, 4, 2.0)
    with pytest.raises(ShardingError, match="moe_intermediate_size"):
        rank_config(production_config().__class__(**{**production_config().__dict__, "moe_intermediate_size": 3070}), 4)
    with pytest.raises(ShardingError, match="draft"):
        rank_pool_geometry(production_config(), 4, num_draft_layers=1, draft_num_kv_heads=2)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(kv=st.integers(1, 8), group=st.integers(1, 8), tp=st.integers(1, 8),
       head_dim=st.sampled_from([16, 32, 64, 128]), index_dim=st.sampled_from([16, 32, 64, 128]))
def test_sharding_partitions_heads_and_coalesces_exactly_when_pages_match(kv, group, tp, head_dim, index_dim):
    if kv % tp:
        with pytest.raises(ShardingError):
            shard_heads(kv * group, kv, kv, tp)
        return
    shape = shard_heads(kv * group, kv, kv, tp)
    q_heads = [h for r in range(tp) for h in shape.q_head_range(r)]
    kv_heads = [h for r in range(tp) for h in shape.kv_head_range(r)]
    assert q_heads == list(range(kv * group)) and kv_heads == list(range(kv))
    # a rank's query heads read only its own KV heads (GQA group = h // group)
    for r in range(tp):
        assert {h // group for h in shape.q_head_range(r)} == set(shape.kv_head_range(r))
    assert list(shape.index_head_range(0)) == list(shape.kv_head_range(0))
    base = production_config()
    cfg = base.__class__(**{**base.__dict__, "num_layers": 4, "sparse_layers": (False, True, True, True),
                            "moe_layers": (False,) * 4, "num_heads": kv * group, "num_kv_heads": kv,
                            "index_heads": kv, "head_dim": head_dim, "rotary_dim": 16, "index_dim": index_dim,
                            "block_size": 8})
    geometry = rank_pool_geometry(cfg, tp)
    assert index_k_coalesced(geometry) == (kv // tp * head_dim == index_dim)
    assert len(geometry.pools) == (1 if kv // tp * head_dim == index_dim else 2)


def _dense_config(**kw) -> M3Config:
    """4 dense (no MSA) layers with a dense MLP; the index fields are left at the production values."""
    base = production_config()
    return base.__class__(**{**base.__dict__, "num_layers": 4, "sparse_layers": (False,) * 4,
                             "moe_layers": (False,) * 4, **kw})


def test_query_heads_that_do_not_form_gqa_groups_are_refused():
    """6 query heads over 4 KV heads: no integer group size, so no rank split is meaningful."""
    with pytest.raises(ShardingError, match="do not form groups"):
        shard_heads(6, 4, 4, 2)
    shape = shard_heads(8, 4, 4, 2)
    assert (shape.q_heads, shape.kv_heads) == (4, 2)


def test_a_negative_width_is_refused():
    from m3_eagle_plugin.parallel.sharding import shard_width

    assert shard_width("w", 0, 1) == 0
    for total in (-1, -2):
        with pytest.raises(ShardingError, match=f"w must be >= 0, got {total}"):
            shard_width("w", total, 1)


def test_the_index_k_element_size_defaults_to_the_kv_one():
    # fp8 everywhere at TP4: K page 1 x 128 x 128 x 1 B = 16384 = index-K page 128 x 128 x 1 B
    geometry = rank_pool_geometry(production_config(), 4, bytes_per_elem=1)
    assert [(p.page_bytes, p.sub_pages) for p in geometry.pools] == [(16384, 120 + 57)]
    assert index_k_coalesced(geometry)


def test_a_cache_without_index_k_pages_is_not_coalesced():
    """No sparse layer, no index-K page: there is no mega-slot to speak of."""
    geometry = rank_pool_geometry(_dense_config(), 4)
    assert [(p.page_bytes, p.sub_pages) for p in geometry.pools] == [(32768, 8)]
    assert not index_k_coalesced(geometry)


def test_a_dense_only_config_keeps_its_index_heads_unsharded():
    """Without sparse layers the index heads are not split (nothing uses them): rank_config leaves them."""
    cfg = rank_config(_dense_config(), 4)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.index_heads) == (16, 1, 4)
    assert cfg.dense_intermediate_size == 12288 // 4


def test_index_k_pages_only_partly_beside_the_kv_pages_are_not_coalesced():
    """`index_k_coalesced` means every index-K page shares the K/V slot: a geometry (built by hand)
    whose layer 1 index-K page has the K/V page size (4096 B, pool 0) but whose layer 2 index-K page
    is half that (its own pool 1) is not a mega-slot."""
    from m3_eagle_plugin.kv.geometry import BufferSpec, build_pool_geometry

    buffers = [BufferSpec(layer, role, 4096) for layer in (0, 1, 2) for role in ("k", "v")]
    buffers += [BufferSpec(1, "index_k", 4096), BufferSpec(2, "index_k", 2048)]
    geometry = build_pool_geometry(buffers)
    assert geometry.locate(1, "index_k").pool_id == 0 and geometry.locate(2, "index_k").pool_id == 1
    assert not index_k_coalesced(geometry)
    whole = build_pool_geometry([b if b.role != "index_k" else BufferSpec(b.layer, "index_k", 4096) for b in buffers])
    assert index_k_coalesced(whole)
