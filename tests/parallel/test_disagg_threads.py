"""Disaggregation helpers and `Engine.generate` on one engine from several threads.

Each helper that steps the engine or changes its requests holds the engine as `generate` does:
called from another thread while a generate runs, it waits for it; called from inside a running
generate (its progress callback), it is refused. Either way both finish with the tokens each
would give alone (fresh engines, run one at a time, are the oracle).
"""
import threading

import pytest

from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
from m3_eagle_plugin.host.reference.engine import EngineConfig
from m3_eagle_plugin.parallel.disagg import continue_generation, export_handoff, import_handoff, run_context_phase

from ._workers import DISAGG_K, DISAGG_NEW, DISAGG_PROMPTS

GENERATE_PROMPTS = [[3, 4, 5, 6, 3, 4], [9, 8, 7]]
HELD = 10  # the handed-off requests' first index: past generate's own request ids (0, 1)
STAGES = ["run_context_phase", "export_handoff", "import_handoff", "continue_generation"]


def _engine(tiny_pair, prompts):
    config = EngineConfig(draft_len=DISAGG_K, max_batch_size=2, max_tokens_per_step=64)
    return build_engine(tiny_pair[0], tiny_pair[1], config,
                        num_blocks=blocks_for_prompts(prompts, DISAGG_NEW, DISAGG_K, 4))


@pytest.fixture(scope="module")
def alone(tiny_pair):
    """Outputs of generate on fresh engines, one call at a time: {"generate": ..., "disagg": ...}."""
    return {name: _engine(tiny_pair, prompts).generate(prompts, DISAGG_NEW).outputs
            for name, prompts in (("generate", GENERATE_PROMPTS), ("disagg", DISAGG_PROMPTS))}


def _pipeline(engine):
    """The disaggregation stages on one engine (context and generation roles), in order: each
    takes what the one before returned."""
    return [
        lambda _: run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW, first_index=HELD),
        lambda requests: [export_handoff(engine, r) for r in requests],
        lambda handoffs: [import_handoff(engine, h) for h in handoffs],
        lambda requests: continue_generation(engine, requests),
    ]


def _run(stages, value=None):
    for stage in stages:
        value = stage(value)
    return value


def _assert_clean(engine):
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert engine.scheduler.admitted_blocks == 0 and not engine.cache.allocator.request_ids


@pytest.mark.parametrize("stage", range(len(STAGES)), ids=STAGES)
def test_a_helper_called_from_another_thread_waits_for_a_running_generate(tiny_pair, alone, stage):
    engine = _engine(tiny_pair, GENERATE_PROMPTS + DISAGG_PROMPTS)
    pipeline = _pipeline(engine)
    before = _run(pipeline[:stage])
    other: dict = {}

    def run_other():
        try:
            other["value"] = pipeline[stage](before)
        except BaseException as error:  # noqa: BLE001 - reported below
            other["error"] = error

    thread = threading.Thread(target=run_other)

    def progress(done, total):
        if "waited" not in other:
            thread.start()
            thread.join(0.5)  # refused or racing: back by now; serialized: still waiting
            other["waited"] = thread.is_alive()

    result = engine.generate(GENERATE_PROMPTS, DISAGG_NEW, progress=progress)
    thread.join(60)
    assert "error" not in other, f"{STAGES[stage]} failed: {other['error']!r}"
    assert other["waited"], f"{STAGES[stage]} ran while generate was in progress"
    assert result.outputs == alone["generate"]
    assert _run(pipeline[stage + 1:], other["value"]).outputs == alone["disagg"]
    _assert_clean(engine)


@pytest.mark.parametrize("stage", range(len(STAGES)), ids=STAGES)
def test_a_helper_called_from_inside_generate_is_refused_clearly(tiny_pair, alone, stage):
    engine = _engine(tiny_pair, GENERATE_PROMPTS + DISAGG_PROMPTS)
    pipeline = _pipeline(engine)
    before = _run(pipeline[:stage])
    refused = []

    def progress(done, total):
        if not refused:
            with pytest.raises(RuntimeError, match=f"{STAGES[stage]} cannot run while Engine.generate is already "
                                                   "running on this thread"):
                pipeline[stage](before)
            refused.append(True)

    result = engine.generate(GENERATE_PROMPTS, DISAGG_NEW, progress=progress)
    assert refused
    assert result.outputs == alone["generate"]
    assert _run(pipeline[stage:], before).outputs == alone["disagg"]  # the refused call changed nothing
    _assert_clean(engine)


def test_an_import_waiting_for_generate_checks_the_handoff_once_it_holds_the_engine(tiny_pair, alone):
    """The handoffs are numbered from 0, like generate's own requests: while generate runs, request 0
    is live, so the import must wait (checking the index only once it holds the engine) and then
    succeed, not be refused for an index that is free by the time its pages land."""
    engine = _engine(tiny_pair, GENERATE_PROMPTS + DISAGG_PROMPTS)
    handoffs = [export_handoff(engine, r) for r in run_context_phase(engine, DISAGG_PROMPTS, DISAGG_NEW)]
    assert handoffs[0].index == 0
    other: dict = {}

    def run_other():
        try:
            other["value"] = [import_handoff(engine, h) for h in handoffs]
        except BaseException as error:  # noqa: BLE001 - reported below
            other["error"] = error

    thread = threading.Thread(target=run_other)

    def progress(done, total):
        if "waited" not in other:
            assert 0 in engine.cache.allocator  # generate's request 0 holds the index
            thread.start()
            thread.join(0.5)
            other["waited"] = thread.is_alive()

    result = engine.generate(GENERATE_PROMPTS, DISAGG_NEW, progress=progress)
    thread.join(60)
    assert "error" not in other, f"import_handoff failed: {other['error']!r}"
    assert other["waited"]
    assert result.outputs == alone["generate"]
    assert continue_generation(engine, other["value"]).outputs == alone["disagg"]
    _assert_clean(engine)
