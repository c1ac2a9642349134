"""Disaggregation helpers in one process: what an error leaves behind in the engines.

A handoff that fails must leave the engine as it found it (no pages, no admission budget, no
registered request ids), so the engine can serve the next batch; checked against a fresh
engine's counts, not against the helpers' own bookkeeping.
"""
import pytest

from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
from m3_eagle_plugin.host.reference.engine import EngineConfig
from m3_eagle_plugin.parallel.disagg import HandoffError, export_handoff, run_context_phase

from ._workers import DISAGG_K, DISAGG_NEW, DISAGG_PROMPTS


def _engine(tiny_pair, num_blocks):
    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    return build_engine(tiny_pair[0], tiny_pair[1], config, num_blocks=num_blocks)


def _is_clean(engine) -> bool:
    return (engine.cache.num_free_blocks == engine.cache.num_blocks and engine.scheduler.admitted_blocks == 0
            and not engine.cache.allocator.request_ids)


def test_context_phase_that_cannot_prefill_everything_leaves_the_engine_clean(tiny_pair):
    # room for the first prompt's worst case only: the second can never be admitted while the
    # first (decoding, never verified here) holds its budget
    one = blocks_for_prompts(DISAGG_PROMPTS[:1], DISAGG_NEW, DISAGG_K, 4)
    assert one < blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    engine = _engine(tiny_pair, one)
    with pytest.raises(HandoffError, match="could not be prefilled"):
        run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)
    assert _is_clean(engine)
    # and the engine still serves a batch that fits
    requests = run_context_phase(engine, DISAGG_PROMPTS[:1], DISAGG_NEW)
    handoff = export_handoff(engine, requests[0])
    assert len(handoff.output) == 1 and _is_clean(engine)


@pytest.fixture(scope="module")
def handoffs(tiny_pair):
    """Real handoffs of both prompts from a context engine (Eagle3 head drafting)."""
    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    return [export_handoff(engine, r) for r in run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)]


def padded(handoff, block_size):
    """``handoff`` whose payload carries one more (zero) page and a block more tokens than it commits."""
    import dataclasses

    import torch

    pages = tuple(torch.cat([p, torch.zeros_like(p[:1])]) for p in handoff.payload.pool_pages)
    payload = dataclasses.replace(handoff.payload, num_tokens=handoff.payload.num_tokens + block_size, pool_pages=pages)
    return dataclasses.replace(handoff, payload=payload)


def _tampered(handoff, vocab, block_size):
    """Handoffs that contradict themselves or the receiving engine, each in one field, with the
    cause the refusal must name."""
    import dataclasses

    replace = lambda **kw: dataclasses.replace(handoff, **kw)  # noqa: E731
    return {
        "negative request index": (replace(index=-1), "index must be an int >= 0, got -1"),
        "fractional max_new_tokens": (replace(max_new_tokens=DISAGG_NEW + 0.5), "max_new_tokens must be an int"),
        "bool pending_draft_len": (replace(pending_draft_len=True), "pending_draft_len must be an int >= 0, got True"),
        # the pages past kv_len would be allocated beyond what the scheduler admitted
        "pages past the committed positions": (padded(handoff, block_size), "transferred tokens must both be"),
        "kv_len past the pages": (replace(kv_len=handoff.kv_len + 1), f"kv_len {handoff.kv_len + 1} and"),
        "kv_len short of the tokens": (replace(kv_len=handoff.kv_len - 1), f"kv_len {handoff.kv_len - 1} and"),
        "pending token outside the vocabulary": (replace(pending_inputs=handoff.pending_inputs[:-1] + [vocab]),
                                                 rf"token ids must be ints in \[0, {vocab}\), got \[{vocab}\]"),
        "negative prompt token": (replace(prompt=[-1] + handoff.prompt[1:]), r"got \[-1\]"),
        "more pending drafts than inputs": (replace(pending_draft_len=DISAGG_K + 1),
                                            rf"pending_draft_len {DISAGG_K + 1} not in \[0, {DISAGG_K}\]"),
        "pending input is not the last token": (replace(pending_inputs=[(handoff.output[-1] + 1) % vocab]
                                                        + handoff.pending_inputs[1:]),
                                                "is not the last emitted token"),
        "nothing emitted yet": (replace(output=[], kv_len=handoff.kv_len), "emitted tokens, got"),
        "no pending inputs": (replace(pending_inputs=[]),  # was named "-1 pending drafts"
                              f"no pending inputs, expected the last emitted token and {DISAGG_K} drafts"),
    }


def test_import_refuses_inconsistent_handoffs_and_stays_clean(tiny_pair, handoffs):
    from m3_eagle_plugin.parallel.disagg import import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    vocab = engine.vocab_size
    # first principles: the KV holds every prompt token and every emitted token but the last,
    # which is the first pending input (it is fed to the next verify step)
    for h in handoffs:
        assert h.kv_len == h.payload.num_tokens == len(h.prompt) + len(h.output) - 1
        assert h.pending_inputs[0] == h.output[-1]
    for name, (bad, cause) in _tampered(handoffs[0], vocab, engine.cache.block_size).items():
        with pytest.raises(HandoffError, match=cause):
            import_handoff(engine, bad)
            pytest.fail(f"accepted a handoff with {name}")
        assert _is_clean(engine), name
    request = import_handoff(engine, handoffs[0])  # the untouched handoff still imports
    assert engine.cache.num_tokens(request.rid) == handoffs[0].kv_len


def test_a_handoff_whose_index_is_live_is_refused_before_its_pages_move(tiny_pair, handoffs):
    """The receive check (`recv_handoff(engine=)` runs the same one) must catch it: failing at
    import would come after the pages crossed, and the wire would carry them for nothing."""
    from m3_eagle_plugin.parallel.disagg import _check_handoff, import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    first = import_handoff(engine, handoffs[0])
    held = (engine.cache.num_free_blocks, engine.scheduler.admitted_blocks, engine.cache.allocator.request_ids)
    with pytest.raises(HandoffError, match=f"request {handoffs[0].index} is already live"):
        _check_handoff(engine, handoffs[0])
    with pytest.raises(HandoffError, match="already live"):
        import_handoff(engine, handoffs[0])
    assert (engine.cache.num_free_blocks, engine.scheduler.admitted_blocks,
            engine.cache.allocator.request_ids) == held
    assert engine.cache.num_tokens(first.rid) == handoffs[0].kv_len
    engine.finish(first)  # once it is gone, the same index imports again
    assert import_handoff(engine, handoffs[0]).rid == handoffs[0].index


def test_send_handoff_refuses_a_bad_handoff_before_sending_anything(handoffs):
    """No process group exists here, so any message sent would raise about the group: the
    refusals must come first, or a peer gets the request's state with no (or a torn) payload."""
    import dataclasses

    from m3_eagle_plugin.kv.transfer import KVTransferPayload
    from m3_eagle_plugin.parallel.disagg import send_handoff

    h = handoffs[0]
    floats = KVTransferPayload(h.payload.fingerprint, h.payload.num_tokens,
                               tuple(p.float() for p in h.payload.pool_pages))
    with pytest.raises(ValueError, match="uint8"):
        send_handoff(dataclasses.replace(h, payload=floats), 1)
    with pytest.raises(TypeError, match="KVTransferPayload"):
        send_handoff(dataclasses.replace(h, payload=None), 1)
    with pytest.raises(TypeError):  # int64 on the wire would truncate 3.5 to 3 without a word
        send_handoff(dataclasses.replace(h, prompt=h.prompt[:-1] + [3.5]), 1)


def test_context_phase_refused_at_registration_leaves_no_request_behind(tiny_pair):
    # request id 1 is still held (say, an earlier batch's request not yet exported): registering
    # the new batch fails at its second prompt, and its first must not stay registered
    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    engine.cache.add_request(1)
    with pytest.raises(ValueError, match="already exists"):
        run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)
    assert engine.cache.allocator.request_ids == [1] and engine.scheduler.admitted_blocks == 0


def test_padded_handoff_cannot_take_the_pages_of_an_admitted_request(tiny_pair, handoffs):
    """A payload carrying pages past its committed positions holds more pages than its request
    was admitted for: here so many that the other request, admitted too, finds too few left."""
    from m3_eagle_plugin.parallel.disagg import import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    a, b = handoffs
    fat = a
    for _ in range(engine.cache.num_blocks - a.payload.num_pages - b.payload.num_pages + 1):
        fat = padded(fat, engine.cache.block_size)
    with pytest.raises(HandoffError, match="transferred tokens"):
        import_handoff(engine, fat)
    assert _is_clean(engine)
    request = import_handoff(engine, b)  # gets every page it was promised
    assert engine.cache.num_tokens(request.rid) == b.kv_len


def test_refusals_name_the_field_that_does_not_fit(tiny_pair, handoffs):
    """Each handoff here passes every other check (kv_len = prompt + output - 1 = transferred tokens,
    first pending input = last emitted token), so only the named check can refuse it."""
    import dataclasses

    from m3_eagle_plugin.parallel.disagg import import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    h = handoffs[0]
    assert len(h.prompt) >= 2 and len(h.pending_inputs) == 1 + DISAGG_K
    # one pending input too many: this engine verifies DISAGG_K drafts
    extra = dataclasses.replace(h, pending_inputs=h.pending_inputs + [h.pending_inputs[-1]])
    with pytest.raises(HandoffError, match=f"{DISAGG_K + 1} pending drafts, this engine verifies {DISAGG_K}"):
        import_handoff(engine, extra)
    assert _is_clean(engine)
    # the last prompt token counted as emitted: max_new_tokens tokens emitted, nothing left to generate
    output = [h.prompt[-1], *h.output]
    done = dataclasses.replace(h, prompt=h.prompt[:-1], output=output, max_new_tokens=len(output))
    assert len(done.prompt) + len(done.output) - 1 == h.kv_len
    with pytest.raises(HandoffError, match="1 to max_new_tokens - 1"):
        import_handoff(engine, done)
    assert _is_clean(engine)


def test_an_import_that_fails_after_admission_gives_the_budget_back(tiny_pair, handoffs):
    """The payload's page shapes are only checked by the page import, after the scheduler admitted
    the request: its admission must be released when the import refuses."""
    import dataclasses

    from m3_eagle_plugin.parallel.disagg import import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    h = handoffs[0]
    cut = dataclasses.replace(h.payload, pool_pages=tuple(p[:, :, :-1] for p in h.payload.pool_pages))
    with pytest.raises(ValueError, match="pages, expected"):
        import_handoff(engine, dataclasses.replace(h, payload=cut))
    assert _is_clean(engine)
    assert engine.cache.num_tokens(import_handoff(engine, h).rid) == h.kv_len


@pytest.mark.parametrize("dtype,draft,cause", [
    ("bfloat16", True, r'dtype \(payload "torch.float32", cache "torch.bfloat16"\); geometry.pools \(payload \[\[512, 18\], '
                       r'\[256, 5\]\], cache \[\[256, 18\], \[128, 5\]\]\)'),
    ("float32", False, r"geometry.draft_layers \(payload \[8\], cache \[\]\); .*geometry.pools \(payload \[\[512, 18\], "
                       r"\[256, 5\]\], cache \[\[512, 16\], \[256, 5\]\]\)"),
], ids=["another dtype", "no draft layer"])
def test_a_handoff_from_a_cache_of_another_geometry_is_refused_naming_what_differs(tiny_pair, handoffs, dtype, draft,
                                                                                  cause):
    """The page import printed both fingerprints whole (a thousand characters of JSON to compare by
    eye) as a GeometryMismatchError, after the request had been admitted. By hand, for the tiny
    checkpoint (8 layers, 2 KV heads of 16, blocks of 4, MSA from layer 3, one draft layer): a K or V
    page is 2 x 4 x 16 elements (512 bytes in float32), 8 target layers' K and V and the draft
    layer's make 18 sub-pages (16 without the head), an index-K page is 4 x 16 (256 bytes) in each
    of the 5 MSA layers."""
    import torch

    from m3_eagle_plugin.parallel.disagg import import_handoff

    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    proposer = None if draft else (lambda context: None)
    engine = build_engine(tiny_pair[0], tiny_pair[1] if draft else None, config, proposer=proposer,
                          num_blocks=blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4),
                          dtype=getattr(torch, dtype))
    with pytest.raises(HandoffError, match=rf"^request {handoffs[0].index}: the KV geometry differs from this "
                                           rf"cache's in {cause}"):
        import_handoff(engine, handoffs[0])
    assert _is_clean(engine)


def test_a_failed_continue_generation_keeps_the_outputs_of_the_requests_that_had_finished(tiny_pair, handoffs,
                                                                                            monkeypatch):
    """One batch slot: request 0 verifies to its end before request 1 starts, and request 1's first
    step fails. Request 0's output, the aggregated run's, rides on the exception; nothing is held."""
    from m3_eagle_plugin.parallel.disagg import continue_generation, import_handoff

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    aggregated = _engine(tiny_pair, blocks).generate(DISAGG_PROMPTS, DISAGG_NEW)
    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=1, max_tokens_per_step=64)
    engine = build_engine(tiny_pair[0], tiny_pair[1], config, num_blocks=blocks)
    requests = [import_handoff(engine, h) for h in handoffs]
    launch = engine.launch
    launched = []

    def launch_until_request_0_is_done(rows, step_id):
        if requests[0].done:
            raise RuntimeError("injected launch fault")
        launched.append(step_id)
        return launch(rows, step_id)

    monkeypatch.setattr(engine, "launch", launch_until_request_0_is_done)
    steps_before = engine.stats.engine_steps
    with pytest.raises(RuntimeError, match="injected launch fault") as caught:
        continue_generation(engine, requests)
    partial = caught.value.partial_result
    assert partial.outputs == [aggregated.outputs[0], []]
    assert partial.errors == [None, "engine stopped before the request finished"]
    assert partial.stop_reasons == ["length", None]
    assert partial.stats.engine_steps == steps_before + len(launched) > steps_before  # the steps that ran count
    assert _is_clean(engine)


def test_a_handoff_header_is_read_in_its_documented_layout():
    """`parallel.disagg`'s docstring: [index, max_new_tokens, kv_len, pending_draft_len, n_prompt,
    n_output, n_pending, prompt, output, pending_inputs, KV payload header body]."""
    from m3_eagle_plugin.parallel.disagg import _parse_handoff

    fingerprint = list(b'{"x":1}')
    payload_header = [6, 1, 2, 3, 8, len(fingerprint), *fingerprint]  # 6 tokens, 1 pool of [2, 3, 8]
    values = [9, 5, 6, 2, 4, 3, 3, 11, 12, 13, 14, 21, 22, 23, 23, 31, 32, *payload_header]
    handoff, header = _parse_handoff(values, "here")
    assert (handoff.index, handoff.max_new_tokens, handoff.kv_len, handoff.pending_draft_len) == (9, 5, 6, 2)
    assert handoff.prompt == [11, 12, 13, 14]
    assert handoff.output == [21, 22, 23]
    assert handoff.pending_inputs == [23, 31, 32]
    assert handoff.payload.num_tokens == header.num_tokens == 6 and handoff.payload.fingerprint == '{"x":1}'
    assert [tuple(p.shape) for p in handoff.payload.pool_pages] == [(2, 3, 8)]


def test_another_engines_request_is_refused_before_it_touches_this_engines_pages(tiny_pair, handoffs):
    """Both engines number from 0: exporting, continuing or freeing another engine's request 0 here
    would take (and free) the pages of this engine's own request 0."""
    from m3_eagle_plugin.parallel.disagg import continue_generation, import_handoff

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    context, generation = _engine(tiny_pair, blocks), _engine(tiny_pair, blocks)
    foreign = run_context_phase(context, DISAGG_PROMPTS[:1], DISAGG_NEW)[0]
    own = import_handoff(generation, handoffs[0])
    assert foreign.rid == own.rid
    held = (generation.cache.num_free_blocks, generation.scheduler.admitted_blocks,
            generation.cache.num_tokens(own.rid))
    with pytest.raises(HandoffError, match=r"export_handoff: requests \[0\] are not this engine's"):
        export_handoff(generation, foreign)
    with pytest.raises(HandoffError, match=r"continue_generation: requests \[0\] are not this engine's"):
        continue_generation(generation, [own, foreign])
    assert (generation.cache.num_free_blocks, generation.scheduler.admitted_blocks,
            generation.cache.num_tokens(own.rid)) == held
    assert foreign.state.value == "decode" and own.state.value == "decode"
    # each engine still serves its own request
    assert continue_generation(generation, [own]).outputs[0][:1] == handoffs[0].output[:1]
    assert export_handoff(context, foreign).kv_len == handoffs[0].kv_len and _is_clean(context)


def test_a_numpy_max_new_tokens_survives_the_handoff(tiny_pair):
    """A count read from an array is the int it is: the exported handoff carries it and another engine
    imports it (its check takes only ints)."""
    import numpy as np

    from m3_eagle_plugin.parallel.disagg import import_handoff

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    context, generation = _engine(tiny_pair, blocks), _engine(tiny_pair, blocks)
    request = run_context_phase(context, DISAGG_PROMPTS[:1], np.int64(DISAGG_NEW))[0]
    handoff = export_handoff(context, request)
    assert handoff.max_new_tokens == DISAGG_NEW
    imported = import_handoff(generation, handoff)
    assert imported.max_new_tokens == DISAGG_NEW and generation.owns(imported)


def test_engines_a_handoff_cannot_serve_are_refused_by_name(tiny_pair, handoffs):
    """Overlap (state not committed after a step) and sampling (draft probabilities and generators
    do not travel) are refused before anything is registered."""
    from m3_eagle_plugin.host.reference.sampler import SamplingParams
    from m3_eagle_plugin.parallel.disagg import import_handoff

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    for change, cause in (({"overlap": True}, "without overlap"),
                          ({"sampling": SamplingParams(temperature=0.7)}, "greedy sampling only")):
        config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64, **change)
        engine = build_engine(tiny_pair[0], tiny_pair[1], config, num_blocks=blocks)
        with pytest.raises(HandoffError, match=cause):
            run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)
        with pytest.raises(HandoffError, match=cause):
            import_handoff(engine, handoffs[0])
        assert _is_clean(engine)


def test_too_few_pending_drafts_are_refused_too(tiny_pair, handoffs):
    import dataclasses

    from m3_eagle_plugin.parallel.disagg import import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    short = dataclasses.replace(handoffs[0], pending_inputs=handoffs[0].pending_inputs[:-1])
    with pytest.raises(HandoffError, match=f"{DISAGG_K - 1} pending drafts, this engine verifies {DISAGG_K}"):
        import_handoff(engine, short)
    assert _is_clean(engine)


def test_a_handoff_that_fits_alone_but_not_beside_the_admitted_ones_is_refused_and_leaves_them_be(tiny_pair,
                                                                                                    handoffs):
    from m3_eagle_plugin.parallel.disagg import import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS[:1], DISAGG_NEW, DISAGG_K, 4))
    first = import_handoff(engine, handoffs[0])
    held = (engine.cache.num_free_blocks, engine.scheduler.admitted_blocks, engine.cache.allocator.request_ids)
    with pytest.raises(HandoffError, match=f"request {handoffs[1].index}: no KV budget left"):
        import_handoff(engine, handoffs[1])
    assert (engine.cache.num_free_blocks, engine.scheduler.admitted_blocks,
            engine.cache.allocator.request_ids) == held
    engine.finish(first)  # once the first is gone, the second fits
    assert engine.cache.num_tokens(import_handoff(engine, handoffs[1]).rid) == handoffs[1].kv_len


def test_only_a_committed_decoding_request_is_exported_and_it_ends_handed_off(tiny_pair):
    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4))
    done = run_context_phase(engine, DISAGG_PROMPTS[:1], 1)[0]
    decoding = run_context_phase(engine, DISAGG_PROMPTS[:1], DISAGG_NEW, first_index=1)[0]
    assert done.state.value == "finished"  # its one token came with the prefill
    with pytest.raises(HandoffError, match="request 0 is finished"):
        export_handoff(engine, done)
    decoding.inflight_steps = 1  # as if a launched step were not committed yet
    with pytest.raises(HandoffError, match="1 steps in flight"):
        export_handoff(engine, decoding)
    decoding.inflight_steps = 0
    export_handoff(engine, decoding)
    assert (decoding.state.value, decoding.stop_reason) == ("finished", "handed_off")


def test_a_refused_handoff_raises_handoff_error_on_the_sender_and_no_page_follows(handoffs, monkeypatch):
    import torch

    from m3_eagle_plugin.parallel.disagg import send_handoff

    from .test_transfer import DOC_MAGIC, DOC_VERSION, _Group, _recording_wire

    reason = list(b"request 0: no room")
    sent = _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 4, len(reason)]),
                                         torch.tensor(reason + [-DOC_MAGIC])])
    with pytest.raises(HandoffError, match="rank 1 refused the handoff of request 0: request 0: no room"):
        send_handoff(handoffs[0], 1, _Group())
    assert [frame[:3] for frame in sent[::2]] == [[DOC_MAGIC, DOC_VERSION, 3]] and len(sent) == 2  # the header only


def test_handoff_pages_that_cannot_be_staged_fail_before_the_header(handoffs, monkeypatch):
    from m3_eagle_plugin.parallel import disagg
    from m3_eagle_plugin.parallel.disagg import send_handoff

    from .test_transfer import assert_unstageable_pages_fail_before_the_header

    assert_unstageable_pages_fail_before_the_header(monkeypatch, disagg,
                                                    lambda group: send_handoff(handoffs[0], 1, group))


def test_a_request_listed_twice_is_refused_before_any_step_and_then_continues_alone(tiny_pair, handoffs):
    """Listed twice, a request took two verify rows a step over one page table and emitted other
    tokens than the aggregated run; it is refused by name with nothing changed, and then continues
    to the aggregated output."""
    from m3_eagle_plugin.parallel.disagg import continue_generation, import_handoff

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    aggregated = _engine(tiny_pair, blocks).generate(DISAGG_PROMPTS, DISAGG_NEW)
    engine = _engine(tiny_pair, blocks)
    first, second = (import_handoff(engine, h) for h in handoffs)
    held = (engine.cache.num_free_blocks, engine.scheduler.admitted_blocks, engine.cache.num_tokens(first.rid))
    with pytest.raises(HandoffError, match=r"continue_generation: requests \[0\] are listed more than once"):
        continue_generation(engine, [first, second, first])
    assert (engine.cache.num_free_blocks, engine.scheduler.admitted_blocks,
            engine.cache.num_tokens(first.rid)) == held
    assert first.state.value == second.state.value == "decode" and first.output == handoffs[0].output
    assert continue_generation(engine, [first, second]).outputs == aggregated.outputs
    assert _is_clean(engine)


def test_an_import_interrupted_while_copying_its_pages_gives_the_budget_back(tiny_pair, handoffs, monkeypatch):
    """Ctrl-C (not an Exception) in the page copy: the cache frees its pages itself, and the
    admission taken just before must go back too, or the engine could never admit that much again."""
    import torch

    from m3_eagle_plugin.parallel.disagg import import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS[:1], DISAGG_NEW, DISAGG_K, 4))

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "index_copy_", interrupted)
        with pytest.raises(KeyboardInterrupt):
            import_handoff(engine, handoffs[0])
    assert _is_clean(engine)
    assert engine.cache.num_tokens(import_handoff(engine, handoffs[0]).rid) == handoffs[0].kv_len


def test_an_import_that_fails_making_its_pending_inputs_leaves_no_request_behind(tiny_pair, handoffs, monkeypatch):
    """The pending inputs' device tensor was made after the pages landed: a failure there (Ctrl-C, a
    device error) left the pages, the budget and the id held by a request nobody got back, and the
    same handoff was then refused as already live."""
    import torch

    from m3_eagle_plugin.parallel.disagg import import_handoff

    engine = _engine(tiny_pair, blocks_for_prompts(DISAGG_PROMPTS[:1], DISAGG_NEW, DISAGG_K, 4))
    make = torch.tensor

    def interrupted(data, *args, **kwargs):
        if data is handoffs[0].pending_inputs:
            raise KeyboardInterrupt
        return make(data, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "tensor", interrupted)
        with pytest.raises(KeyboardInterrupt):
            import_handoff(engine, handoffs[0])
    assert _is_clean(engine)
    request = import_handoff(engine, handoffs[0])
    assert request.pending_inputs.tolist() == handoffs[0].pending_inputs


def test_requests_given_as_a_generator_run_to_the_aggregated_output(tiny_pair, handoffs):
    """The checks iterated a generator to its end, so the step loop saw no request: the call
    returned no output and left both requests live, holding their pages and budget."""
    from m3_eagle_plugin.parallel.disagg import continue_generation, import_handoff

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    aggregated = _engine(tiny_pair, blocks).generate(DISAGG_PROMPTS, DISAGG_NEW)
    engine = _engine(tiny_pair, blocks)
    requests = [import_handoff(engine, h) for h in handoffs]
    assert continue_generation(engine, (r for r in requests)).outputs == aggregated.outputs
    assert _is_clean(engine)


def test_an_export_interrupted_while_its_pages_go_back_can_be_exported_again(tiny_pair, handoffs, monkeypatch):
    """Ctrl-C in the context engine's page free, after the handoff was copied (here as its second page
    goes back): the request was already marked handed off, so the caller, who never got the handoff,
    could not export it again ("request 0 is finished") and its pages, id and budget stayed held; and
    the free cut off part-way left it listing fewer pages than its tokens. Exported again, it gives the
    same handoff, which a generation engine continues to the aggregated run's output."""
    import heapq

    from m3_eagle_plugin.parallel.disagg import continue_generation, import_handoff

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    aggregated = _engine(tiny_pair, blocks).generate(DISAGG_PROMPTS[:1], DISAGG_NEW)
    engine = _engine(tiny_pair, blocks)
    request = run_context_phase(engine, DISAGG_PROMPTS[:1], DISAGG_NEW)[0]
    assert len(engine.cache.pages(request.rid)) > 2
    push, pushes = heapq.heappush, []

    def interrupted_at_the_second_page(heap, page):
        pushes.append(page)
        if len(pushes) == 2:
            raise KeyboardInterrupt
        push(heap, page)

    with monkeypatch.context() as patch:
        patch.setattr(heapq, "heappush", interrupted_at_the_second_page)
        with pytest.raises(KeyboardInterrupt):
            export_handoff(engine, request)
    handoff = export_handoff(engine, request)
    assert (request.state.value, request.stop_reason) == ("finished", "handed_off")
    assert _is_clean(engine)
    assert handoff.output == handoffs[0].output and handoff.kv_len == handoffs[0].kv_len
    generation = _engine(tiny_pair, blocks)
    assert continue_generation(generation, [import_handoff(generation, handoff)]).outputs == aggregated.outputs
    assert _is_clean(generation)


def test_an_import_interrupted_at_any_line_after_its_pages_landed_leaves_the_engine_as_it_was(tiny_pair, handoffs,
                                                                                                monkeypatch):
    """Ctrl-C at each line `_import` runs once the pages are in (CPython raises it as a call such as
    list() returns): the pages, the id and the budget stayed held by a request the caller never got,
    and the same handoff was then refused as already live. Checked against a snapshot of the engine
    (another live request's page bytes included), then the handoff imports and continues to the
    aggregated run's output."""
    import sys

    import torch

    from m3_eagle_plugin.parallel import disagg
    from m3_eagle_plugin.parallel.disagg import continue_generation, import_handoff

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    aggregated = _engine(tiny_pair, blocks).generate(DISAGG_PROMPTS, DISAGG_NEW)
    engine = _engine(tiny_pair, blocks)
    other = import_handoff(engine, handoffs[1])

    def snapshot():
        cache = engine.cache
        pages = {rid: cache.pages(rid) for rid in cache.allocator.request_ids}
        data = [cache.storage(pool.pool_id)[torch.tensor(pages[other.rid])].clone() for pool in cache.geometry.pools]
        return (cache.num_free_blocks, engine.scheduler.admitted_blocks, pages), data

    before, before_data = snapshot()
    landed, at = [], []
    real_import = disagg.import_request
    monkeypatch.setattr(disagg, "import_request", lambda *args: (real_import(*args), landed.append(True))[0])

    def tracer(frame, event, arg):
        return local if frame.f_code is disagg._import.__code__ else None

    def local(frame, event, arg):
        if event == "line" and landed:
            at.append(frame.f_lineno)
            if len(at) == cut:
                raise KeyboardInterrupt
        return local

    cut, completed, outer = 0, None, sys.gettrace()
    while completed is None:
        cut += 1
        landed.clear(), at.clear()
        sys.settrace(tracer)
        try:
            completed = import_handoff(engine, handoffs[0])
        except KeyboardInterrupt:
            after, after_data = snapshot()
            assert after == before, f"cut off at line {at[-1]}"
            assert all(torch.equal(a, b) for a, b in zip(after_data, before_data))
        finally:
            sys.settrace(outer)
    assert cut > 3 and len(at) == cut - 1  # every line it runs after the pages landed was cut off once
    result = continue_generation(engine, [completed, other])
    assert result.outputs == aggregated.outputs
    assert _is_clean(engine)


def test_a_context_phase_interrupted_as_it_counts_its_time_leaves_the_engine_clean(tiny_pair, monkeypatch):
    """Ctrl-C as the phase's closing clock call returns (or, on a GPU, while it waits for the device):
    every prefilled request stayed registered with its pages and budget, the caller never got them, and
    the next batch with the same ids was refused as already live."""
    import types

    from m3_eagle_plugin.parallel import disagg

    blocks = blocks_for_prompts(DISAGG_PROMPTS, DISAGG_NEW, DISAGG_K, 4)
    engine = _engine(tiny_pair, blocks)
    calls = []

    def perf_counter():
        calls.append(None)
        if len(calls) == 2:  # the first is the phase's start
            raise KeyboardInterrupt
        return 0.0

    with monkeypatch.context() as patch:
        patch.setattr(disagg, "time", types.SimpleNamespace(perf_counter=perf_counter))
        with pytest.raises(KeyboardInterrupt):
            run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)
    assert len(calls) >= 2 and _is_clean(engine)
    requests = run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)
    assert [r.state.value for r in requests] == ["decode", "decode"]


@pytest.mark.parametrize("agree, error, cause", [
    ("tp", TypeError, "agree must be a torch.distributed ProcessGroup, got str"),
    (-100, ValueError, "this process is not a member of the agree process group"),  # new_group's non-member
])
def test_an_agree_group_this_process_cannot_vote_in_is_refused_before_any_message(agree, error, cause, monkeypatch):
    """Its peers would wait in the vote for this rank until their timeout."""
    import torch.distributed as dist

    from m3_eagle_plugin.parallel import transfer
    from m3_eagle_plugin.parallel.disagg import recv_handoff

    assert dist.GroupMember.NON_GROUP_MEMBER == -100
    monkeypatch.setattr(transfer, "_recv_frame", lambda *a: pytest.fail("a message was read"))
    with pytest.raises(error, match=cause):
        recv_handoff(0, object(), agree=agree)
