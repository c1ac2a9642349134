"""The reference host on real tiny checkpoints (MSA sparsity active: prompts past 12 tokens):
target-only greedy equals transformers' greedy generate; Eagle3 (K = 1, 3, 5, with and without
overlap) equals target-only."""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
from m3_eagle_plugin.host.reference.engine import EngineConfig

NEW = 8


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 26)]


def run(pair, prompts, draft_len, overlap=False, with_head=True, **config):
    target_dir, draft_dir = pair
    cfg = EngineConfig(draft_len=draft_len, max_batch_size=2, max_tokens_per_step=16, overlap=overlap, **config)
    engine = build_engine(target_dir, draft_dir if with_head else None, cfg,
                          num_blocks=blocks_for_prompts(prompts, NEW, draft_len, 4))
    with torch.no_grad():
        result = engine.generate(prompts, NEW)
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert result.errors == [None] * len(prompts)
    return result


@pytest.fixture(scope="module")
def target_only(tiny_pair, prompts):
    torch.set_num_threads(1)
    return run(tiny_pair, prompts, 0, with_head=False).outputs


def test_target_only_matches_transformers_generate(tiny_pair, prompts, target_only):
    from transformers import MiniMaxM3SparseForConditionalGeneration

    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        tiny_pair[0], dtype=torch.float32, attn_implementation="eager").eval()
    for prompt, got in zip(prompts, target_only):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        assert got == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("draft_len,overlap", [(1, False), (3, False), (5, False), (3, True)])
def test_eagle3_greedy_equals_target_only(tiny_pair, prompts, target_only, draft_len, overlap):
    result = run(tiny_pair, prompts, draft_len, overlap=overlap)
    assert result.outputs == target_only
    assert result.draft_source == "eagle3"
    assert result.stats.draft_tokens == draft_len * result.stats.verify_steps > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graphs,overlap", [(False, False), (True, False), (True, True)])
def test_gpu_eager_and_cuda_graphs_equal_target_only(tiny_pair, prompts, target_only, cuda_graphs, overlap):
    target_dir, draft_dir = tiny_pair
    cfg = EngineConfig(draft_len=3, max_batch_size=2, max_tokens_per_step=16, cuda_graphs=cuda_graphs,
                       overlap=overlap)
    engine = build_engine(target_dir, draft_dir, cfg, num_blocks=blocks_for_prompts(prompts, NEW, 3, 4),
                          device="cuda")
    result = engine.generate(prompts, NEW)
    assert result.outputs == target_only
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    if cuda_graphs:
        assert all(b.graph is not None for b in engine.runner.graphs.buckets.values())
        assert engine.runner.graphs.buckets


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_graphs_on_the_torch_references_equal_target_only(tiny_pair, prompts, target_only, monkeypatch):
    """The graphs stage lengths at capacity so the torch references (which loop over host lengths)
    replay correctly at every step: the path `auto` takes for shapes the kernels refuse."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    target_dir, draft_dir = tiny_pair
    cfg = EngineConfig(draft_len=3, max_batch_size=2, max_tokens_per_step=16, cuda_graphs=True)
    engine = build_engine(target_dir, draft_dir, cfg, num_blocks=blocks_for_prompts(prompts, NEW, 3, 4),
                          device="cuda")
    result = engine.generate(prompts, NEW)
    assert result.outputs == target_only
    assert engine.runner.graphs.buckets and all(b.graph is not None for b in engine.runner.graphs.buckets.values())


def proposals_per_request(pair, prompts, **config):
    """Every draft proposal the engine makes, per request, in order (spying on launched steps)."""
    target_dir, draft_dir = pair
    engine = build_engine(target_dir, draft_dir, EngineConfig(draft_len=3, **config),
                          num_blocks=blocks_for_prompts(prompts, NEW, 3, 4))
    seen = {i: [] for i in range(len(prompts))}
    launch = engine.launch

    def spy(rows, step_id):
        out = launch(rows, step_id)
        for j, row_index in enumerate(out.drafting_rows):
            seen[out.rows[row_index].request.index].append(out.next_inputs[j, 1:].tolist())
        return out

    engine.launch = spy
    outputs = engine.generate(prompts, NEW).outputs
    return outputs, seen


def test_head_drafts_do_not_depend_on_chunking_batching_or_overlap(tiny_pair, prompts, target_only):
    """Drafts depend only on each request's committed tokens: one request at a time with whole
    prompts must propose exactly what chunked, batched, overlapped decoding proposes."""
    alone = [proposals_per_request(tiny_pair, [p], max_batch_size=1, max_tokens_per_step=64) for p in prompts]
    outputs, mixed = proposals_per_request(tiny_pair, prompts, max_batch_size=3, max_tokens_per_step=9, overlap=True)
    assert outputs == target_only
    for i, (out, seen) in enumerate(alone):
        assert out == [target_only[i]]
        assert mixed[i] == seen[0] and len(seen[0]) >= 2


def test_first_drafts_follow_eagle3_semantics_with_transformers_features(tiny_pair, prompts, target_only):
    """Independent reference for the first proposal: transformers' hidden states at the head's aux
    layers for positions 0..P-1, ids shifted by one (prompt[1:] + first token), one unchunked head
    pass on a fresh cache, then single-token steps fed with the head's own hidden."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    from m3_eagle_plugin.msa import MsaDecodeMetadata

    _, mixed = proposals_per_request(tiny_pair, prompts, max_batch_size=3, max_tokens_per_step=9)
    engine = build_engine(*tiny_pair, EngineConfig(draft_len=3), num_blocks=32)
    head, cache = engine.head, engine.cache
    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        tiny_pair[0], dtype=torch.float32, attn_implementation="eager").eval()
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        features = torch.cat([states[i][0] for i in head.aux_layer_ids], dim=-1)
        ids = torch.tensor(prompt[1:] + [target_only[index][0]])
        rid = f"reference-{index}"
        cache.add_request(rid)
        cache.reserve(rid, len(prompt) + 3)
        meta = MsaDecodeMetadata(1, 64, 32, cache.block_size, "cpu")
        drafts = []
        with torch.no_grad():
            meta.prepare([len(prompt)], [len(prompt)], cache.block_table([rid]))
            logits, hidden = head(ids, features, meta, cache)
            token, hidden = logits[-1:].argmax(-1), hidden[-1:]
            for step in range(3):
                drafts.append(int(token))
                if step == 2:
                    break
                meta.prepare([1], [len(prompt) + step + 1], cache.block_table([rid]))
                logits, hidden = head(token, hidden, meta, cache)
                token = logits.argmax(-1)
        cache.free(rid)
        assert mixed[index][0] == drafts
