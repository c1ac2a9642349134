"""End-to-end section of `m3-eagle bench`: reference-host decode throughput with and without Eagle3.

Why: the kernel suite times pieces; this times what a user gets. A random MiniMax-M3-shaped model
(one rank's geometry: 16 q heads, 1 KV head, head dim 128, 1 index head of dim 128, block 128,
top-16; 3 dense + 5 sparse MoE layers) and a random Eagle3 head are built in memory, and the
reference host decodes the same prompts twice per batch size, side by side: target only, and
Eagle3 under forced acceptance (a random head would accept nothing, so acceptance is forced to a
mean of 2.5 drafts per verify step = mean acceptance length 3.5 at draft_len 3). On CUDA both
modes replay their decode steps from CUDA graphs; on CPU a tiny shape runs eagerly so CI can
exercise the path. Under CUDA graphs the host's MoE runs every expert on every token (no host
sync), so expert weights are read whole at any batch: speculation's gain here is that of a
weight-bound model, an upper bound for routed top-k experts.

Only full-batch decode is timed: from the first commit after which every request has its first
token to the last commit before any request finishes (the scheduler runs decode rows first, so
requests prefilled early start generating while later prompts prefill; each commit reads results
back, so the clock sees finished device work), cut to whole periods of the forced schedule (2.5
forces 2, 3, 2, 3, ...: an even number of verify steps), so the window runs at the asked mean.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from m3_eagle_plugin._ints import as_int
from m3_eagle_plugin.eagle3.accept import forced_ratio
from m3_eagle_plugin.host.reference.cuda_graphs import StepGraphs

from .end_to_end import register_end_to_end
from .inputs import Geometry

__all__ = ["E2EShape", "GPU_SHAPE", "CPU_SHAPE", "SPEEDUP_GOAL_BATCH1", "TargetOnlyGraphs", "DecodeMeasurement",
           "NoDecodeWindowError", "all_decoding", "build_random_models", "measure_decode", "run_e2e", "add_arguments",
           "options_given", "shape_from_args"]


#: The least each workload size may be: `E2EShape` checks its fields, `shape_from_args` the options.
MINIMUMS = {"hidden": 1, "new_tokens": 4, "prompt_len": 1, "repeats": 1}
#: The most a size option may be (`shape_from_args`): past it torch refused the shape with an overflow
#: traceback, after the kernel section (the metadata holds positions and lengths as int32).
MAXIMUM = 2**31 - 1
SIZES = ("hidden", "new_tokens", "prompt_len")
#: `E2EShape`'s integer fields (its `Geometry` too), checked as strict ints.
INT_FIELDS = ("q_heads", "kv_heads", "head_dim", "index_heads", "index_dim", "block", "topk", "hidden", "num_layers",
              "dense_layers", "num_experts", "experts_per_tok", "moe_intermediate", "dense_intermediate",
              "shared_intermediate", "vocab", "draft_intermediate", "prompt_len", "new_tokens",
              "max_tokens_per_step", "draft_len", "repeats")


@dataclass(frozen=True)
class E2EShape(Geometry):
    """Model geometry and workload of one end-to-end run (attention geometry: `Geometry`'s per-rank M3)."""

    hidden: int = 6144
    num_layers: int = 8
    dense_layers: int = 3
    num_experts: int = 16  # one expert-parallel rank's share of 128
    experts_per_tok: int = 4
    moe_intermediate: int = 3072
    dense_intermediate: int = 3072
    shared_intermediate: int = 768
    vocab: int = 32768
    draft_intermediate: int = 4608
    prompt_len: int = 4096  # 32 blocks of 128: top-16 selection is active
    new_tokens: int = 256
    max_tokens_per_step: int = 4096
    batches: tuple[int, ...] = (1, 16)
    draft_len: int = 3
    forced_mean: float = 2.5  # accepted drafts per verify step: mean acceptance length 3.5 at K = 3
    repeats: int = 3
    overlap: bool = False  # the engine's overlapped loop (host work for step N+1 hidden behind step N), both modes

    def __post_init__(self) -> None:
        # Strict ints (the package's rule), so a float or bool is named here, not mid-run after the
        # warm-up (repeats=2.5) or as another object's field (max_seq_len for new_tokens=4.5).
        for name in INT_FIELDS:
            as_int(name, getattr(self, name), error=ValueError)
        if isinstance(self.batches, (str, bytes)) or not isinstance(self.batches, (tuple, list)):
            raise ValueError(f"batches must be a tuple of batch sizes, got {self.batches!r}")
        object.__setattr__(self, "batches", tuple(as_int("batches", b, error=ValueError) for b in self.batches))
        if len(set(self.batches)) != len(self.batches):  # each would run and be reported twice
            raise ValueError(f"batches {self.batches}: a batch size given twice")
        if not 0 <= self.dense_layers <= self.num_layers or self.num_layers < 3:
            raise ValueError(f"need >= 3 layers and 0 <= dense_layers <= num_layers, "
                             f"got {self.num_layers}/{self.dense_layers}")
        if self.draft_len < 1:  # the Eagle3 row would verify no drafts: a second no-speculation run
            raise ValueError(f"draft_len must be >= 1 (Eagle3 drafts), got {self.draft_len}")
        try:  # the engine's schedule rule: a mean it cannot schedule is named here, as forced_mean
            forced_ratio(self.forced_mean)
        except ValueError as error:
            raise ValueError(f"forced_mean: {error}") from None
        if not 0 <= self.forced_mean <= self.draft_len:
            raise ValueError(f"forced_mean {self.forced_mean} must lie in [0, draft_len={self.draft_len}]")
        if any(getattr(self, name) < MINIMUMS[name] for name in ("new_tokens", "repeats", "prompt_len")):
            raise ValueError(f"new_tokens must be >= {MINIMUMS['new_tokens']}, prompt_len and repeats >= 1")
        if self.hidden < MINIMUMS["hidden"]:  # else the model's config refuses it, after the kernel section has run
            raise ValueError(f"hidden must be >= 1, got {self.hidden}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be non-empty and >= 1, got {self.batches}")


SPEEDUP_GOAL_BATCH1 = 2.5
GPU_SHAPE = E2EShape()
CPU_SHAPE = E2EShape(
    hidden=64, q_heads=4, head_dim=16, index_dim=16, block=4, topk=3, num_experts=4, experts_per_tok=2,
    moe_intermediate=32, dense_intermediate=64, shared_intermediate=32, vocab=256, draft_intermediate=96,
    prompt_len=20, new_tokens=12, max_tokens_per_step=320, batches=(1, 16), repeats=1,
)


# ----- the random model ------------------------------------------------------------------------
def m3_config(shape: E2EShape):
    """The target's `M3Config`, through the production config layout (the public contract)."""
    from m3_eagle_plugin.models.config import M3Config

    moe = [0] * shape.dense_layers + [1] * (shape.num_layers - shape.dense_layers)
    text = {
        "vocab_size": shape.vocab, "hidden_size": shape.hidden, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.q_heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "intermediate_size": shape.moe_intermediate, "dense_intermediate_size": shape.dense_intermediate,
        "shared_intermediate_size": shape.shared_intermediate, "num_local_experts": shape.num_experts,
        "num_experts_per_tok": shape.experts_per_tok, "routed_scaling_factor": 2.0, "scoring_func": "sigmoid",
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "moe_layer_freq": moe, "rms_norm_eps": 1e-6,
        "rope_theta": 5e6, "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": shape.index_dim,
            "sparse_num_index_heads": shape.index_heads, "sparse_topk_blocks": shape.topk,
            "sparse_block_size": shape.block, "sparse_score_type": "max", "sparse_init_block": 0,
            "sparse_local_block": 1, "sparse_disable_index_value": moe, "sparse_attention_freq": moe,
        },
    }
    return M3Config.from_dict({"text_config": text}, source="<bench e2e>")


def _random_state(module: torch.nn.Module, *, norm_value: float, dtype: torch.dtype, device: torch.device,
                  generator: torch.Generator, skip: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Weights with unit-variance outputs (std 1/sqrt(fan_in)), norms at their identity, biases zero."""
    state = {}
    for name, meta in module.state_dict().items():
        if any(name.startswith(prefix) for prefix in skip):
            continue
        if name.endswith("e_score_correction_bias"):
            state[name] = torch.zeros(meta.shape, dtype=torch.float32, device=device)
        elif meta.dim() == 1:
            state[name] = torch.full(meta.shape, norm_value, dtype=dtype, device=device)
        else:
            std = 1.0 if "embed_tokens" in name else meta.shape[-1] ** -0.5
            state[name] = (torch.randn(meta.shape, generator=generator, device=device) * std).to(dtype)
    return state


def build_random_models(shape: E2EShape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(target, Eagle3 head) with random weights; the head shares the target's embedding and lm_head."""
    from m3_eagle_plugin.eagle3.head import Eagle3Config, Eagle3Head
    from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
    from m3_eagle_plugin.models.rope import RotaryEmbedding

    config = m3_config(shape)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        target = MiniMaxM3ForCausalLM(config)
    target.load_state_dict(_random_state(target, norm_value=0.0, dtype=dtype, device=device, generator=generator),
                           strict=True, assign=True)  # Gemma norms scale by 1 + w
    target.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta).to(device)
    target = target.eval().requires_grad_(False)

    head_config = Eagle3Config(
        hidden_size=shape.hidden, num_heads=shape.q_heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.draft_intermediate, rms_norm_eps=1e-6, rope_theta=config.rope_theta,
        vocab_size=shape.vocab, draft_vocab_size=shape.vocab, target_hidden_size=shape.hidden,
        aux_layer_ids=config.default_aux_layer_ids, norm_output=True, has_fc_norm=True,
    )
    with torch.device("meta"):
        head = Eagle3Head(head_config)
    shared = ("embed_tokens", "lm_head")
    state = _random_state(head, norm_value=1.0, dtype=dtype, device=device, generator=generator, skip=shared)
    for name in shared:  # placeholders so load_state_dict skips the shared modules
        setattr(head, name, torch.nn.Identity())
    head.load_state_dict(state, strict=True, assign=True)
    head.embed_tokens, head.lm_head = target.embed_tokens, target.lm_head
    head.rotary = RotaryEmbedding(head_config.head_dim, head_config.rope_theta).to(device)
    return target, head.eval().requires_grad_(False)


# ----- the no-speculation decode step under CUDA graphs ------------------------------------------
@dataclass
class _Bucket:
    input_ids: torch.Tensor  # [R]
    true_kv: torch.Tensor  # [R] int32
    zeros: torch.Tensor  # [R]
    graph: "torch.cuda.CUDAGraph | None" = None
    outputs: torch.Tensor | None = None


class TargetOnlyGraphs(StepGraphs):
    """Fixed-shape replay of the target-only decode step (the host's `GenerationGraphs` needs a head).

    Same staging as the host's graphs: lengths staged at the cache's capacity on the host, the true
    lengths applied on the device through ``on_update_kv_lens`` inside the graph. ``capture=False``
    runs the same step eagerly (CPU tests of the staging).
    """

    def __init__(self, runner, *, capture: bool = True) -> None:
        if runner.config.draft_len != 0 or runner.head is not None:
            raise ValueError("TargetOnlyGraphs replays decode without speculation: it needs draft_len 0 and no head")
        super().__init__(runner, capture=capture)

    def _bucket(self, num_rows: int) -> _Bucket:
        if num_rows not in self.buckets:
            device = self.runner.config.device
            self.buckets[num_rows] = _Bucket(
                input_ids=torch.zeros(num_rows, dtype=torch.long, device=device),
                true_kv=torch.zeros(num_rows, dtype=torch.int32, device=device),
                zeros=torch.zeros(num_rows, dtype=torch.long, device=device),
            )
        return self.buckets[num_rows]

    def _body(self, bucket: _Bucket) -> torch.Tensor:
        runner = self.runner
        runner.meta.on_update_kv_lens(bucket.true_kv)
        hidden = runner.target.forward(bucket.input_ids, runner.meta, runner.cache)
        return torch.argmax(runner.target.compute_logits(hidden), dim=-1)

    def launch(self, rows, step_id: int):
        from m3_eagle_plugin.host.reference.runner import StepOutput

        runner = self.runner
        rows = list(rows)
        tables, staged = self._stage(rows, 1)
        self._plan(runner.meta, [1] * len(rows), tables, num_context_requests=0)
        bucket = self._bucket(len(rows))
        input_ids, shrink = runner._step_inputs(rows, list(range(len(rows))))
        bucket.input_ids.copy_(input_ids)
        true_kv = runner._to_device(staged, torch.int32)
        bucket.true_kv.copy_(true_kv if shrink is None else true_kv - shrink)
        tokens = self._run(bucket).clone()  # the next replay overwrites the static output
        emitted = tokens.unsqueeze(1)
        return StepOutput(
            step_id=step_id, rows=rows, draft_lens=[0] * len(rows), emitted=emitted,
            num_emitted=bucket.zeros + 1, num_accepted=bucket.zeros, deficit=bucket.zeros,
            drafting_rows=list(range(len(rows))), next_inputs=emitted, next_draft_probs=None, head_drafts=False,
        )


# ----- engines and timing ----------------------------------------------------------------------
def _engine(target, head, shape: E2EShape, *, speculate: bool, batch: int, prompts, device, dtype, graphs: bool):
    from m3_eagle_plugin.eagle3.capture import AuxCapture
    from m3_eagle_plugin.host.reference.build import blocks_for_prompts
    from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig
    from m3_eagle_plugin.host.reference.scheduler import kv_budget_tokens
    from m3_eagle_plugin.kv import PagedKVCache

    tc = target.config
    k = shape.draft_len if speculate else 0
    config = EngineConfig(
        draft_len=k, max_batch_size=batch, max_tokens_per_step=max(shape.max_tokens_per_step, batch * (k + 1)),
        cuda_graphs=graphs and speculate, force_accepted=shape.forced_mean if speculate else None,
        max_seq_len=kv_budget_tokens(max(map(len, prompts)), shape.new_tokens, k), overlap=shape.overlap,
    )
    num_blocks = blocks_for_prompts(prompts, shape.new_tokens, k, tc.block_size)
    cache = PagedKVCache.for_minimax_m3(
        tc.num_layers, list(tc.sparse_layer_ids), tc.num_kv_heads, tc.head_dim, tc.index_dim, tc.block_size,
        num_blocks, num_draft_layers=1 if speculate else 0,
        draft_num_kv_heads=head.config.num_kv_heads if speculate else None, dtype=dtype, device=device,
    )
    engine = Engine(
        target, cache, config, vocab_size=tc.vocab_size, head=head if speculate else None,
        capture=AuxCapture(head.aux_layer_ids) if speculate else None, device=device,
        num_index_heads=max(tc.index_heads, 1),
    )
    if graphs and not speculate:
        engine.runner.graphs = TargetOnlyGraphs(engine.runner)
    return engine


class NoDecodeWindowError(ValueError):
    """A run too short to time: no two commits at which every request decodes. Known only once the
    schedule has run (it depends on prefill chunking and acceptance), so `m3-eagle bench` reports it
    as an option error then."""


@dataclass
class DecodeMeasurement:
    """One timed `generate`: the full-batch decode window's tokens, verify steps, accepted drafts and
    seconds, plus the whole run's generated tokens and engine steps."""

    tokens: int
    verify_steps: int
    accepted: int
    seconds: float
    generated_total: int
    engine_steps: int
    outputs: list[list[int]] = field(repr=False, default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Accepted drafts + 1 per verify step; None where the window held no verify step (nothing
        measured, as the reference host's `SpecStats` reports it), not a measured 0."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else None


def all_decoding(stats, num_requests: int) -> bool:
    """Whether every request has its first token (so each later step is a full-batch decode step).

    First tokens are what a run emitted outside verify steps (each verify step emits its accepted
    drafts + 1); the total alone is not enough: at batch > 1, requests prefilled early emit many
    tokens while later prompts still prefill.
    """
    return stats.generated_tokens - stats.accepted_tokens - stats.verify_steps >= num_requests


def measure_decode(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> DecodeMeasurement:
    """Generate; time the window from every request having its first token to the last commit
    before a request finishes (every step in it is a full-batch decode step) that closes a whole
    number of the forced schedule's periods (any `period` steps of it force `period * mean` drafts;
    an odd number of 2.5's steps averages 3.33 or 3.67, not the asked 3.5)."""
    forced = engine.config.force_accepted
    period = 1 if forced is None else forced_ratio(forced).denominator
    marks: list[tuple[float, int, int, int]] = []

    def on_commit(done: int, total: int) -> None:
        stats = engine.stats
        if done == 0 and all_decoding(stats, len(prompts)):
            marks.append((time.perf_counter(), stats.generated_tokens, stats.verify_steps, stats.accepted_tokens))

    result = engine.generate(prompts, max_new_tokens, progress=on_commit)
    failed = [e for e in result.errors if e]
    if failed:
        raise RuntimeError(f"end-to-end generation failed: {failed[0]}")
    whole = [m for m in marks[1:] if (m[2] - marks[0][2]) % (period * len(prompts)) == 0]
    if not whole:
        raise NoDecodeWindowError(f"no full-batch decode window: raise new_tokens ({max_new_tokens}; "
                                  "`m3-eagle bench --e2e-tokens`) so every request decodes at least "
                                  f"{period + 1} steps together")
    (t0, g0, v0, a0), (t1, g1, v1, a1) = marks[0], whole[-1]
    return DecodeMeasurement(tokens=g1 - g0, verify_steps=v1 - v0, accepted=a1 - a0, seconds=t1 - t0,
                             generated_total=result.stats.generated_tokens, engine_steps=result.stats.engine_steps,
                             outputs=result.outputs)


def _prompts(shape: E2EShape, batch: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab, (batch, shape.prompt_len), generator=generator).tolist()


def run_e2e(shape: E2EShape, device: torch.device | str, *, dtype: torch.dtype | None = None,
            graphs: bool | None = None, seed: int = 0, log=None) -> list[dict[str, Any]]:
    """Rows (batch, mode, tokens/s, mean acceptance length, speed-up), no-spec and Eagle3 side by side."""
    device = torch.device(device)
    graphs = device.type == "cuda" if graphs is None else graphs
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target, head = build_random_models(shape, device, dtype, seed)
    target.set_graph_safe_moe(graphs)
    rows: list[dict[str, Any]] = []
    try:
        _run_batches(shape, target, head, rows, device=device, dtype=dtype, graphs=graphs, seed=seed, log=log)
    except BaseException as error:  # the batches finished before it, for `m3-eagle bench` to print and write
        error.e2e_rows = list(rows)
        raise
    return rows


def _run_batches(shape: E2EShape, target, head, rows: list[dict[str, Any]], *, device, dtype, graphs: bool,
                 seed: int, log) -> None:
    """`run_e2e`'s rows, appended to `rows` a whole batch (both modes) at a time."""
    for batch in shape.batches:
        prompts = _prompts(shape, batch, seed + batch)
        engines = {spec: _engine(target, head, shape, speculate=spec, batch=batch, prompts=prompts, device=device,
                                 dtype=dtype, graphs=graphs) for spec in (False, True)}
        for engine in engines.values():
            measure_decode(engine, prompts, shape.new_tokens)  # warm-up: captures every graph the run replays
        runs: dict[bool, list[DecodeMeasurement]] = {False: [], True: []}
        for _ in range(shape.repeats):
            for spec, engine in engines.items():  # interleaved: both modes see the same machine state
                runs[spec].append(measure_decode(engine, prompts, shape.new_tokens))
        median = {spec: statistics.median(m.tokens_per_s for m in ms) for spec, ms in runs.items()}
        for spec, ms in runs.items():
            last = ms[-1]
            rows.append({
                "kernel": "e2e", "batch": batch, "context": shape.prompt_len, "mode": "eagle3" if spec else "no_spec",
                "draft_len": shape.draft_len if spec else 0, "tokens_per_s": median[spec],
                "mean_acceptance_length": last.mean_acceptance_length,
                "speedup": median[spec] / median[False] if median[False] > 0 else 0.0,
                "decode_tokens": last.tokens, "decode_steps": last.verify_steps // batch,
                "engine_steps": last.engine_steps, "generated_tokens": last.generated_total,
                "hidden": shape.hidden, "dtype": str(dtype).replace("torch.", ""), "cuda_graphs": graphs,
                "overlap": shape.overlap,
            })
            if spec and batch == 1:
                met = "met" if rows[-1]["speedup"] >= SPEEDUP_GOAL_BATCH1 else "MISSED"
                rows[-1]["note"] = (f"goal >= {SPEEDUP_GOAL_BATCH1}x at batch 1: {met}" if graphs
                                    else "eager smoke shape: the speed-up goal is for the CUDA-graph run")
            if log is not None:
                loop = " (overlap)" if shape.overlap else ""
                length = last.mean_acceptance_length
                log(f"e2e batch {batch} {rows[-1]['mode']}{loop}: {median[spec]:.1f} tok/s, "
                    f"AL {'-' if length is None else f'{length:.2f}'}, speed-up {rows[-1]['speedup']:.2f}x")
        del engines


# ----- CLI -------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--e2e-hidden", type=int, default=None, help="end-to-end target hidden size (GPU default 6144)")
    parser.add_argument("--e2e-tokens", type=int, default=None, help="end-to-end tokens generated per request")
    parser.add_argument("--e2e-context", type=int, default=None, help="end-to-end prompt length")
    parser.add_argument("--e2e-batches", default=None, help="end-to-end batch sizes, comma list (default 1,16)")
    parser.add_argument("--e2e-repeats", type=int, default=None, help="timed runs per mode (median reported)")
    parser.add_argument("--e2e-overlap", action="store_true",
                        help="run both modes with the engine's overlapped step loop")


def options_given(args: argparse.Namespace) -> list[str]:
    """The `--e2e-*` options set on the command line, as flags (`--e2e-hidden`), in `args`' order.

    Every one of them defaults to None (False for the `--e2e-overlap` flag), so any other value was
    given; `m3-eagle bench` refuses them without `--e2e`, which alone runs the section they shape."""
    return ["--" + dest.replace("_", "-") for dest, value in vars(args).items()
            if dest.startswith("e2e_") and value is not None and value is not False]


def shape_from_args(args: argparse.Namespace, device: torch.device) -> E2EShape:
    """The shape the `--e2e-*` options ask for; a bad value is refused naming the option typed
    (`E2EShape` would name its field), a batch size given twice too (it would run twice)."""
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    overrides: dict[str, Any] = {}
    for option, name in (("e2e_hidden", "hidden"), ("e2e_tokens", "new_tokens"), ("e2e_context", "prompt_len"),
                         ("e2e_repeats", "repeats"), ("e2e_overlap", "overlap")):
        value = getattr(args, option, None)
        if value is not None:
            if name in MINIMUMS and value < MINIMUMS[name]:
                raise ValueError(f"--{option.replace('_', '-')} {value}: must be >= {MINIMUMS[name]}")
            if name in SIZES and value > MAXIMUM:
                raise ValueError(f"--{option.replace('_', '-')} {value}: must be <= {MAXIMUM} (int32 sizes)")
            overrides[name] = value
    batches = getattr(args, "e2e_batches", None)
    if batches is not None:
        try:
            overrides["batches"] = tuple(int(b) for b in batches.split(",") if b.strip())
        except ValueError:
            raise ValueError(f"--e2e-batches: expected a comma list of integers, got {batches!r}") from None
        if not overrides["batches"]:  # else the default batches ran in their place
            raise ValueError(f"--e2e-batches: no batch size in {batches!r} (omit the option for the defaults)")
        if min(overrides["batches"]) < 1:
            raise ValueError(f"--e2e-batches {batches}: batch sizes must be >= 1")
        if max(overrides["batches"]) > MAXIMUM:
            raise ValueError(f"--e2e-batches {batches}: batch sizes must be <= {MAXIMUM} (int32 sizes)")
        repeated = sorted({b for b in overrides["batches"] if overrides["batches"].count(b) > 1})
        if repeated:
            raise ValueError(f"--e2e-batches {batches}: batch {', '.join(map(str, repeated))} given twice")
    return replace(shape, **overrides)


@register_end_to_end
def bench_end_to_end(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The `m3-eagle bench --e2e` runner: GPU shape with CUDA graphs on CUDA, the tiny shape elsewhere."""
    import sys

    want = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(want)
    shape = shape_from_args(args, device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the tiny shape only loses to intra-op thread contention
    try:
        return run_e2e(shape, device, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    finally:
        torch.set_num_threads(threads)
