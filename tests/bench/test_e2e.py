"""The end-to-end bench section on CPU (tiny shape, eager): its rows, forced fractional acceptance
against a naive step count, the speed-up as the ratio of the two measured rates, the target-only
fixed-shape step against the engine's eager path, and the `m3-eagle bench --e2e` wiring."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.bench import e2e
from m3_eagle_plugin.cli import main as m3_main

SMALL = replace(e2e.CPU_SHAPE, prompt_len=9, new_tokens=12)


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return e2e.build_random_models(SMALL, torch.device("cpu"), torch.float32, seed=3)


def naive_steps(new_tokens: int, counts) -> int:
    """Target steps to emit new_tokens: one prompt step (first token), then verify steps emitting
    accepted + 1 tokens each, accepted following `counts` (a plain loop, no engine)."""
    emitted, steps = 1, 1
    counts = iter(counts)
    while emitted < new_tokens:
        emitted += next(counts) + 1
        steps += 1
    return steps


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def engine(models, *, speculate: bool, batch: int, shape=SMALL, graphs: bool = False):
    target, head = models
    return e2e._engine(target, head, shape, speculate=speculate, batch=batch,
                       prompts=prompts(batch, shape.prompt_len, shape.vocab), device=torch.device("cpu"),
                       dtype=torch.float32, graphs=graphs)


def test_forced_two_and_a_half_takes_fewer_target_steps(models):
    batch = 3
    spec = e2e.measure_decode(engine(models, speculate=True, batch=batch), prompts(batch, 9, 256), 12)
    plain = e2e.measure_decode(engine(models, speculate=False, batch=batch), prompts(batch, 9, 256), 12)
    assert spec.generated_total == plain.generated_total == batch * 12
    assert plain.engine_steps == naive_steps(12, [0] * 20) == 12
    assert spec.engine_steps == naive_steps(12, [2, 3] * 10) == 5  # 1 + 3, 4, 3, 4 tokens
    # window: first token -> the last step before a request finishes that closes a whole period of
    # the schedule (accepted 2, 3 -> 3, 4 tokens; the third step, accepted 2, would leave it at 10 / 3)
    assert (spec.tokens, spec.verify_steps, spec.accepted) == (batch * 7, batch * 2, batch * 5)
    assert spec.mean_acceptance_length == 3.5
    assert plain.mean_acceptance_length == 1.0 and plain.tokens == batch * 10


@pytest.mark.parametrize("mean, period", [(2.5, 2), (1.25, 4), (2.0, 1)])
@pytest.mark.parametrize("batch", [1, 2])
def test_the_window_runs_at_the_asked_mean(models, mean, period, batch):
    """The issue's e2e row is Eagle3 "under forced acceptance length 3.5": the timed window must hold
    whole periods of the schedule (any `period` steps of it force `period * mean` drafts, counted by
    hand: 2 + 3, 1 + 1 + 1 + 2, 2). At 12 new tokens and 2.5 the last step before a request finished
    was the third (accepted 2, 3, 2: 10 / 3), as `m3-eagle bench --e2e`'s CPU shape reported."""
    for new_tokens in range(11, 18):
        shape = replace(SMALL, forced_mean=mean, new_tokens=new_tokens)
        m = e2e.measure_decode(engine(models, speculate=True, batch=batch, shape=shape),
                               prompts(batch, 9, 256), new_tokens)
        assert m.verify_steps % (batch * period) == 0, new_tokens
        assert m.accepted * 4 == m.verify_steps * round(mean * 4), new_tokens
        assert m.mean_acceptance_length == 1 + mean, new_tokens


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.sampled_from([0.5, 1.5, 2.5, 2.0, 1.25]), st.integers(4, 14))
def test_target_steps_follow_the_forced_schedule(models, mean, new_tokens):
    shape = replace(SMALL, forced_mean=mean, new_tokens=new_tokens)
    run = engine(models, speculate=True, batch=1, shape=shape).generate(prompts(1, 9, 256), new_tokens)
    whole, frac = int(mean), mean - int(mean)
    counts = [int((s + 1) * mean) - int(s * mean) for s in range(new_tokens)]  # floor-running schedule
    assert all(c in (whole, whole + (frac > 0)) for c in counts)
    assert run.stats.engine_steps == naive_steps(new_tokens, counts)
    assert len(run.outputs[0]) == new_tokens


def test_target_only_fixed_shape_step_matches_eager(models):
    eager = engine(models, speculate=False, batch=3)
    staged = engine(models, speculate=False, batch=3)
    staged.runner.graphs = e2e.TargetOnlyGraphs(staged.runner, capture=False)
    a = eager.generate(prompts(3, 9, 256), 7)
    b = staged.generate(prompts(3, 9, 256), 7)
    assert a.outputs == b.outputs and all(len(o) == 7 for o in a.outputs)
    assert 3 in staged.runner.graphs.buckets
    assert staged.cache.num_free_blocks == staged.cache.num_blocks
    with pytest.raises(ValueError, match="draft_len 0"):
        e2e.TargetOnlyGraphs(engine(models, speculate=True, batch=1).runner, capture=False)
    with pytest.raises(ValueError, match="CUDA"):
        e2e.TargetOnlyGraphs(eager.runner)


def test_fixed_shape_eagle3_step_keeps_the_forced_schedule(models):
    from m3_eagle_plugin.host.reference.cuda_graphs import GenerationGraphs

    eager = engine(models, speculate=True, batch=2)
    staged = engine(models, speculate=True, batch=2)
    staged.runner.graphs = GenerationGraphs(staged.runner, capture=False)
    a = eager.generate(prompts(2, 9, 256), 12)
    b = staged.generate(prompts(2, 9, 256), 12)
    assert a.outputs == b.outputs
    assert a.stats.engine_steps == b.stats.engine_steps == naive_steps(12, [2, 3] * 10)
    assert b.stats.accepted_tokens == 2 * (2 + 3 + 2 + 3)


def test_rows_report_both_modes_and_the_measured_speedup():
    shape = replace(e2e.CPU_SHAPE, batches=(1, 4))
    rows = e2e.run_e2e(shape, "cpu", seed=1)
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "no_spec"), (1, "eagle3"), (4, "no_spec"), (4, "eagle3")]
    for plain, spec in (rows[0:2], rows[2:4]):
        assert plain["speedup"] == 1.0 and plain["mean_acceptance_length"] == 1.0
        assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / plain["tokens_per_s"])
        assert plain["tokens_per_s"] > 0 and spec["tokens_per_s"] > 0
        assert 3.0 <= spec["mean_acceptance_length"] <= 4.0
        assert spec["generated_tokens"] == plain["generated_tokens"] == plain["batch"] * shape.new_tokens
        assert spec["engine_steps"] < plain["engine_steps"]
        assert spec["decode_steps"] < plain["decode_steps"]
        assert plain["cuda_graphs"] is False and spec["draft_len"] == 3


def test_overlapped_loop_gives_the_same_tokens_and_schedule():
    shape = replace(e2e.CPU_SHAPE, batches=(2,), repeats=1)
    plain, overlapped = (e2e.run_e2e(replace(shape, overlap=o), "cpu", seed=3) for o in (False, True))
    assert [r["overlap"] for r in overlapped] == [True, True] and [r["overlap"] for r in plain] == [False, False]
    for a, b in zip(plain, overlapped):
        assert (a["mode"], a["generated_tokens"], a["mean_acceptance_length"]) == (
            b["mode"], b["generated_tokens"], b["mean_acceptance_length"])
    ns = argparse.Namespace(e2e_batches=None, e2e_overlap=True)
    assert e2e.shape_from_args(ns, torch.device("cpu")).overlap is True


def test_random_model_stays_finite_in_bfloat16():
    shape = replace(e2e.CPU_SHAPE, hidden=256, q_heads=8, num_experts=8, experts_per_tok=2, prompt_len=24,
                    new_tokens=4, batches=(2,))
    target, head = e2e.build_random_models(shape, torch.device("cpu"), torch.bfloat16)
    assert head.embed_tokens is target.embed_tokens and head.lm_head is target.lm_head
    assert target.layers[5].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    finite = []
    target.norm.register_forward_hook(lambda mod, inp, out: finite.append(bool(torch.isfinite(inp[0]).all())))
    run = e2e._engine(target, head, shape, speculate=True, batch=2, prompts=prompts(2, 24, 256),
                      device=torch.device("cpu"), dtype=torch.bfloat16, graphs=False)
    run.generate(prompts(2, 24, 256), 4)
    assert finite and all(finite)


def test_shape_and_argument_errors_name_the_cause():
    with pytest.raises(ValueError, match="forced_mean"):
        replace(e2e.CPU_SHAPE, forced_mean=3.5)
    with pytest.raises(ValueError, match="batches"):
        replace(e2e.CPU_SHAPE, batches=(0,))
    with pytest.raises(ValueError, match="--e2e-batches"):
        e2e.shape_from_args(argparse.Namespace(e2e_batches="1,x"), torch.device("cpu"))
    for empty in ("", ",", " "):  # given but naming no batch: refused, not replaced by the defaults
        with pytest.raises(ValueError, match="--e2e-batches: no batch size"):
            e2e.shape_from_args(argparse.Namespace(e2e_batches=empty), torch.device("cpu"))
    shape = e2e.shape_from_args(argparse.Namespace(e2e_batches="2", e2e_tokens=6, e2e_hidden=None),
                                torch.device("cpu"))
    assert shape.batches == (2,) and shape.new_tokens == 6 and shape.hidden == e2e.CPU_SHAPE.hidden


@pytest.mark.parametrize("fields, match", [
    ({"draft_len": 0, "forced_mean": 0.0}, "^draft_len must be >= 1"),  # ran an "eagle3" row verifying no drafts
    ({"draft_len": -1, "forced_mean": 0.0}, "^draft_len must be >= 1"),  # was blamed on forced_mean
    ({"repeats": 2.5}, "^repeats must be an int"),  # a TypeError after both warm-up runs
    ({"new_tokens": 12.5}, "^new_tokens must be an int"),  # named the engine's max_seq_len
    ({"dense_layers": -1}, "dense_layers"),  # named the config's moe_layer_freq
    ({"batches": (1, 1)}, "given twice"),  # ran and reported batch 1 twice
    ({"batches": (1.5,)}, "^batches must be an int"),  # failed in the prompts' manual_seed
    ({"forced_mean": 1e-9}, "^forced_mean: .*resolution"),  # named the engine's force_accepted
    ({"forced_mean": True}, "^forced_mean: "),
])
def test_a_shape_the_comparison_cannot_use_is_refused_naming_the_field(fields, match):
    """`E2EShape` checks its fields: each of these was accepted and failed part-way through the run
    (on a GPU: after the kernel section) naming another object's field, or ran a meaningless row."""
    with pytest.raises(ValueError, match=match):
        replace(e2e.CPU_SHAPE, **fields)
    assert replace(e2e.CPU_SHAPE, batches=[2, 1]).batches == (2, 1)  # a list is kept as the tuple it types


@pytest.mark.parametrize("option, dest", [("--e2e-hidden", "e2e_hidden"), ("--e2e-tokens", "e2e_tokens"),
                                          ("--e2e-context", "e2e_context"), ("--e2e-batches", "e2e_batches")])
def test_a_size_past_int32_is_refused_naming_the_option(option, dest):
    """10**20 passed every check and raised an overflow traceback (TypeError, ValueError or
    OverflowError) mid-run, after the kernel section; 2**31 - 1 (an int32) is still accepted."""
    huge = 10**20
    with pytest.raises(ValueError, match=f"^{option} {huge}: .*<= {2**31 - 1}"):
        e2e.shape_from_args(argparse.Namespace(**{dest: str(huge) if dest == "e2e_batches" else huge}),
                            torch.device("cpu"))
    edge = 2**31 - 1
    shape = e2e.shape_from_args(argparse.Namespace(**{dest: str(edge) if dest == "e2e_batches" else edge}),
                                torch.device("cpu"))
    assert edge in (shape.hidden, shape.new_tokens, shape.prompt_len, *shape.batches)


def test_bench_cli_prints_the_end_to_end_rows(capsys):
    rc = m3_main(["bench", "--device", "cpu", "--configs", "1x16", "--qo-lens", "1", "--e2e",
                  "--e2e-batches", "1", "--e2e-tokens", "12", "--e2e-context", "9"])
    assert rc == 0
    blocks = [b.splitlines() for b in capsys.readouterr().out.strip().split("\n\n")]
    e2e_block = next(b for b in blocks if any(line.split()[:1] == ["end_to_end"] for line in b))
    header = e2e_block[0].split()
    e2e_lines = [line.split() for line in e2e_block if line.split()[:1] == ["end_to_end"]]
    assert len(e2e_lines) == 2
    assert {"tokens_per_s", "mean_acceptance_length", "speedup", "mode"} <= set(header)


@pytest.mark.parametrize("speculate", [False, True])
def test_window_starts_only_when_every_request_decodes(models, speculate):
    """Prompts longer than a step's token budget prefill one after another while earlier requests
    already decode; the timed window must hold decode steps only: no first token inside it."""
    shape = replace(SMALL, prompt_len=30, new_tokens=20, max_tokens_per_step=32)
    batch = 3
    m = e2e.measure_decode(engine(models, speculate=speculate, batch=batch, shape=shape),
                           prompts(batch, shape.prompt_len, shape.vocab), shape.new_tokens)
    assert m.tokens == m.verify_steps + m.accepted  # every token in the window came from a verify step
    assert m.verify_steps % batch == 0  # full-batch steps only


def test_all_decoding_counts_first_tokens():
    from m3_eagle_plugin.host.reference.stats import SpecStats

    early = SpecStats(draft_len=3, generated_tokens=1 + 4 * 3, verify_steps=4, accepted_tokens=8)  # 1 request of 3
    assert not e2e.all_decoding(early, 3)
    assert e2e.all_decoding(SpecStats(draft_len=3, generated_tokens=3 + 8, verify_steps=2, accepted_tokens=6), 3)


def test_a_run_too_short_to_time_is_an_option_error_not_a_traceback(tmp_path, capsys):
    """At 4 new tokens the Eagle3 run ends in its first verify step (1 + 3 or 4 tokens): there is no
    full-batch decode window to time, which only the run itself finds; it raised ValueError out of
    `m3-eagle bench`, a traceback, and the JSON asked for was not written either way."""
    out = tmp_path / "bench.json"
    rc = m3_main(["bench", "--device", "cpu", "--configs", "1x16", "--qo-lens", "1", "--kernels", "", "--e2e",
                  "--e2e-batches", "1", "--e2e-tokens", "4", "--e2e-context", "9", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "m3-eagle bench: --e2e: no full-batch decode window" in err and "--e2e-tokens" in err
    assert not out.exists()


def test_decode_measurement_rates_by_hand():
    m = e2e.DecodeMeasurement(tokens=30, verify_steps=10, accepted=20, seconds=2.0, generated_total=99,
                              engine_steps=12)
    assert m.tokens_per_s == 15.0  # window tokens over window seconds
    assert m.mean_acceptance_length == 3.0  # (20 accepted + 10 bonus) / 10 verify steps
    assert e2e.DecodeMeasurement(0, 0, 0, 0.0, 0, 0).tokens_per_s == 0.0


def _scripted_engines(monkeypatch):
    """No models: each engine is its (batch, speculate) key, for a scripted `measure_decode`."""
    monkeypatch.setattr(e2e, "build_random_models",
                        lambda shape, device, dtype, seed=0: (argparse.Namespace(set_graph_safe_moe=lambda on: None),
                                                              None))
    monkeypatch.setattr(e2e, "_engine", lambda target, head, shape, *, speculate, batch, **kw: (batch, speculate))


def test_rows_take_the_median_of_the_repeats_and_the_goal_is_inclusive(monkeypatch):
    """run_e2e's arithmetic on scripted measurements: the median tokens/s of the repeats (not the
    best), speed-up = Eagle3 median / no-spec median, decode_steps per request, the batch-1 goal met
    at exactly 2.5x."""
    rates = {(1, False): [100.0, 10.0, 40.0], (1, True): [100.0, 30.0, 400.0],
             (2, False): [50.0, 60.0, 70.0], (2, True): [70.0, 80.0, 90.0]}
    calls = {key: 0 for key in rates}

    _scripted_engines(monkeypatch)

    def measure(engine, prompts, max_new_tokens):
        batch, spec = engine
        i = calls[engine]
        calls[engine] += 1
        rate = 1.0 if i == 0 else rates[engine][i - 1]  # call 0: the warm-up
        return e2e.DecodeMeasurement(tokens=int(rate), verify_steps=6 * batch, accepted=12 * batch if spec else 0,
                                     seconds=1.0, generated_total=8 * batch, engine_steps=9)

    monkeypatch.setattr(e2e, "measure_decode", measure)
    shape = replace(e2e.CPU_SHAPE, batches=(1, 2), repeats=3)
    rows = e2e.run_e2e(shape, "cpu", graphs=True)
    by = {(r["batch"], r["mode"]): r for r in rows}
    assert by[(1, "no_spec")]["tokens_per_s"] == 40.0 and by[(1, "eagle3")]["tokens_per_s"] == 100.0
    assert by[(1, "eagle3")]["speedup"] == 2.5 and by[(1, "no_spec")]["speedup"] == 1.0
    assert by[(1, "eagle3")]["note"] == "goal >= 2.5x at batch 1: met"
    assert by[(2, "eagle3")]["speedup"] == 80.0 / 60.0
    assert by[(2, "eagle3")]["decode_steps"] == 6 and by[(2, "no_spec")]["decode_steps"] == 6
    assert by[(2, "eagle3")]["mean_acceptance_length"] == 3.0 and by[(2, "no_spec")]["mean_acceptance_length"] == 1.0
    assert all(n == 4 for n in calls.values())  # one warm-up + three timed runs per mode and batch


def test_forced_mean_may_equal_the_draft_length():
    assert replace(e2e.CPU_SHAPE, forced_mean=3.0).forced_mean == 3.0
    with pytest.raises(ValueError, match="forced_mean"):
        replace(e2e.CPU_SHAPE, forced_mean=-0.5)


def test_options_given_lists_only_the_options_set():
    ns = argparse.Namespace(device="cpu", e2e_hidden=None, e2e_tokens=8, e2e_batches=None, e2e_overlap=False)
    assert e2e.options_given(ns) == ["--e2e-tokens"]
    ns.e2e_overlap = True
    assert e2e.options_given(ns) == ["--e2e-tokens", "--e2e-overlap"]


@pytest.mark.parametrize("failure", [e2e.NoDecodeWindowError("no full-batch decode window"),
                                     MemoryError("cannot allocate")])
def test_a_failed_batch_keeps_the_rows_of_the_batches_before_it(failure, tmp_path, monkeypatch, capsys):
    """Batch 1 measured (both modes), then batch 16 has no decode window or runs out of memory: the
    whole section raised and batch 1's rows, measured and logged, were neither printed nor written
    (on a GPU: minutes of measurement)."""
    _scripted_engines(monkeypatch)

    def measure(engine, prompts, max_new_tokens):
        batch, spec = engine
        if batch == 16:
            raise failure
        return e2e.DecodeMeasurement(tokens=7 if spec else 2, verify_steps=2, accepted=5 if spec else 0,
                                     seconds=1.0, generated_total=12, engine_steps=5 if spec else 12)

    monkeypatch.setattr(e2e, "measure_decode", measure)
    out = tmp_path / "bench.json"
    rc = m3_main(["bench", "--device", "cpu", "--kernels", "", "--e2e", "--e2e-batches", "1,16", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.splitlines()[-1].startswith("m3-eagle bench: ")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["section"], r["batch"], r["mode"], r["tokens_per_s"]) for r in rows] == [
        ("end_to_end", 1, "no_spec", 2.0), ("end_to_end", 1, "eagle3", 7.0)]
    assert rows[1]["mean_acceptance_length"] == 3.5 and rows[1]["speedup"] == 3.5
    assert [line.split()[:3] for line in captured.out.splitlines()[2:]] == [["end_to_end", "e2e", "1"]] * 2


@pytest.mark.parametrize("dest", ["e2e_hidden", "e2e_tokens", "e2e_context", "e2e_batches"])
def test_a_size_of_exactly_2_to_the_31_is_past_int32(dest):
    """2**31 is the first value an int32 cannot hold: refused like 10**20, naming the option."""
    value = 2**31
    option = "--" + dest.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{option} {value}: .*<= {2**31 - 1}"):
        e2e.shape_from_args(argparse.Namespace(**{dest: str(value) if dest == "e2e_batches" else value}),
                            torch.device("cpu"))


def test_a_shape_of_hidden_zero_is_refused_naming_hidden():
    with pytest.raises(ValueError, match="^hidden must be >= 1, got 0"):
        replace(e2e.CPU_SHAPE, hidden=0)


def test_bench_end_to_end_on_cpu_gives_back_the_thread_count(monkeypatch):
    """The CPU shape runs on one thread; the caller's torch thread count is restored after the run,
    and after a failed one."""
    seen = []

    def fake_run(shape, device, log=None):
        seen.append(torch.get_num_threads())
        if len(seen) == 2:
            raise MemoryError("cannot allocate")
        return []

    monkeypatch.setattr(e2e, "run_e2e", fake_run)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = argparse.Namespace(device="cpu")
        assert e2e.bench_end_to_end(args) == [] and torch.get_num_threads() == 2
        with pytest.raises(MemoryError):
            e2e.bench_end_to_end(args)
        assert torch.get_num_threads() == 2 and seen == [1, 1]
    finally:
        torch.set_num_threads(before)


def test_only_the_batch_1_eagle3_row_carries_the_goal_note(monkeypatch):
    """The speed-up goal is stated for batch 1 (SPEEDUP_GOAL_BATCH1): other batches' rows, and the
    no-spec rows, carry no goal note; a no-spec row reports draft_len 0 (its engine drafts nothing)."""
    _scripted_engines(monkeypatch)
    monkeypatch.setattr(e2e, "measure_decode", lambda engine, prompts, n: e2e.DecodeMeasurement(
        tokens=10 if engine[1] else 4, verify_steps=2 * engine[0], accepted=0, seconds=1.0, generated_total=8,
        engine_steps=5))
    rows = e2e.run_e2e(replace(e2e.CPU_SHAPE, batches=(1, 2, 16), repeats=1), "cpu", graphs=True)
    assert [(r["batch"], r["mode"]) for r in rows if "note" in r] == [(1, "eagle3")]
    assert [(r["mode"], r["draft_len"]) for r in rows] == [("no_spec", 0), ("eagle3", 3)] * 3  # no-spec drafts none


def test_a_step_budget_below_a_full_batchs_verify_rows_still_decodes_the_whole_batch(models):
    """`max_tokens_per_step` 6 is less than 3 requests x (3 drafts + 1): the engine's budget is
    raised to a full batch's verify rows, so every decode step in the window holds every request."""
    shape = replace(SMALL, max_tokens_per_step=6, new_tokens=30)
    m = e2e.measure_decode(engine(models, speculate=True, batch=3, shape=shape),
                           prompts(3, shape.prompt_len, shape.vocab), shape.new_tokens)
    assert m.verify_steps % 3 == 0 and m.mean_acceptance_length == 3.5


def test_a_window_without_a_verify_step_reports_no_acceptance_length(tmp_path, monkeypatch, capsys):
    """No verify step in the window: no acceptance was measured. It was reported as 0.0, a measured
    value below the least possible (1.0: the bonus token); the reference host's `SpecStats` says None
    there, and so does the bench now: JSON null, "-" in the table, every other field kept."""
    assert e2e.DecodeMeasurement(tokens=4, verify_steps=0, accepted=0, seconds=1.0, generated_total=8,
                                 engine_steps=3).mean_acceptance_length is None
    _scripted_engines(monkeypatch)
    monkeypatch.setattr(e2e, "measure_decode", lambda engine, prompts, n: e2e.DecodeMeasurement(
        tokens=7 if engine[1] else 2, verify_steps=2 if engine[1] else 0, accepted=5 if engine[1] else 0,
        seconds=1.0, generated_total=12, engine_steps=5))
    out = tmp_path / "bench.json"
    rc = m3_main(["bench", "--device", "cpu", "--kernels", "", "--e2e", "--e2e-batches", "1", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["mean_acceptance_length"], r["tokens_per_s"], r["speedup"], r["decode_steps"])
            for r in rows] == [("no_spec", None, 2.0, 1.0, 0), ("eagle3", 3.5, 7.0, 3.5, 2)]
    assert "e2e batch 1 no_spec: 2.0 tok/s, AL -, speed-up 1.00x" in captured.err
    header, _, *lines = captured.out.splitlines()[-4:]
    end = header.index("mean_acceptance_length") + len("mean_acceptance_length")  # right-aligned cells
    assert [line[end - len("mean_acceptance_length"):end].strip() for line in lines] == ["-", "3.50"]
