"""The reference host on real tiny checkpoints (MSA sparsity active: prompts past 12 tokens):
target-only greedy equals transformers' greedy generate; Eagle3 (K = 1, 3, 5, with and without
overlap) equals target-only."""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
from m3_eagle_plugin.host.reference.engine import EngineConfig
from m3_eagle_plugin.host.reference.request import RequestState

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


# ----- a mixed workload against transformers and each request alone ------------------------------
# Requests arrive at seeded steps with prompts around block multiples (4), their own max_new_tokens
# and a shared eos id that ends some of them early; the KV pool holds a few requests' worst cases
# at a time, so later arrivals wait for admission and reuse freed pages.
MIXED_NEW = 9


@pytest.fixture(scope="module")
def mixed_workload(tiny_pair):
    """(arrivals [(step, prompt, max_new_tokens)], eos ids, the tokens transformers' greedy generate
    emits for each request under them)."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        tiny_pair[0], dtype=torch.float32, attn_implementation="eager").eval()

    def hf_generate(prompt, max_new, eos):
        ids = torch.tensor([prompt])
        with torch.no_grad():  # the mask given: one inferred from pad_token_id hides a prompt's 0 ids
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=list(eos) or None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    gen = torch.Generator().manual_seed(11)
    lengths = (4, 3, 13, 8, 17, 5, 12, 16)
    news = (MIXED_NEW, 1, 6, MIXED_NEW, 4, 7, 2, MIXED_NEW)
    steps = (0, 0, 1, 2, 2, 5, 9, 9)
    arrivals = [(s, torch.randint(0, 256, (n,), generator=gen).tolist(), m) for s, n, m in zip(steps, lengths, news)]
    # eos: request 3's fourth token (new in its continuation), so at least request 3 stops early
    free_run = hf_generate(arrivals[3][1], MIXED_NEW, ())
    eos = (next(t for j, t in enumerate(free_run) if j >= 3 and t not in free_run[:j]),)
    expected = [hf_generate(prompt, max_new, eos) for _, prompt, max_new in arrivals]
    assert any(out[-1] in eos for out in expected) and any(len(out) == m for out, (_, _, m) in zip(expected, arrivals))
    return arrivals, eos, expected


def drive(engine, arrivals):
    """`Engine.generate`'s step loop with requests joining at their arrival step (each its own
    max_new_tokens); returns the requests in arrival order and how many steps left one waiting."""
    requests, inflight, step, waited = [], None, 0, 0
    queue = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    while True:
        while queue and arrivals[queue[0]][0] <= step:
            i = queue.pop(0)
            requests.append(engine.make_request(i, arrivals[i][1], arrivals[i][2]))
        rows = engine.scheduler.schedule(requests)
        waited += any(r.state is RequestState.WAITING for r in requests)
        if not rows and inflight is None:
            if not queue:
                break
            step = arrivals[queue[0]][0]
            continue
        launched = engine.launch(rows, engine.stats.engine_steps) if rows else None
        engine.stats.engine_steps += bool(rows)
        if inflight is not None:
            engine.commit(inflight, requests, None)
            if launched is not None:
                engine._return_void_forced_count(launched)
        inflight = launched
        if inflight is not None and not engine.overlap:
            engine.commit(inflight, requests, None)
            inflight = None
        step += 1
    engine.stop_unfinished(requests)
    return sorted(requests, key=lambda r: r.index), waited


def oracle_proposer(expected_by_prompt, draft_len):
    """Drafts from transformers' continuation with every third one replaced and some rows short,
    so verify steps accept some drafts and reject others at every position."""
    calls = iter(range(10 ** 6))

    def propose(context):
        drafts = []
        for tokens in context.tokens:
            n = next(calls)
            prompt, done = next((p, len(tokens) - len(p)) for p in expected_by_prompt if tokens[:len(p)] == p)
            proposal = list(expected_by_prompt[prompt][done:done + draft_len])
            proposal = [(t + 1) % 256 if (n + j) % 3 == 2 else t for j, t in enumerate(proposal)]
            drafts.append(proposal[: n % (draft_len + 1)] if n % 5 == 4 else proposal)
        return drafts
    return propose


@pytest.mark.parametrize("mode,draft_len,batch,step_tokens,pool", [
    ("target", 0, 3, 8, 22), ("head", 3, 2, 11, 26), ("head-overlap", 2, 4, 7, 22), ("proposer", 3, 3, 9, 26),
])
def test_a_mixed_workload_equals_transformers_and_each_request_alone(
        tiny_pair, mixed_workload, mode, draft_len, batch, step_tokens, pool):
    arrivals, eos, expected = mixed_workload
    by_prompt = {tuple(p): tuple(e) for (_, p, _), e in zip(arrivals, expected)}
    proposer = oracle_proposer(by_prompt, draft_len) if mode == "proposer" else None
    cfg = EngineConfig(draft_len=draft_len, max_batch_size=batch, max_tokens_per_step=step_tokens,
                       overlap=mode == "head-overlap", eos_ids=eos)
    engine = build_engine(tiny_pair[0], None if mode == "target" else tiny_pair[1], cfg, num_blocks=pool,
                          proposer=proposer)
    requests, waited = drive(engine, arrivals)
    assert [r.error for r in requests] == [None] * len(arrivals)
    assert [r.output for r in requests] == expected
    assert waited, "the pool never held a request back"
    assert engine.cache.num_free_blocks == engine.cache.num_blocks and engine.scheduler.admitted_blocks == 0
    if mode == "proposer":
        assert 0 < engine.stats.accepted_tokens < engine.stats.draft_tokens
    # each request alone, through the engine's own loop, emits what it emitted beside the others
    for (_, prompt, max_new), request in zip(arrivals, requests):
        assert engine.generate([prompt], max_new).outputs == [request.output]
