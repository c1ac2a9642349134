"""A rank's shard of the target: weight cuts, partial sums, and TP2 (two gloo processes) vs TP1.

The single-process checks add the ranks' partial outputs by hand (what the all-reduce does);
the two-process check runs the real all-reduce hooks over gloo and compares greedy tokens and
logits of a prefill + verify-style steps, and reference-host engine runs (host drafter; Eagle3
head sharded alongside), with the unsharded models (TP1).
"""
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.models.loader import load_target
from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
from m3_eagle_plugin.parallel import ShardingError, rank_config
from m3_eagle_plugin.parallel.tp_model import shard_state_dict, shard_target

TP = 2


@pytest.fixture(scope="module")
def full_model(tiny_pair):
    return load_target(tiny_pair[0], dtype=torch.float32)


def _no_reduce_shard(model, rank):
    """A rank's weights without the all-reduce hooks (no process group in this process)."""
    shard = MiniMaxM3ForCausalLM(rank_config(model.config, TP))
    shapes = {n: t.shape for n, t in shard.state_dict().items()}
    shard.load_state_dict(shard_state_dict(model.state_dict(), shapes, rank, TP))
    return shard.eval()


def test_mlp_and_moe_partial_sums_equal_the_full_block(full_model):
    shards = [_no_reduce_shard(full_model, r) for r in range(TP)]
    x = torch.randn(7, full_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer_id in (0, full_model.config.num_layers - 1):  # a dense MLP and a MoE layer
        full = full_model.layers[layer_id].mlp(x)
        parts = [s.layers[layer_id].mlp(x) for s in shards]
        assert torch.allclose(sum(parts), full, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(parts[0], full, atol=1e-3)  # each rank really holds a part


def test_rank_shapes_and_replicated_weights(full_model):
    shard = _no_reduce_shard(full_model, 1)
    attn, full_attn = shard.layers[4].self_attn, full_model.layers[4].self_attn
    assert tuple(attn.q_proj.weight.shape) == (2 * 16, 64) and tuple(attn.k_proj.weight.shape) == (16, 64)
    assert torch.equal(attn.q_proj.weight, full_attn.q_proj.weight[32:])  # rank 1 owns heads 2, 3
    assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, 32:])
    assert torch.equal(attn.indexer.q_proj.weight, full_attn.indexer.q_proj.weight[16:])  # index head 1
    assert torch.equal(attn.indexer.k_proj.weight, full_attn.indexer.k_proj.weight)  # shared index_k head
    assert torch.equal(shard.layers[4].mlp.gate.weight, full_model.layers[4].mlp.gate.weight)
    assert torch.equal(shard.lm_head.weight, full_model.lm_head.weight)


def test_draft_head_mlp_partial_sums_and_cuts(full_model, tiny_pair):
    from m3_eagle_plugin.eagle3.checkpoint import load_draft
    from m3_eagle_plugin.parallel.tp_model import shard_draft_head

    head = load_draft(tiny_pair[1], full_model, dtype=torch.float32)
    whole = shard_draft_head(head, 0, 1)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), head.state_dict().values()))
    shapes = {n: t.shape for n, t in _draft_skeleton(head).state_dict().items()}
    parts = [shard_state_dict(head.state_dict(), shapes, r, TP) for r in range(TP)]
    full_mlp = head.layers[0].mlp
    x = torch.randn(5, head.config.hidden_size, generator=torch.Generator().manual_seed(1))
    total = 0
    for part in parts:
        gate, up = part["layers.0.mlp.gate_proj.weight"], part["layers.0.mlp.up_proj.weight"]
        total = total + torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ part["layers.0.mlp.down_proj.weight"].T
    assert torch.allclose(total, full_mlp(x), atol=1e-5)
    assert torch.equal(parts[1]["layers.0.self_attn.k_proj.weight"], head.layers[0].self_attn.k_proj.weight[16:])
    assert torch.equal(parts[1]["fc.weight"], head.fc.weight)


def _draft_skeleton(head):
    import dataclasses

    from m3_eagle_plugin.eagle3.head import Eagle3Head

    c = head.config
    return Eagle3Head(dataclasses.replace(c, num_heads=c.num_heads // TP, num_kv_heads=c.num_kv_heads // TP,
                                          intermediate_size=c.intermediate_size // TP))


def test_tp1_shard_is_the_model(full_model):
    shard = shard_target(full_model, 0, 1)
    assert all(torch.equal(a, b) for a, b in zip(shard.state_dict().values(), full_model.state_dict().values()))
    assert not shard.layers[0].self_attn._forward_hooks  # nothing to reduce


def test_bad_input_is_refused(full_model):
    with pytest.raises(TypeError):
        shard_target(torch.nn.Linear(2, 2), 0, 2)
    with pytest.raises(ValueError, match="outside"):
        shard_target(full_model, 2, 2)
    with pytest.raises(RuntimeError, match="process group"):
        shard_target(full_model, 0, 2)
    with pytest.raises(ShardingError, match="num_key_value_heads"):
        rank_config(full_model.config, 4)
    with pytest.raises(ShardingError, match="no tensor-parallel split rule"):
        shard_state_dict({"norm.weight": torch.ones(4)}, {"norm.weight": torch.Size([2])}, 0, 2)
    with pytest.raises(ShardingError, match=r"lacks \['norm.weight'\]"):
        shard_state_dict({}, {"norm.weight": torch.Size([4])}, 0, 2)
    for rank in (-1, 2):  # refused even when nothing needs cutting
        with pytest.raises(ValueError, match=f"rank {rank} is outside"):
            shard_state_dict({"norm.weight": torch.ones(4)}, {"norm.weight": torch.Size([4])}, rank, 2)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(tp=st.sampled_from([1, 2, 4]), width=st.integers(1, 3), rows=st.integers(1, 3), experts=st.integers(1, 3))
def test_cuts_reassemble_the_full_tensor(tp, width, rows, experts):
    gen = torch.Generator().manual_seed(tp * 100 + width * 10 + rows)
    inter = width * tp
    full = {
        "layers.0.self_attn.q_proj.weight": torch.randn(inter * 2, rows, generator=gen),
        "layers.0.self_attn.o_proj.weight": torch.randn(rows, inter, generator=gen),
        "layers.0.mlp.gate_up_proj.weight": torch.randn(2 * inter, rows, generator=gen),
        "layers.0.mlp.experts.gate_up_proj": torch.randn(experts, 2 * inter, rows, generator=gen),
        "layers.0.mlp.experts.down_proj": torch.randn(experts, rows, inter, generator=gen),
        "norm.weight": torch.randn(rows, generator=gen),
    }
    shapes = {
        "layers.0.self_attn.q_proj.weight": torch.Size([inter * 2 // tp, rows]),
        "layers.0.self_attn.o_proj.weight": torch.Size([rows, width]),
        "layers.0.mlp.gate_up_proj.weight": torch.Size([2 * width, rows]),
        "layers.0.mlp.experts.gate_up_proj": torch.Size([experts, 2 * width, rows]),
        "layers.0.mlp.experts.down_proj": torch.Size([experts, rows, width]),
        "norm.weight": torch.Size([rows]),
    }
    parts = [shard_state_dict(full, shapes, r, tp) for r in range(tp)]
    cat = lambda name, dim: torch.cat([p[name] for p in parts], dim=dim)  # noqa: E731
    assert torch.equal(cat("layers.0.self_attn.q_proj.weight", 0), full["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(cat("layers.0.self_attn.o_proj.weight", 1), full["layers.0.self_attn.o_proj.weight"])
    assert torch.equal(cat("layers.0.mlp.experts.down_proj", 2), full["layers.0.mlp.experts.down_proj"])
    for name in ("layers.0.mlp.gate_up_proj.weight", "layers.0.mlp.experts.gate_up_proj"):
        gates = torch.cat([p[name].chunk(2, dim=-2)[0] for p in parts], dim=-2)
        ups = torch.cat([p[name].chunk(2, dim=-2)[1] for p in parts], dim=-2)
        assert torch.equal(torch.cat([gates, ups], dim=-2), full[name])
    assert all(torch.equal(p["norm.weight"], full["norm.weight"]) for p in parts)


def test_tp2_greedy_output_and_logits_equal_tp1(two_rank_run):
    tmp_path = two_rank_run
    tp1 = {**torch.load(Path(tmp_path) / "tp1_loop.pt"), **torch.load(Path(tmp_path) / "tp1_engine.pt")}
    for rank in range(TP):
        tp2 = torch.load(Path(tmp_path) / f"tp2_rank{rank}.pt")
        assert tp2["tokens"] == tp1["tokens"]
        assert len(tp2["logits"]) == len(tp1["logits"]) >= 6
        for a, b in zip(tp2["logits"], tp1["logits"]):
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
        assert tp2["engine_outputs"] == tp1["engine_outputs"]
        assert tp2["engine_stats"] == tp1["engine_stats"]
        # Eagle3 head sharded too: same tokens, the same draft proposals, the same statistics
        assert tp2["eagle_outputs"] == tp1["eagle_outputs"] == tp1["engine_outputs"]
        assert tp2["eagle_drafts"] == tp1["eagle_drafts"] and len(tp1["eagle_drafts"][0]) >= 3
        assert tp2["eagle_stats"] == tp1["eagle_stats"]
        # tiny TP2 mirrors production TP4: 1 KV head x block 4 x dim 16 = the index-K page 4 x 16, so
        # each rank runs on the one-pool mega-slot (draft layer included); TP1 needs two pools
        assert (tp2["eagle_pools"], tp1["eagle_pools"]) == (1, 2)
    assert tp1["sparse_active"]  # some token saw more than top-k blocks: selection really pruned
    assert 0 < tp1["engine_stats"]["acceptance_rate"] < 1


@pytest.mark.parametrize("rows, tp, shard_rows", [(6, 4, 2), (8, 3, 3), (5, 2, 2)])
def test_a_cut_that_does_not_partition_the_tensor_is_refused_on_every_rank(rows, tp, shard_rows):
    """``rows`` do not split over ``tp`` ranks, so no rank may get a slice: `torch.chunk` still
    hands the first ranks ``shard_rows``-row pieces (and the others a short piece or none); equal
    floor-sized slices (5 rows as 2 + 2) fit the shard's shape but would drop the last row."""
    full = {"layers.0.self_attn.q_proj.weight": torch.randn(rows, 3)}
    shapes = {"layers.0.self_attn.q_proj.weight": torch.Size([shard_rows, 3])}
    for rank in range(tp):
        with pytest.raises(ShardingError, match="q_proj"):
            shard_state_dict(full, shapes, rank, tp)


def test_shard_keeps_the_sources_graph_safe_moe_setting(full_model):
    moe = [i for i, layer in enumerate(full_model.layers) if hasattr(layer.mlp, "graph_safe")]
    assert moe, "the tiny model has MoE layers"
    full_model.set_graph_safe_moe(True)
    try:
        shard = shard_target(full_model, 0, 1)
        assert [shard.layers[i].mlp.graph_safe for i in moe] == [True] * len(moe)
    finally:
        full_model.set_graph_safe_moe(False)
    assert not any(shard_target(full_model, 0, 1).layers[i].mlp.graph_safe for i in moe)


def _fake_group(monkeypatch, world_size, rank):
    """A process group of ``world_size`` in which this process is ``rank``, without a rendezvous:
    sharding only asks the group its size and rank (the all-reduce runs at forward time)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)


def test_a_rank_that_is_not_this_processes_rank_in_the_group_is_refused(full_model, monkeypatch):
    _fake_group(monkeypatch, TP, 1)
    with pytest.raises(ShardingError, match="process group rank 1 of 2 does not match rank 0"):
        shard_target(full_model, 0, TP)
    _fake_group(monkeypatch, 4, 0)
    with pytest.raises(ShardingError, match="process group rank 0 of 4 does not match rank 2 of tp_size 4"):
        shard_target(full_model, 2, 4)


def test_draft_head_shard_cuts_its_mlp_by_rank(full_model, tiny_pair, monkeypatch):
    """Rank 1 of 2 holds the second half of the draft MLP's intermediate dim (rows of gate/up,
    columns of down), checked against slices of the unsharded head."""
    from m3_eagle_plugin.eagle3.checkpoint import load_draft
    from m3_eagle_plugin.parallel.tp_model import shard_draft_head

    head = load_draft(tiny_pair[1], full_model, dtype=torch.float32)
    inter = head.config.intermediate_size
    _fake_group(monkeypatch, TP, 1)
    shard = shard_draft_head(head, 1, TP)
    mlp, full_mlp = shard.layers[0].mlp, head.layers[0].mlp
    half = inter // TP
    assert tuple(mlp.gate_proj.weight.shape) == (half, head.config.hidden_size)
    assert torch.equal(mlp.gate_proj.weight, full_mlp.gate_proj.weight[half:])
    assert torch.equal(mlp.up_proj.weight, full_mlp.up_proj.weight[half:])
    assert torch.equal(mlp.down_proj.weight, full_mlp.down_proj.weight[:, half:])
    assert len(shard.layers[0].mlp._forward_hooks) == 1 and len(shard.layers[0].self_attn._forward_hooks) == 1


def test_a_draft_shard_keeps_what_came_from_the_target(full_model, tiny_pair):
    """`from_target` says which vocabulary modules training must leave alone; a shard's say the same."""
    from m3_eagle_plugin.eagle3.checkpoint import load_draft
    from m3_eagle_plugin.parallel.tp_model import shard_draft_head

    head = load_draft(tiny_pair[1], full_model, dtype=torch.float32)
    head.from_target = ("embed_tokens",)  # as for a checkpoint that ships its own lm_head
    assert shard_draft_head(head, 0, 1).from_target == ("embed_tokens",)


@pytest.mark.parametrize("rank, tp_size, cause", [(1.0, TP, "rank must be an int, got float"),
                                                  (True, TP, "rank must be an int, got bool"),
                                                  (1, 2.0, "tp_size must be an int, got float")])
def test_a_rank_or_size_that_is_not_an_int_is_refused_by_name(full_model, monkeypatch, rank, tp_size, cause):
    """A float rank reached `narrow` (torch's argument error, naming neither), a bool one was cut as
    rank 1, while the rest of the package refuses both by name (`_ints.as_int`)."""
    full = {"layers.0.self_attn.q_proj.weight": torch.arange(8.0).view(4, 2)}
    shapes = {"layers.0.self_attn.q_proj.weight": torch.Size([2, 2])}
    with pytest.raises(TypeError, match=cause):
        shard_state_dict(full, shapes, rank, tp_size)
    _fake_group(monkeypatch, TP, 1)  # the group agrees with the value, as 1.0 == 1 and True == 1
    with pytest.raises(TypeError, match=cause):
        shard_target(full_model, rank, tp_size)


def test_a_shard_is_refused_as_the_model_to_shard(full_model, tiny_pair, monkeypatch):
    """A TP2 shard holds half of every cut weight and sums through its hooks: cut again it ran with a
    quarter (TP2, where its KV heads split again) or without the sums (TP1), on logits 4.5 and 5.6 off
    the unsharded model's (a tiny random config over two gloo ranks), without a word; here its one KV
    head was blamed. A TP1 shard is the whole model: it may be cut."""
    from m3_eagle_plugin.eagle3.checkpoint import load_draft
    from m3_eagle_plugin.parallel.tp_model import shard_draft_head

    _fake_group(monkeypatch, TP, 1)
    shard = shard_target(full_model, 1, TP)
    rows = full_model.layers[4].self_attn.q_proj.weight.shape[0]
    assert shard.layers[4].self_attn.q_proj.weight.shape[0] == rows // TP  # a part, not the model
    head = shard_draft_head(load_draft(tiny_pair[1], full_model, dtype=torch.float32), 1, TP)
    for rank, tp_size in ((1, TP), (0, 1)):
        with pytest.raises(ShardingError, match="model is already rank 1's shard of tensor-parallel size 2"):
            shard_target(shard, rank, tp_size)
        with pytest.raises(ShardingError, match="head is already rank 1's shard of tensor-parallel size 2"):
            shard_draft_head(head, rank, tp_size)
    again = shard_target(shard_target(full_model, 0, 1), 1, TP)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), shard.state_dict().values()))


def test_a_ranks_state_dict_is_refused_as_the_full_one(full_model):
    """Rank 0's cut state dict (a saved shard, say) has the shard's shapes, so handed over as the
    'full' one it passed through untouched: asked for rank 1 it gave rank 0's heads, without a word."""
    with torch.device("meta"):
        skeleton = MiniMaxM3ForCausalLM(rank_config(full_model.config, TP))
    shapes = {n: t.shape for n, t in skeleton.state_dict().items()}
    name = "layers.4.self_attn.q_proj.weight"
    whole = full_model.state_dict()[name]
    rank1 = shard_state_dict(full_model.state_dict(), shapes, 1, TP)
    assert torch.equal(rank1[name], whole[whole.shape[0] // TP:])  # the full one still cuts
    rank0 = shard_state_dict(full_model.state_dict(), shapes, 0, TP)
    for rank in range(TP):
        with pytest.raises(ShardingError, match=r"q_proj.weight: full shape \(32, 64\) is already the shard's"):
            shard_state_dict(rank0, shapes, rank, TP)


def _prefill_logits(model):
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.msa import MsaDecodeMetadata

    c = model.config
    cache = PagedKVCache.for_minimax_m3(c.num_layers, c.sparse_layer_ids, c.num_kv_heads, c.head_dim, c.index_dim,
                                        c.block_size, 8, dtype=torch.float32)
    meta = MsaDecodeMetadata(1, 64, 8, c.block_size, "cpu", max_draft_len=0, num_index_heads=c.index_heads)
    cache.add_request(0)
    cache.reserve(0, 7)
    meta.prepare([7], [7], cache.block_table([0], 8), num_context_requests=1)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor([5, 6, 7, 8, 9, 10, 11]), meta, cache))


def test_a_shard_run_outside_the_group_it_was_cut_for_is_refused(full_model, monkeypatch):
    """A TP2 shard kept while its process group was torn down and re-initialised (an engine rebuilt
    after a failure) summed its partial outputs over whatever group there was now: in a group of one
    it ran on logits 5.0 off the unsharded model's (two gloo processes, then one), without a word."""
    import torch.distributed as dist

    from m3_eagle_plugin.parallel.process_group import init_local_group

    from ._spawn import free_port

    with monkeypatch.context() as fake:
        _fake_group(fake, TP, 0)
        shard = shard_target(full_model, 0, TP)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # init_local_group sets it: restored afterwards
    init_local_group(0, 1, free_port(), backend="gloo", timeout_s=10)
    try:
        with pytest.raises(ShardingError, match="rank 0's shard of tensor-parallel size 2 runs in process group "
                                                "rank 0 of 1"):
            _prefill_logits(shard)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ShardingError, match="rank 0's shard of tensor-parallel size 2 runs in no process group"):
        _prefill_logits(shard)


def test_an_all_reduce_that_fails_names_this_rank_and_what_it_summed(full_model, monkeypatch):
    """Gloo's error when a peer dies or stays away past the group's timeout ('Connection reset by
    peer', 'Timed out waiting 5000ms for recv operation', measured with two processes) names neither
    this rank nor what was being summed; the error keeps its type (NCCL's DistBackendError here)."""
    import torch.distributed as dist

    _fake_group(monkeypatch, TP, 1)
    shard = shard_target(full_model, 1, TP)

    def reset(tensor, op=None, group=None):
        raise dist.DistBackendError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:7914: Connection reset "
                                    "by peer")

    monkeypatch.setattr(dist, "all_reduce", reset)
    cause = (r"rank 1 of tensor-parallel size 2: the all-reduce of a layer's partial sums failed \(a rank died, "
             r"raised before it, or did not reach it within the process group's timeout\): .*Connection reset by peer")
    with pytest.raises(dist.DistBackendError, match=cause):
        _prefill_logits(shard)
