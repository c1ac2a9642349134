"""Bounded soak of the reference host: many requests of mixed lengths and random stop points,
with and without speculation. No KV block may leak, memory must stay flat from round to round,
and every output must equal what the request produces alone.

Two models: a prefix-hash target that reads its whole prefix back from the paged cache (cheap, so
150+ requests fit the CPU budget; any foreign or stale slot changes its output), and the tiny
MiniMax-M3 checkpoint from `make-tiny` with its Eagle3 head (fewer requests on CPU, more on GPU).
"""
from __future__ import annotations

import importlib
import gc
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ._counts import bump
from ._prefix_lm import NoisyOracle, PrefixHashLM

VOCAB = 48
EOS = (5, 17)  # each generated token stops its request with probability ~1/24: random stop points


def _host():
    engine = importlib.import_module("m3_eagle_plugin.host.reference.engine")
    kv = importlib.import_module("m3_eagle_plugin.kv")
    msa = importlib.import_module("m3_eagle_plugin.msa")
    return engine, kv, msa


@pytest.fixture
def one_thread():
    """The CI box has 2 shared cores: intra-op threads only add contention for these tiny ops."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 3, 5, 8, 13, 21]))] for _ in range(n)]


def _live_tensor_bytes() -> tuple[int, int]:
    gc.collect()
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    return len(tensors), sum(t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu")


def _prefix_engine(engine_mod, kv_mod, msa, *, speculative: bool, overlap: bool, num_blocks: int = 96):
    model = PrefixHashLM(VOCAB, msa)
    cache = kv_mod.PagedKVCache.for_minimax_m3(1, [], 1, 4, 4, 4, num_blocks, dtype=torch.float32)
    proposer = NoisyOracle(model, error_rate=0.35, seed=7) if speculative else None
    config = engine_mod.EngineConfig(draft_len=3 if speculative else 0, max_batch_size=8,
                                     max_tokens_per_step=40, overlap=overlap, eos_ids=EOS)
    engine = engine_mod.Engine(model, cache, config, vocab_size=VOCAB, proposer=proposer)
    return engine, model, cache, proposer


@pytest.mark.parametrize("speculative,overlap", [(False, False), (False, True), (True, False)],
                         ids=["plain", "overlap", "speculative"])
def test_prefix_model_soak(speculative, overlap, one_thread):
    engine_mod, kv_mod, msa = _host()
    engine, model, cache, proposer = _prefix_engine(engine_mod, kv_mod, msa, speculative=speculative, overlap=overlap)
    rng = random.Random(11)
    footprint = []
    for round_index in range(3):
        prompts = _prompts(50, seed=100 + round_index)
        max_new = rng.choice([6, 9, 12])
        result = engine.generate(prompts, max_new_tokens=max_new)
        assert all(e is None for e in result.errors), [e for e in result.errors if e]
        for i, (prompt, out) in enumerate(zip(prompts, result.outputs)):
            assert out == model.reference(prompt, max_new, EOS), f"round {round_index} request {i} differs when batched"
        assert cache.num_free_blocks == cache.num_blocks, f"round {round_index}: KV blocks leaked"
        assert not cache.allocator.request_ids, "finished requests are still known to the allocator"
        footprint.append(_live_tensor_bytes())
        bump("soak.requests", len(prompts))
        bump("soak.tokens", sum(len(o) for o in result.outputs))
    assert footprint[-1][0] <= footprint[0][0] + 16, f"live tensors grow round to round: {footprint}"
    assert footprint[-1][1] <= footprint[0][1] + (1 << 20), f"tensor memory grows round to round: {footprint}"
    stops = {len(o) for o in result.outputs}
    assert len(stops) > 2, "stop points are not mixed"
    if speculative:
        stats = result.stats
        assert stats.draft_tokens > 0 and 0 < stats.acceptance_rate < 1, "speculation did not exercise rejection"


def test_prefix_model_single_request_runs_match_the_reference(one_thread):
    """The cache-free reference used above is what the engine produces for a request alone."""
    engine_mod, kv_mod, msa = _host()
    for i, prompt in enumerate(_prompts(6, seed=3)):
        for speculative in (False, True):
            engine, model, cache, _ = _prefix_engine(engine_mod, kv_mod, msa, speculative=speculative, overlap=False)
            alone = engine.generate([prompt], max_new_tokens=10).outputs[0]
            assert alone == model.reference(prompt, 10, EOS), f"request {i} alone (speculative={speculative})"
            bump("soak.requests")


# ---- the tiny MiniMax-M3 checkpoint with its Eagle3 head ----

TINY_EOS = (3, 9, 27)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    tiny = importlib.import_module("m3_eagle_plugin.models.tiny")
    return tiny.make_tiny(tmp_path_factory.mktemp("soak_tiny"), seed=1)


def _engine_factory(dirs, device: str, num_blocks: int, batch: int):
    """Engines over the tiny checkpoint, assembled as `m3-eagle run` does (host/reference/build.py),
    but loading the checkpoints once."""
    engine_mod, kv_mod, _ = _host()
    loader = importlib.import_module("m3_eagle_plugin.models.loader")
    ckpt = importlib.import_module("m3_eagle_plugin.eagle3.checkpoint")
    capture_mod = importlib.import_module("m3_eagle_plugin.eagle3.capture")
    target = loader.load_target(dirs[0], device=device)
    head = ckpt.load_draft(dirs[1], target, device=device)
    c = target.config

    def make(speculative: bool, overlap: bool = False, cuda_graphs: bool = False):
        target.set_graph_safe_moe(cuda_graphs)
        config = engine_mod.EngineConfig(draft_len=3 if speculative else 0, max_batch_size=batch,
                                         max_tokens_per_step=48, overlap=overlap, cuda_graphs=cuda_graphs,
                                         eos_ids=TINY_EOS)
        cache = kv_mod.PagedKVCache.for_minimax_m3(
            c.num_layers, list(c.sparse_layer_ids), c.num_kv_heads, c.head_dim, c.index_dim, c.block_size,
            num_blocks, num_draft_layers=1 if speculative else 0, draft_num_kv_heads=head.config.num_kv_heads,
            dtype=torch.float32, device=device)
        return engine_mod.Engine(
            target, cache, config, vocab_size=c.vocab_size, device=device,
            head=head if speculative else None,
            capture=capture_mod.AuxCapture(head.config.aux_layer_ids) if speculative else None,
            num_index_heads=max(c.index_heads, 1))
    return make


def _tiny_soak(make, *, configs, num_requests: int, singles: int, vocab: int = 256):
    rng = random.Random(5)
    prompts = [[rng.randrange(vocab) for _ in range(rng.choice([1, 4, 7, 13, 18]))] for _ in range(num_requests)]
    max_new = 7
    outputs = {}
    for name, kwargs in configs.items():
        engine = make(**kwargs)
        result = engine.generate(prompts, max_new_tokens=max_new)
        assert all(e is None for e in result.errors), [e for e in result.errors if e]
        assert engine.cache.num_free_blocks == engine.cache.num_blocks, f"{name}: KV blocks leaked"
        outputs[name] = result.outputs
        bump("soak.requests", num_requests)
    for name, outs in outputs.items():
        assert outs == outputs["plain"], f"{name}: greedy outputs differ from plain batched decoding"
    plain = make(speculative=False)
    for i in range(singles):
        alone = plain.generate([prompts[i]], max_new_tokens=max_new).outputs[0]
        assert alone == outputs["plain"][i], f"request {i}: batched output differs from its single-request output"
        bump("soak.requests")
    assert plain.cache.num_free_blocks == plain.cache.num_blocks
    assert len({len(o) for o in outputs["plain"]}) > 1, "stop points are not mixed"


def test_tiny_m3_soak_cpu(tiny_dirs, one_thread):
    make = _engine_factory(tiny_dirs, "cpu", num_blocks=64, batch=6)
    configs = {"plain": dict(speculative=False), "eagle3": dict(speculative=True),
               "eagle3+overlap": dict(speculative=True, overlap=True)}
    _tiny_soak(make, configs=configs, num_requests=12, singles=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_m3_soak_gpu(tiny_dirs):
    make = _engine_factory(tiny_dirs, "cuda", num_blocks=1024, batch=16)
    configs = {"plain": dict(speculative=False), "eagle3": dict(speculative=True),
               "eagle3+overlap": dict(speculative=True, overlap=True),
               "eagle3+graphs": dict(speculative=True, cuda_graphs=True),
               "eagle3+overlap+graphs": dict(speculative=True, overlap=True, cuda_graphs=True)}
    torch.cuda.reset_peak_memory_stats()
    _tiny_soak(make, configs=configs, num_requests=120, singles=24)
    first_peak = torch.cuda.max_memory_allocated()
    _tiny_soak(make, configs={"plain": dict(speculative=False), "eagle3": dict(speculative=True)},
               num_requests=120, singles=0)
    assert torch.cuda.max_memory_allocated() <= first_peak * 1.05, "GPU memory grows from soak to soak"


# ---- faults under load: a step that raises must lose nothing and leave the engine usable ----

class _Flaky:
    """Wraps a model or proposer; the `fail_at`-th call raises."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def _tick(self) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"injected failure at call {self.calls}")

    def __call__(self, *args, **kwargs):
        self._tick()
        return self.inner(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._tick()
        return self.inner.forward(*args, **kwargs)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


@pytest.mark.parametrize("where,fail_at", [("target", 3), ("target", 11), ("proposer", 4)])
def test_a_failing_step_loses_no_blocks_and_the_engine_recovers(where, fail_at, one_thread):
    engine_mod, kv_mod, msa = _host()
    model = PrefixHashLM(VOCAB, msa)
    cache = kv_mod.PagedKVCache.for_minimax_m3(1, [], 1, 4, 4, 4, 96, dtype=torch.float32)
    flaky_model = _Flaky(model, fail_at) if where == "target" else model
    proposer = NoisyOracle(model, error_rate=0.3, seed=1)
    flaky_proposer = _Flaky(proposer, fail_at) if where == "proposer" else proposer
    config = engine_mod.EngineConfig(draft_len=3, max_batch_size=6, max_tokens_per_step=32, eos_ids=EOS)
    engine = engine_mod.Engine(flaky_model, cache, config, vocab_size=VOCAB, proposer=flaky_proposer)
    prompts = _prompts(20, seed=42)
    bump("faults.injected")
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.generate(prompts, max_new_tokens=8)
    assert cache.num_free_blocks == cache.num_blocks, "a failed step leaked KV blocks"
    assert not cache.allocator.request_ids, "a failed step left requests in the cache"
    result = engine.generate(prompts, max_new_tokens=8)  # the same engine, after the failure
    assert result.outputs == [model.reference(p, 8, EOS) for p in prompts]
    assert cache.num_free_blocks == cache.num_blocks
    bump("soak.requests", len(prompts))


def test_tiny_m3_never_reads_a_slot_it_does_not_own(tiny_dirs, one_thread):
    """Every cache slot starts as NaN: a read of any slot a request has not written (the tail of its
    last page, a freed page, another request's page) would turn its logits into NaN."""
    make = _engine_factory(tiny_dirs, "cpu", num_blocks=48, batch=4)
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 6, 13, 17, 3, 9)]
    for speculative in (False, True):
        clean = make(speculative=speculative).generate(prompts, max_new_tokens=6)
        engine = make(speculative=speculative)
        for pool in range(len(engine.cache.geometry.pools)):
            engine.cache.storage(pool).fill_(float("nan"))
        poisoned = engine.generate(prompts, max_new_tokens=6)
        assert poisoned.errors == clean.errors
        assert poisoned.outputs == clean.outputs, f"speculative={speculative}: a poisoned slot leaked into outputs"
        assert poisoned.stats.accepted_tokens == clean.stats.accepted_tokens
        bump("soak.requests", 2 * len(prompts))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_engine_shapes_keep_outputs_and_blocks(data):
    """Random batch sizes, step budgets (forcing chunked prefill), draft lengths and drafter error
    rates: outputs stay each request's own, and the cache returns to full."""
    engine_mod, kv_mod, msa = _host()
    draft_len = data.draw(st.integers(0, 3), label="draft_len")
    model = PrefixHashLM(VOCAB, msa)
    proposer = None
    if draft_len:
        proposer = NoisyOracle(model, error_rate=data.draw(st.sampled_from([0.0, 0.3, 1.0]), label="error"), seed=3)
    config = engine_mod.EngineConfig(
        draft_len=draft_len, max_batch_size=data.draw(st.integers(1, 6), label="batch"),
        max_tokens_per_step=data.draw(st.integers(1 + draft_len, 24), label="step budget"), eos_ids=EOS)
    cache = kv_mod.PagedKVCache.for_minimax_m3(1, [], 1, 4, 4, 4, data.draw(st.integers(24, 64), label="blocks"),
                                               dtype=torch.float32)
    engine = engine_mod.Engine(model, cache, config, vocab_size=VOCAB, proposer=proposer)
    prompts = data.draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=25),
                                 min_size=1, max_size=10), label="prompts")
    max_new = data.draw(st.integers(1, 8), label="max_new_tokens")
    result = engine.generate(prompts, max_new_tokens=max_new)
    # every request fits the cache alone (25 + 8 tokens + 4 x 3 + 1 draft headroom: at most 12 of >= 24
    # blocks), so none may fail: a wrongly refused request must not pass by being skipped
    assert result.errors == [None] * len(prompts), result.errors
    for i, (prompt, out) in enumerate(zip(prompts, result.outputs)):
        assert out == model.reference(prompt, max_new, EOS), f"request {i} differs"
    assert cache.num_free_blocks == cache.num_blocks, "KV blocks leaked"
    bump("soak.requests", len(prompts))
    bump("soak.random_engines")
