"""MiniMaxM3ForCausalLM on the paged cache vs transformers' full forward (the oracle)."""
from __future__ import annotations

import pytest
import torch

from ._oracle import PagedRunner, load_oracle
from m3_eagle_plugin.eagle3.capture import AuxCapture
from m3_eagle_plugin.models.loader import load_target

TOL = 1e-4


def _oracle(path, ids: torch.Tensor):
    hf = load_oracle(path)
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def test_prefill_verify_and_single_steps_match_transformers(hf_text_checkpoint):
    torch.manual_seed(3)
    ids = torch.randint(0, 96, (30,))
    want_logits, want_hidden = _oracle(hf_text_checkpoint, ids)
    model = load_target(hf_text_checkpoint)
    runner = PagedRunner(model.config)
    capture = AuxCapture([1, 2, 3])
    # prefill 17 tokens, then verify chunks of 4, then single steps: sparsity starts after 12 tokens
    steps = [17, 4, 4, 1, 1, 2, 1]
    start = 0
    with torch.no_grad():
        for n in steps:
            runner.prepare([("a", n)])
            hidden = model(ids[start:start + n], runner.meta, runner.cache, capture=capture)
            got = model.compute_logits(hidden)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want_logits[start:start + n], atol=TOL, rtol=0)
            for layer in capture.layer_ids:
                torch.testing.assert_close(capture.get(layer), want_hidden[layer][start:start + n], atol=TOL, rtol=0)
            torch.testing.assert_close(capture.stacked(), torch.cat(
                [want_hidden[i][start:start + n] for i in capture.layer_ids], dim=-1), atol=TOL, rtol=0)
            start += n
    assert start == len(ids)


def test_reference_tiny_config_prefill_verify_and_singles_match_one_forward(tmp_path):
    """minimax_m3_msa.md §6.3 (b), at its tiny configuration (hidden 64, 4 layers: 1 dense + 3 sparse,
    8/2/16 heads, partial RoPE 0.5, 8 experts top-2, index 2 x 16, block 4, top-3 blocks, 1 local):
    prefill 30 tokens, one 4-token verify chunk, then 6 single-token steps equal one 40-token forward."""
    from ._oracle import MiniMaxM3VLForCausalLM, randomize_, tiny_text_config

    torch.manual_seed(0)
    hf = MiniMaxM3VLForCausalLM(tiny_text_config(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                                 num_local_experts=8, num_experts_per_tok=2))
    randomize_(hf, seed=11)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (40,))
    want, _ = _oracle(tmp_path, ids)
    model = load_target(tmp_path)
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.num_experts) == (8, 2, 8)
    runner = PagedRunner(model.config)
    start = 0
    with torch.no_grad():
        for n in [30, 4] + [1] * 6:
            runner.prepare([("r", n)])
            got = model.compute_logits(model(ids[start:start + n], runner.meta, runner.cache))
            torch.testing.assert_close(got, want[start:start + n], atol=TOL, rtol=0)
            start += n
    assert start == 40


def test_mixed_batch_of_two_requests_matches_transformers(hf_text_checkpoint):
    torch.manual_seed(4)
    ids_a, ids_b = torch.randint(0, 96, (22,)), torch.randint(0, 96, (20,))
    want_a, _ = _oracle(hf_text_checkpoint, ids_a)
    want_b, _ = _oracle(hf_text_checkpoint, ids_b)
    model = load_target(hf_text_checkpoint)
    runner = PagedRunner(model.config)
    # step 1: prefill a; step 2: verify 4 of a + prompt chunk of b; step 3: single a + verify 3 of b
    plan = [[("a", 14)], [("a", 4), ("b", 16)], [("a", 1), ("b", 3)], [("b", 1), ("a", 3)]]
    pos = {"a": 0, "b": 0}
    seqs, wants = {"a": ids_a, "b": ids_b}, {"a": want_a, "b": want_b}
    with torch.no_grad():
        for step in plan:
            runner.prepare(step)
            batch = torch.cat([seqs[r][pos[r]:pos[r] + n] for r, n in step])
            logits = model.compute_logits(model(batch, runner.meta, runner.cache))
            row = 0
            for r, n in step:
                torch.testing.assert_close(logits[row:row + n], wants[r][pos[r]:pos[r] + n], atol=TOL, rtol=0)
                row += n
                pos[r] += n


def test_make_tiny_production_layout_matches_transformers(tiny_dir):
    from transformers import MiniMaxM3SparseForConditionalGeneration

    path = tiny_dir / "target"
    hf = load_oracle(path, MiniMaxM3SparseForConditionalGeneration)
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (26,))
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True)
    want_logits, want_hidden = out.logits[0].float(), [h[0] for h in out.hidden_states]
    model = load_target(path)
    assert model.config.layout == "production" and sum(model.config.sparse_layers) == 5
    runner = PagedRunner(model.config)
    capture = AuxCapture(model.config.default_aux_layer_ids)
    start = 0
    with torch.no_grad():
        for n in [13, 4, 1, 4, 1, 3]:
            runner.prepare([("r", n)])
            got = model.compute_logits(model(ids[start:start + n], runner.meta, runner.cache, capture=capture))
            torch.testing.assert_close(got, want_logits[start:start + n], atol=TOL, rtol=0)
            want_aux = torch.cat([want_hidden[i][start:start + n] for i in capture.layer_ids], dim=-1)
            torch.testing.assert_close(capture.stacked(), want_aux, atol=TOL, rtol=0)
            start += n


def test_sparse_selection_is_active_in_the_oracle_config(hf_text_checkpoint):
    """Guard: the test sequences are long enough that MSA drops blocks (else sparse == dense)."""
    from m3_eagle_plugin.models.config import M3Config

    cfg = M3Config.from_file(hf_text_checkpoint)
    assert cfg.block_size * cfg.topk_blocks < 22 and any(cfg.sparse_layers)


def test_graph_safe_moe_gives_the_same_logits(hf_text_checkpoint):
    torch.manual_seed(6)
    ids = torch.randint(0, 96, (18,))
    outs = []
    for graph_safe in (False, True):
        model = load_target(hf_text_checkpoint)
        model.set_graph_safe_moe(graph_safe)
        runner = PagedRunner(model.config)
        runner.prepare([("a", 18)])
        with torch.no_grad():
            outs.append(model.compute_logits(model(ids, runner.meta, runner.cache)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_forward_rejects_batched_input(hf_text_checkpoint):
    model = load_target(hf_text_checkpoint)
    runner = PagedRunner(model.config)
    runner.prepare([("a", 2)])
    with pytest.raises(ValueError, match="1-D"):
        model(torch.zeros(1, 2, dtype=torch.long), runner.meta, runner.cache)


@pytest.mark.parametrize("ids", [4, 2])
def test_ids_of_another_count_than_the_metadata_are_refused_naming_both(hf_text_checkpoint, ids):
    """More ids than the prepared step failed in a RoPE reshape ("shape '[4, 1, 8]' is invalid"), after
    the capture had dropped the last step's states; fewer failed in the first layer's KV write."""
    model = load_target(hf_text_checkpoint)
    runner = PagedRunner(model.config)
    capture = AuxCapture([0, 1])
    runner.prepare([("a", 3)])
    with torch.no_grad():
        model(torch.arange(3), runner.meta, runner.cache, capture=capture)
    kept = capture.stacked().clone()
    with pytest.raises(ValueError, match=rf"input_ids has {ids} tokens, the step metadata 3"):
        model(torch.arange(ids), runner.meta, runner.cache, capture=capture)
    assert torch.equal(capture.stacked(), kept)



def test_capture_of_a_layer_past_the_last_is_refused_before_the_forward(hf_text_checkpoint):
    """Layers run 0..L-1 (transformers' hidden_states[L] is the final norm's input, not a layer input):
    an aux id L would never be recorded, so the forward refuses it up front, naming the id."""
    model = load_target(hf_text_checkpoint)
    layers = model.config.num_layers
    runner = PagedRunner(model.config)
    runner.prepare([("a", 2)])
    with pytest.raises(ValueError, match=rf"aux layer ids \[{layers}\] out of range for {layers} layers"):
        model(torch.zeros(2, dtype=torch.long), runner.meta, runner.cache, capture=AuxCapture([0, layers]))
    capture = AuxCapture([0, layers - 1])  # the last layer's input is capturable
    model(torch.zeros(2, dtype=torch.long), runner.meta, runner.cache, capture=capture)
    assert capture.stacked().shape == (2, 2 * model.config.hidden_size)

def test_a_step_the_capture_buffer_cannot_take_is_refused_before_any_layer_writes_kv(hf_text_checkpoint):
    """A 4-row buffer and a 6-token step: the refusal came at the first aux layer, after the layers
    ahead of it had written the step's K/V; now before layer 0, every page as it was."""
    model = load_target(hf_text_checkpoint)
    runner = PagedRunner(model.config)
    runner.prepare([("a", 6)])
    capture = AuxCapture([2, 3])
    capture.allocate(4, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device="cpu")
    pages = [t.clone() for t in runner.cache._storage]
    with torch.no_grad(), pytest.raises(ValueError, match=r"too small for \[6, .*\] for the step"):
        model(torch.arange(6), runner.meta, runner.cache, capture=capture)
    assert all(torch.equal(a, b) for a, b in zip(pages, runner.cache._storage))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_and_bf16_match_transformers(tiny_dir):
    from transformers import MiniMaxM3SparseForConditionalGeneration

    path = tiny_dir / "target"
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(8))
    hf = load_oracle(path, MiniMaxM3SparseForConditionalGeneration)
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0].float()
    for dtype, atol in ((torch.float32, 1e-3), (torch.bfloat16, 1.0)):
        model = load_target(path, dtype=dtype, device="cuda")
        runner = PagedRunner(model.config, device="cuda", dtype=dtype)
        start, rows = 0, []
        with torch.no_grad():
            for n in (14, 4, 1, 4, 1):
                runner.prepare([("r", n)])
                rows.append(model.compute_logits(model(ids[start:start + n].cuda(), runner.meta, runner.cache)))
                start += n
        got = torch.cat(rows).cpu()
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        torch.testing.assert_close(got, want[:start], atol=atol, rtol=0)  # bf16: a rare routing flip
        assert (got - want[:start]).abs().mean() < atol / 20


def _prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    runner = PagedRunner(model.config)
    runner.prepare([("a", len(ids))])
    with torch.no_grad():
        return model.compute_logits(model(ids, runner.meta, runner.cache))


def test_vl_top_level_tie_word_embeddings_loads_and_matches_transformers(tiny_dir, tmp_path):
    """A VL config tying at its top level only: the checkpoint has no lm_head; the embedding serves."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import MiniMaxM3SparseForConditionalGeneration

    src = tiny_dir / "target"
    raw = json.loads((src / "config.json").read_text())
    raw["tie_word_embeddings"], raw["text_config"]["tie_word_embeddings"] = True, False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["language_model.lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, 256, (18,), generator=torch.Generator().manual_seed(9))
    hf = load_oracle(tmp_path, MiniMaxM3SparseForConditionalGeneration)
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0].float()
    assert torch.equal(hf.lm_head.weight, tensors["language_model.model.embed_tokens.weight"])  # the oracle ties
    torch.testing.assert_close(_prefill_logits(load_target(tmp_path), ids), want, atol=TOL, rtol=0)


def test_zero_width_shared_expert_checkpoint_matches_transformers(tmp_path):
    """`shared_intermediate_size: 0` (no shared expert): transformers saves empty shared-expert tensors."""
    from ._oracle import MiniMaxM3VLForCausalLM, randomize_, tiny_text_config

    torch.manual_seed(0)
    hf = MiniMaxM3VLForCausalLM(tiny_text_config(shared_intermediate_size=0))
    randomize_(hf, seed=2)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want = load_oracle(tmp_path)(input_ids=ids[None]).logits[0].float()
    model = load_target(tmp_path)
    assert all(layer.mlp.shared_experts is None for layer in model.layers[1:])
    torch.testing.assert_close(_prefill_logits(model, ids), want, atol=TOL, rtol=0)


def test_config_with_both_expert_count_keys_loads_like_transformers(tmp_path):
    """config.json holding `num_local_experts` and `num_experts`: transformers builds `num_experts`
    experts (its alias is set last), and so must the loader to load the same checkpoint."""
    import json

    from ._oracle import MiniMaxM3VLForCausalLM, randomize_, tiny_text_config

    torch.manual_seed(0)
    hf = MiniMaxM3VLForCausalLM(tiny_text_config(num_local_experts=4))
    randomize_(hf, seed=4)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_local_experts"], raw["num_experts"] = 6, 4
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(12))
    oracle = load_oracle(tmp_path)
    assert oracle.config.num_local_experts == 4
    with torch.no_grad():
        want = oracle(input_ids=ids[None]).logits[0].float()
    torch.testing.assert_close(_prefill_logits(load_target(tmp_path), ids), want, atol=TOL, rtol=0)


def test_cpu_bf16_rounds_no_more_than_transformers_bf16(hf_text_checkpoint):
    """bf16 on the torch path (prefill, verify chunk, single steps) against transformers' fp32 logits:
    no further off than transformers' own bf16 forward is. The router (fp32 logits, fp32 correction
    bias), the fp32 expert accumulation and the fp32 RoPE tables only ever round less than it does.
    A whole-model claim on this one checkpoint and these ids: on other random checkpoints an expert
    or block choice that bf16 flips cascades through the later tokens, either way (ours came out worse
    on 4 of 10 seeds), so the parts carry the claim too: the norms are compared with
    transformers' in bf16 (test_norms.py), the router's logits in fp32 (test_mlp.py)."""
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        want = load_oracle(hf_text_checkpoint)(input_ids=ids[None]).logits[0].float()
        hf_bf16 = type(load_oracle(hf_text_checkpoint)).from_pretrained(
            hf_text_checkpoint, dtype=torch.bfloat16, attn_implementation="eager").eval()
        hf_err = (hf_bf16(input_ids=ids[None]).logits[0].float() - want).abs()
    model = load_target(hf_text_checkpoint, dtype=torch.bfloat16)
    runner = PagedRunner(model.config, dtype=torch.bfloat16)
    start, rows = 0, []
    with torch.no_grad():
        for n in (17, 4, 1, 4, 1, 3):
            runner.prepare([("a", n)])
            rows.append(model.compute_logits(model(ids[start:start + n], runner.meta, runner.cache)))
            start += n
    got = torch.cat(rows)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    err = (got - want).abs()
    assert err.mean() <= hf_err.mean(), (err.mean(), hf_err.mean())  # max: a rare routing flip either way


def test_init_blocks_are_attended_by_every_token():
    """A production config forcing 1 init + 1 local block of a top-2 selection: every token attends to
    exactly the visible keys of block 0 and of its own block, whatever the index scores say (naive
    masked softmax attention below, from the layer's own projections)."""
    from m3_eagle_plugin.models.attention import M3Attention
    from m3_eagle_plugin.models.config import M3Config
    from m3_eagle_plugin.models.rope import RotaryEmbedding, apply_rope
    from m3_eagle_plugin.models.tiny import target_config

    raw = target_config()
    raw["text_config"]["sparse_attention_config"].update(sparse_init_block=1, sparse_topk_blocks=2)
    cfg = M3Config.from_dict(raw)
    torch.manual_seed(0)
    attn = M3Attention(cfg, cfg.sparse_layer_ids[0])
    runner = PagedRunner(cfg)
    t, heads, kv_heads, d = 22, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim  # 6 blocks of 4
    runner.prepare([("a", t)])
    x = torch.randn(t, cfg.hidden_size)
    rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
    with torch.no_grad():
        got = attn(x, rotary.at(torch.arange(t)), runner.meta, runner.cache)
        cos, sin = rotary.cos_sin(torch.arange(t))
        q = apply_rope(attn.q_norm(attn.q_proj(x).view(t, heads, d)), cos, sin)
        k = apply_rope(attn.k_norm(attn.k_proj(x).view(t, kv_heads, d)), cos, sin)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = attn.v_proj(x).view(t, kv_heads, d).repeat_interleave(heads // kv_heads, dim=1)
        block = torch.arange(t) // cfg.block_size
        pos = torch.arange(t)
        allowed = (pos[None, :] <= pos[:, None]) & ((block[None, :] == 0) | (block[None, :] == block[:, None]))
        scores = torch.einsum("thd,shd->hts", q, k) * d ** -0.5
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        want = attn.o_proj(torch.einsum("hts,shd->thd", probs, v).reshape(t, heads * d))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_set_graph_safe_moe_switches_every_moe_layer_and_back(hf_text_checkpoint):
    from m3_eagle_plugin.models.mlp import M3SparseMoE

    model = load_target(hf_text_checkpoint)
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, M3SparseMoE)]
    assert len(moe) == 3 and not any(m.graph_safe for m in moe)  # the default: only chosen experts run
    model.set_graph_safe_moe()
    assert all(m.graph_safe for m in moe)
    model.set_graph_safe_moe(False)
    assert not any(m.graph_safe for m in moe)


def test_transformers_in_memory_vl_names_load_and_match_transformers(tiny_dir, tmp_path):
    """A raw state_dict of transformers' VL model (`model.language_model.*`, `lm_head`, vision
    weights under `model.vision_tower` / `model.multi_modal_projector`, ignored)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import MiniMaxM3SparseForConditionalGeneration

    from m3_eagle_plugin.models.loader import detect_layout

    hf = load_oracle(tiny_dir / "target", MiniMaxM3SparseForConditionalGeneration)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.language_model.layers.0.mlp.gate_up_proj.weight" in state
    assert detect_layout(set(state)) == "vl_internal"
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_dir / "target" / "config.json", tmp_path / "config.json")
    ids = torch.randint(0, 256, (18,), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0].float()
    torch.testing.assert_close(_prefill_logits(load_target(tmp_path), ids), want, atol=TOL, rtol=0)


def _cache_and_meta(config, block_size: int, meta_block_size: int | None = None):
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.msa.metadata import MsaDecodeMetadata

    cache = PagedKVCache.for_minimax_m3(config.num_layers, config.sparse_layer_ids, config.num_kv_heads,
                                        config.head_dim, config.index_dim or config.head_dim, block_size, 16,
                                        dtype=torch.float32)
    return cache, MsaDecodeMetadata(2, 64, 16, meta_block_size or block_size, "cpu")


def test_a_page_size_other_than_the_checkpoints_msa_block_is_refused_by_name(hf_text_checkpoint, tmp_path):
    """The sparse layers select blocks of one page each: pages of 8 tokens for a checkpoint whose MSA
    block is 4 selected 3 blocks of 8 and gave other logits than transformers (1.29 apart) without a
    word. A model without sparse layers has no block and matches transformers at any page size."""
    from ._oracle import MiniMaxM3VLForCausalLM, randomize_, tiny_text_config

    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2))
    model = load_target(hf_text_checkpoint)
    assert model.config.block_size == 4
    cache, meta = _cache_and_meta(model.config, 8)
    cache.add_request("a")
    cache.reserve("a", 30)
    meta.prepare([30], [30], cache.block_table(["a"]))
    with pytest.raises(ValueError, match="block size 8 .*differs from the checkpoint's MSA block size 4"):
        model(ids, meta, cache)

    torch.manual_seed(0)
    hf = MiniMaxM3VLForCausalLM(tiny_text_config(layer_types=["full_attention"] * 4))
    randomize_(hf, seed=1)
    hf.save_pretrained(tmp_path)
    dense = load_target(tmp_path)
    cache, meta = _cache_and_meta(dense.config, 8)
    cache.add_request("a")
    cache.reserve("a", 30)
    meta.prepare([30], [30], cache.block_table(["a"]))
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(dense.compute_logits(dense(ids, meta, cache)), want, atol=TOL, rtol=0)


def test_metadata_of_another_block_size_than_the_cache_is_refused_before_any_write(hf_text_checkpoint):
    """Slots of 4-token blocks in a cache of 8-token pages name other pages' tokens: request a's step
    wrote into request b's page (slot 4 of page 1 is page 0's token 4 at 8 tokens a page), then the
    attention refused the shapes. Refused now before the first layer writes: every page as it was,
    and the capture keeps the last step's states."""
    model = load_target(hf_text_checkpoint)
    cache, meta = _cache_and_meta(model.config, 8, meta_block_size=4)
    cache.add_request("b")
    cache.reserve("b", 8)
    cache.add_request("a")
    cache.reserve("a", 4)
    assert cache.block_table(["b", "a"]).tolist() == [[0], [1]]
    for pool in cache._storage:
        pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(5)))
    pools = [t.clone() for t in cache._storage]
    meta.prepare([4], [4], cache.block_table(["a"]))
    assert meta.cache_slots.tolist() == [4, 5, 6, 7]  # page 1 of 4 tokens: b's page 0 at 8 tokens a page
    runner, capture = PagedRunner(model.config), AuxCapture([1, 2])
    runner.prepare([("c", 3)])
    with torch.no_grad():
        model(torch.arange(3), runner.meta, runner.cache, capture=capture)
    kept = capture.stacked().clone()
    with pytest.raises(ValueError, match="the cache's pages hold 8 tokens, the step metadata's block size is 4"):
        model(torch.arange(4), meta, cache, capture=capture)
    assert all(torch.equal(a, b) for a, b in zip(pools, cache._storage))
    assert torch.equal(capture.stacked(), kept)
