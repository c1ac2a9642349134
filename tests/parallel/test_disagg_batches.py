"""A generation engine serving handoffs of several context batches at once: request ids stay
distinct (``first_index``) and every request continues to the target model's own greedy output,
taken from transformers' ``generate`` (independent of the reference host)."""
import pytest
import torch

from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
from m3_eagle_plugin.host.reference.engine import EngineConfig
from m3_eagle_plugin.parallel.disagg import continue_generation, export_handoff, import_handoff, run_context_phase

from ._workers import DISAGG_K, DISAGG_NEW, DISAGG_PROMPTS


def _engine(tiny_pair, prompts):
    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    return build_engine(tiny_pair[0], tiny_pair[1], config,
                        num_blocks=blocks_for_prompts(prompts, DISAGG_NEW, DISAGG_K, 4))


def _transformers_greedy(target_dir, prompts) -> list[list[int]]:
    from transformers import MiniMaxM3SparseForConditionalGeneration

    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation="eager").eval()
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=DISAGG_NEW, do_sample=False,
                              min_new_tokens=DISAGG_NEW)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def test_generation_engine_holds_two_context_batches_at_once(tiny_pair):
    batch_a, batch_b = DISAGG_PROMPTS, DISAGG_PROMPTS[::-1]
    context = _engine(tiny_pair, batch_a)
    handoffs = [export_handoff(context, r) for r in run_context_phase(context, batch_a, DISAGG_NEW)]
    handoffs += [export_handoff(context, r)
                 for r in run_context_phase(context, batch_b, DISAGG_NEW, first_index=len(batch_a))]
    assert [h.index for h in handoffs] == [0, 1, 2, 3]
    generation = _engine(tiny_pair, batch_a + batch_b)
    requests = [import_handoff(generation, h) for h in handoffs]  # batch a is still held here
    result = continue_generation(generation, requests)
    assert result.errors == [None] * 4
    assert result.outputs == _transformers_greedy(tiny_pair[0], batch_a + batch_b)
    assert generation.cache.num_free_blocks == generation.cache.num_blocks


@pytest.mark.parametrize("first_index", [-1, 1.0, True, "2"])
def test_context_phase_refuses_a_bad_first_index(tiny_pair, first_index):
    engine = _engine(tiny_pair, DISAGG_PROMPTS)
    with pytest.raises(ValueError, match="first_index"):
        run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW, first_index=first_index)
    assert not engine.cache.allocator.request_ids


def test_context_phase_admits_more_prompts_than_batch_slots(tiny_pair):
    """Three prompts, two batch slots: the prefilled requests (decoding, waiting to be handed off)
    must not hold slots the third prompt needs (it used to fail as "could not be prefilled (KV
    budget)" with the budget covering every prompt). Each continues to transformers' greedy output."""
    prompts = DISAGG_PROMPTS + [[5, 6, 7, 8, 9]]
    context = _engine(tiny_pair, prompts)
    assert context.scheduler.max_batch_size == 2 < len(prompts)
    handoffs = [export_handoff(context, r) for r in run_context_phase(context, prompts, DISAGG_NEW)]
    assert [len(h.output) for h in handoffs] == [1, 1, 1]
    assert context.cache.num_free_blocks == context.cache.num_blocks
    generation = _engine(tiny_pair, prompts)
    result = continue_generation(generation, [import_handoff(generation, h) for h in handoffs])
    assert result.errors == [None] * 3
    assert result.outputs == _transformers_greedy(tiny_pair[0], prompts)


def test_the_generation_engine_stops_imported_requests_at_its_eos_ids(tiny_pair):
    """The context engine knows no EOS; the generation engine's ``eos_ids`` name a token the target
    emits mid-way: each request ends with its first EOS after the handed-off token, as transformers'
    greedy output cut there."""
    expected = _transformers_greedy(tiny_pair[0], DISAGG_PROMPTS)
    eos = next(t for j, t in enumerate(expected[0]) if j >= 2 and t not in expected[0][:j] and t != expected[1][0])
    cut = [out[: out.index(eos, 1) + 1] if eos in out[1:] else out for out in expected]
    assert len(cut[0]) < DISAGG_NEW
    context = _engine(tiny_pair, DISAGG_PROMPTS)
    handoffs = [export_handoff(context, r) for r in run_context_phase(context, DISAGG_PROMPTS, DISAGG_NEW)]
    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64, eos_ids=(eos,))
    generation = build_engine(tiny_pair[0], tiny_pair[1], config,
                              num_blocks=blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    result = continue_generation(generation, [import_handoff(generation, h) for h in handoffs])
    assert result.outputs == cut
    assert result.stop_reasons == ["eos" if len(c) < DISAGG_NEW else "length" for c in cut]


def test_a_handoff_that_emitted_an_eos_id_of_the_generation_engine_is_refused(tiny_pair):
    """The context engine knows no EOS; request 0's first token is one of the generation engine's eos
    ids, so there the request has already ended (an aggregated run with those ids emits that one
    token, stop reason "eos"). Continuing it emitted past its EOS; it is refused by name instead,
    the engine untouched, and request 1 still continues."""
    context = _engine(tiny_pair, DISAGG_PROMPTS)
    handoffs = [export_handoff(context, r) for r in run_context_phase(context, DISAGG_PROMPTS, DISAGG_NEW)]
    eos = handoffs[0].output[0]
    assert eos not in handoffs[1].output
    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64, eos_ids=(eos,))
    generation = build_engine(tiny_pair[0], tiny_pair[1], config,
                              num_blocks=blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    aggregated = build_engine(tiny_pair[0], tiny_pair[1], config,
                              num_blocks=blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    assert aggregated.generate(DISAGG_PROMPTS[:1], DISAGG_NEW).stop_reasons == ["eos"]
    from m3_eagle_plugin.parallel.disagg import HandoffError

    with pytest.raises(HandoffError, match=f"request 0: emitted token {eos} is an eos id of this engine"):
        import_handoff(generation, handoffs[0])
    assert generation.cache.num_free_blocks == generation.cache.num_blocks
    assert generation.scheduler.admitted_blocks == 0 and not generation.cache.allocator.request_ids
    assert continue_generation(generation, [import_handoff(generation, handoffs[1])]).errors == [None]


def test_each_continue_call_returns_its_own_statistics_and_counts_its_time(tiny_pair):
    """The result held the engine's live stats object (a later call changed it: its verify steps
    doubled) and no time (tokens_per_s read 0). The engine's stats run across the calls, so the
    second result holds both calls' counts, the first keeps its own, and time is counted."""
    context = _engine(tiny_pair, DISAGG_PROMPTS)
    handoffs = [export_handoff(context, r) for r in run_context_phase(context, DISAGG_PROMPTS, DISAGG_NEW)]
    assert context.stats.elapsed_s > 0 and context.stats.engine_steps > 0
    generation = _engine(tiny_pair, DISAGG_PROMPTS)
    first = continue_generation(generation, [import_handoff(generation, handoffs[0])])
    counts = (first.stats.verify_steps, first.stats.generated_tokens, first.stats.engine_steps)
    assert counts[0] > 0 and first.stats.elapsed_s > 0 and first.stats.tokens_per_s > 0
    second = continue_generation(generation, [import_handoff(generation, handoffs[1])])
    assert (first.stats.verify_steps, first.stats.generated_tokens, first.stats.engine_steps) == counts
    assert second.stats.verify_steps > counts[0] and second.stats.engine_steps > counts[2]
    assert second.stats.elapsed_s > first.stats.elapsed_s
    assert first.outputs + second.outputs == _transformers_greedy(tiny_pair[0], DISAGG_PROMPTS[:2])
