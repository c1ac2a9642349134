"""The fused glue kernels (`models.fused_ops`) against the torch code they replace.

The `check_*` functions compare a fused op with the torch reference on one device. On a CUDA
machine the tests below run them through the real kernels (reference on the same GPU: at most
one unit in the last place apart, and such differences rare, so a cast in the wrong place fails);
without a GPU they are skipped, and `interpret_fused_ops.py` runs the same checks on CPU through
Triton's interpreter in a subprocess (`test_kernels_in_the_interpreter`). Every comparison fails on
a NaN the reference does not have, and inputs sit in NaN-filled storage so a stray read shows.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.models import fused_ops
from tests._interpreter import interpreter_case_lines, needs_interpreter
from m3_eagle_plugin.models.norms import GemmaRMSNorm, LlamaRMSNorm
from m3_eagle_plugin.models.rope import RotaryEmbedding, apply_rope

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_POSITION = 131072  # 128K context


def _gpu_ok() -> bool:
    from m3_eagle_plugin.msa.kernels import triton_available

    return torch.cuda.is_available() and triton_available("cuda")


needs_gpu = pytest.mark.skipif(not _gpu_ok(), reason="the fused kernels need a CUDA device with Triton")


# ---------------------------------------------------------------------------------------------- helpers

@contextmanager
def fused(enabled: bool):
    """Force the fused path on (CUDA, or CPU under the interpreter) or off, whatever the device."""
    saved = fused_ops.use_triton
    fused_ops.use_triton = lambda device: enabled
    try:
        yield
    finally:
        fused_ops.use_triton = saved


def _tolerance(dtype: torch.dtype) -> tuple[float, float, float]:
    """(rtol, atol, largest share of elements allowed to differ at all)."""
    if dtype == torch.float32:
        return 1e-5, 2e-6, 1.0  # fp32 norm factors differ in the sum order; cos/sin by an ulp on CPU
    eps = torch.finfo(dtype).eps
    if INTERPRETED and dtype == torch.bfloat16:
        return 3 * eps, 3 * eps, 1.0  # the interpreter truncates fp32 -> bf16 instead of rounding to nearest
    return eps, eps, 0.02


def assert_matches(got: torch.Tensor, want: torch.Tensor, via: torch.dtype | None = None) -> None:
    """Same dtype, shape and NaN pattern; within ~one ulp of the output dtype (or of `via`, an
    intermediate dtype the value was rounded to on the way); half-precision differences rare."""
    assert got is not None, "the fused path was not taken"
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN where the reference has none (or vice versa)"
    keep = ~torch.isnan(want)
    g, w = got[keep].double().cpu(), want[keep].double().cpu()
    coarse = got.dtype if via is None or torch.finfo(via).eps <= torch.finfo(got.dtype).eps else via
    rtol, atol, share = _tolerance(coarse)
    torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=False)
    if g.numel():
        assert (g != w).double().mean().item() <= share, f"{(g != w).double().mean().item():.3%} of elements differ"


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical (one rounding on both sides), up to the interpreter's bf16 casts."""
    if INTERPRETED and got.dtype == torch.bfloat16:
        assert_matches(got, want)
    else:
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.nan_to_num(), want.nan_to_num())


def _in_poisoned(values: torch.Tensor, pad: int) -> torch.Tensor:
    """`values` as a view into storage whose last dim is `pad` wider and filled with NaN there."""
    if pad == 0:
        return values.contiguous()
    buf = torch.full((*values.shape[:-1], values.shape[-1] + pad), float("nan"), dtype=values.dtype,
                     device=values.device)
    buf[..., : values.shape[-1]] = values
    return buf[..., : values.shape[-1]]


def _randn(shape, gen, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _norm(gemma: bool, n: int, gen, dtype, device, eps=1e-6):
    norm = (GemmaRMSNorm if gemma else LlamaRMSNorm)(n, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=gen) * 0.5 + (0.0 if gemma else 1.0))
    return norm.to(device=device, dtype=dtype).requires_grad_(False)


# ---------------------------------------------------------------------------------------------- checks

def check_rms_norm(device, dtype, n, *, gemma, rows=3, weight_dtype=None, residual=False, pad=0, scale=1.0,
                   eps=1e-6, seed=0):
    gen = torch.Generator().manual_seed(seed * 7919 + n)
    norm = _norm(gemma, n, gen, weight_dtype or dtype, device, eps)
    x = _in_poisoned(_randn((rows, n), gen, dtype, device, scale), pad)
    with torch.no_grad(), fused(True):
        if not residual:
            got = fused_ops.rms_norm(x, norm.weight, eps, gemma=gemma)
            assert_matches(got, norm.reference(x), via=dtype)
            assert_same(norm(x), got)  # the module takes the fused path
            return
        r = _in_poisoned(_randn((rows, n), gen, dtype, device, scale), pad)
        got = fused_ops.rms_norm(x, norm.weight, eps, gemma=gemma, residual=r)
        assert got is not None
        total, normed = got
        assert_same(total, r + x)
        assert_matches(normed, norm.reference(r + x), via=dtype)
        mod_total, mod_normed = norm.add_then_norm(r, x)
        assert_same(mod_total, total)
        assert_same(mod_normed, normed)


def check_rms_norm_nan_stays_in_its_row(device, dtype):
    gen = torch.Generator().manual_seed(3)
    for gemma in (True, False):
        norm = _norm(gemma, 300, gen, dtype, device)
        x = _randn((4, 300), gen, dtype, device)
        x[2, 17] = float("nan")
        with torch.no_grad(), fused(True):
            got = fused_ops.rms_norm(x, norm.weight, norm.eps, gemma=gemma)
            assert torch.isnan(got[2]).all() and torch.isfinite(got[[0, 1, 3]]).all()
            assert_matches(got, norm.reference(x))
            total, normed = fused_ops.rms_norm(torch.zeros_like(x), norm.weight, norm.eps, gemma=gemma, residual=x)
            assert torch.isnan(normed[2]).all() and torch.isfinite(normed[[0, 1, 3]]).all()
            assert torch.isnan(total[2, 17]) and torch.isnan(total).sum() == 1


def check_rope(device, dtype, *, t, hq, hk, d, rd, norm, positions=None, theta=1e4, pad=0, norm_dtype=None,
               pos_dtype=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed * 104729 + t * 31 + d)
    rot = RotaryEmbedding(rd, theta).to(device)
    if positions is None:
        positions = torch.randint(0, MAX_POSITION, (t,), generator=gen).tolist()
    pos = torch.tensor(positions, dtype=pos_dtype, device=device)
    q = _in_poisoned(_randn((t, hq, d), gen, dtype, device), pad)
    k = _in_poisoned(_randn((t, hk, d), gen, dtype, device), pad)
    q_norm = _norm(True, d, gen, norm_dtype or dtype, device) if norm else None
    k_norm = _norm(True, d, gen, norm_dtype or dtype, device) if norm else None
    weights = (q_norm.weight, q_norm.eps, k_norm.weight, k_norm.eps) if norm else None
    with torch.no_grad(), fused(True):
        got = fused_ops.norm_rope_qk(q, k, pos, rot.inv_freq, weights)
        assert got is not None, "the fused path was not taken"
        cos, sin = rot.cos_sin(pos)
        for out, x, n in ((got[0], q, q_norm), (got[1], k, k_norm)):
            want = apply_rope(n.reference(x) if norm else x, cos, sin)
            assert_matches(out, want)
            if not norm:
                assert torch.equal(out[..., rd:], x[..., rd:])  # pass-through channels are copied
        via_layer = rot.at(pos).qk(q, k, q_norm, k_norm)  # what the attention layers call
        assert_same(via_layer[0], got[0])
        assert_same(via_layer[1], got[1])


def check_rope_nan_stays_in_its_head(device, dtype):
    gen = torch.Generator().manual_seed(5)
    rot = RotaryEmbedding(32, 1e4).to(device)
    q, k = _randn((3, 4, 64), gen, dtype, device), _randn((3, 2, 64), gen, dtype, device)
    q[1, 2, 40] = float("nan")  # a pass-through channel: with the norm it poisons the whole head
    pos = torch.tensor([0, 7, 99], device=device)
    norms = [_norm(True, 64, gen, dtype, device) for _ in range(2)]
    with torch.no_grad(), fused(True):
        q_out, k_out = fused_ops.norm_rope_qk(q, k, pos, rot.inv_freq,
                                              (norms[0].weight, 1e-6, norms[1].weight, 1e-6))
    bad = torch.zeros(3, 4, dtype=torch.bool)
    bad[1, 2] = True
    assert torch.isnan(q_out[1, 2]).all()
    assert torch.isfinite(q_out[~bad.to(q_out.device)]).all() and torch.isfinite(k_out).all()


def check_rope_refuses_positions_of_another_length(device, dtype):
    """Positions must be one per token: the torch path raises on any other length, so the fused one
    must not quietly rotate by a prefix of them."""
    gen = torch.Generator().manual_seed(11)
    rot = RotaryEmbedding(8, 1e4).to(device)
    q, k = _randn((2, 2, 16), gen, dtype, device), _randn((2, 1, 16), gen, dtype, device)
    norms = [_norm(True, 16, gen, dtype, device) for _ in range(2)]
    weights = (norms[0].weight, 1e-6, norms[1].weight, 1e-6)
    for pos in (torch.tensor([3, 9, 100], device=device), torch.tensor([3], device=device)):
        with torch.no_grad(), fused(True):
            assert fused_ops.norm_rope_qk(q, k, pos, rot.inv_freq) is None
            assert fused_ops.norm_rope_qk(q, k, pos, rot.inv_freq, weights) is None
            for qk_norms in ((), norms):
                with pytest.raises(RuntimeError):
                    rot.at(pos).qk(q, k, *qk_norms)


def check_gather_logits(device, dtype, *, rows=3, vd=37, v=300, pad=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target_ids = torch.randperm(v, generator=gen)[:vd].to(device)
    index = torch.full((v,), -1, dtype=torch.int32, device=device)
    index[target_ids] = torch.arange(vd, dtype=torch.int32, device=device)
    logits = _in_poisoned(_randn((rows, vd), gen, dtype, device, 4.0), pad)
    with fused(True):
        got = fused_ops.gather_logits(logits, index)
    want = torch.full((rows, v), float("-inf"), device=device)
    want[:, target_ids] = logits.float()
    assert got is not None and got.dtype == torch.float32
    assert torch.equal(got, want)


def _paged(config, device, dtype, draft_num_kv_heads):
    """Cache + metadata for one request (as tests/models/_oracle.PagedRunner, without importing transformers)."""
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.msa.metadata import MsaDecodeMetadata

    cache = PagedKVCache.for_minimax_m3(
        config.num_layers, config.sparse_layer_ids, config.num_kv_heads, config.head_dim,
        config.index_dim or config.head_dim, config.block_size, 16, dtype=dtype, device=device,
        num_draft_layers=1, draft_num_kv_heads=draft_num_kv_heads)
    meta = MsaDecodeMetadata(1, 16, 16, config.block_size, device, max_draft_len=7,
                             num_index_heads=max(config.index_heads, 1))
    cache.add_request("r")
    length = [0]

    def prepare(n: int):
        length[0] += n
        cache.reserve("r", length[0])
        meta.prepare([n], [length[0]], cache.block_table(["r"]))
        return meta

    return cache, prepare


def check_models_fused_vs_torch(device, dtype, tiny_dir: Path, atol: float, steps=(7, 4)):
    """The tiny target and its Eagle3 head (reduced vocabulary with d2t) with and without the kernels."""
    from m3_eagle_plugin.eagle3.checkpoint import load_draft
    from m3_eagle_plugin.models.loader import load_target

    target = load_target(tiny_dir / "target", dtype=dtype, device=device)
    head = load_draft(tiny_dir / "draft", target, dtype=dtype, device=device)
    vocab, hidden = target.config.vocab_size, head.config.hidden_size
    draft_vocab = 40
    target_ids = torch.arange(draft_vocab) * 7 % vocab
    head.lm_head = torch.nn.Linear(hidden, draft_vocab, bias=False).to(device=device, dtype=dtype)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[target_ids.to(device)])
    head.d2t = (target_ids - torch.arange(draft_vocab)).to(device)
    assert head.draft_index is not None
    gen = torch.Generator().manual_seed(2)
    total = sum(steps)
    ids = torch.randint(0, vocab, (total,), generator=gen).to(device)
    aux = _randn((total, 3 * hidden), gen, dtype, device)
    results = []
    for enabled in (True, False):
        cache, prepare = _paged(target.config, device, dtype, head.config.num_kv_heads)
        out = []
        with torch.no_grad(), fused(enabled):
            start = 0
            for n in steps:
                meta = prepare(n)
                h = target(ids[start:start + n], meta, cache)
                out += [h, target.compute_logits(h)]
                logits, nxt = head(ids[start:start + n], aux[start:start + n], meta, cache)
                out += [logits, nxt]
                start += n
            logits, nxt = head(ids[:1], nxt[-1:], prepare(1), cache)
            out += [logits, nxt]
        results.append(out)
    for got, want in zip(*results):
        assert got.dtype == want.dtype and torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.isfinite(want[~torch.isinf(want)]).all()
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


#: The interpreter's share of the checks: few launches, small grids (CI has two cores).
INTERPRETER_CASES = [
    *[(check_rms_norm, dict(dtype=dt, n=n, gemma=g, residual=r, pad=p))
      for dt, n, g, r, p in [(torch.float32, 777, True, False, 3), (torch.float16, 777, False, True, 0),
                             (torch.bfloat16, 64, True, True, 2), (torch.float16, 1, True, False, 0),
                             (torch.float32, 96, False, False, 0)]],
    (check_rms_norm, dict(dtype=torch.bfloat16, n=100, gemma=False, weight_dtype=torch.float32)),
    (check_rms_norm, dict(dtype=torch.float16, n=100, gemma=True, weight_dtype=torch.float32, residual=True)),
    (check_rms_norm_nan_stays_in_its_row, dict(dtype=torch.float16)),
    (check_rope, dict(dtype=torch.float32, t=3, hq=4, hk=1, d=128, rd=64, norm=True,
                      positions=[0, 131071, 4097])),
    (check_rope, dict(dtype=torch.float16, t=2, hq=2, hk=2, d=96, rd=96, norm=False, pad=3, pos_dtype=torch.int32)),
    (check_rope, dict(dtype=torch.bfloat16, t=2, hq=3, hk=1, d=66, rd=20, norm=True, norm_dtype=torch.float32)),
    (check_rope, dict(dtype=torch.float16, t=2, hq=1, hk=2, d=16, rd=8, norm=True, positions=[-1, 5])),
    (check_rope_nan_stays_in_its_head, dict(dtype=torch.float32)),
    (check_rope_refuses_positions_of_another_length, dict(dtype=torch.float16)),
    (check_gather_logits, dict(dtype=torch.bfloat16)),
    (check_gather_logits, dict(dtype=torch.float32, rows=1, vd=300, v=300, pad=0)),
]


# ---------------------------------------------------------------------------------------------- CPU

def test_cpu_takes_the_torch_path():
    x = torch.randn(3, 32)
    norm = GemmaRMSNorm(32)
    assert fused_ops.rms_norm(x, norm.weight, 1e-6, gemma=True) is None
    assert fused_ops.norm_rope_qk(x.view(3, 2, 16), x.view(3, 2, 16), torch.arange(3), torch.ones(4)) is None
    assert fused_ops.gather_logits(x, torch.arange(32)) is None
    with torch.no_grad():
        assert torch.equal(norm(x), norm.reference(x))
        total, normed = norm.add_then_norm(x, x)
        assert torch.equal(total, x + x) and torch.equal(normed, norm.reference(x + x))


def test_rope_at_is_apply_rope_on_cpu():
    gen = torch.Generator().manual_seed(0)
    rot = RotaryEmbedding(8, 1e4)
    q, k, pos = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 2, 16, generator=gen), torch.tensor([0, 9, 70000])
    norms = [GemmaRMSNorm(16), GemmaRMSNorm(16)]
    cos, sin = rot.cos_sin(pos)
    at = rot.at(pos)
    got = at.qk(q, k)
    assert torch.equal(got[0], apply_rope(q, cos, sin)) and torch.equal(got[1], apply_rope(k, cos, sin))
    with torch.no_grad():
        got = at.qk(q, k, *norms)
    assert torch.equal(got[0], apply_rope(norms[0](q), cos, sin))
    assert torch.equal(got[1], apply_rope(norms[1](k), cos, sin))


class _OnSecondGpu(torch.Tensor):
    """A CPU tensor that reports CUDA device 1 (`get_device`), for the device-guard test without GPUs."""

    def get_device(self):
        return 1


def test_kernels_launch_with_the_tensors_device_current(monkeypatch, fake_current_device):
    """Triton launches on the current device: a fused op on tensors of cuda:1 while cuda:0 is current
    must make cuda:1 current for its launch (and restore cuda:0), as the MSA dispatchers do."""
    (current, entered), seen = fake_current_device, []

    def kernel(result):
        return lambda *args, **kwargs: seen.append(current[0]) or result

    x = torch.randn(2, 8).as_subclass(_OnSecondGpu)
    fake = SimpleNamespace(rms_norm_rows=kernel((torch.empty(2, 8), None)), norm_rope_qk=kernel(None),
                           gather_logits=kernel(torch.empty(2, 3)))
    monkeypatch.setattr(fused_ops, "_kernels", lambda: fake)
    with torch.no_grad(), fused(True):
        assert fused_ops.rms_norm(x, torch.ones(8), 1e-6, gemma=True) is not None
        assert fused_ops.norm_rope_qk(x.view(2, 2, 4), x.view(2, 2, 4), torch.arange(2), torch.ones(2)) is not None
        assert fused_ops.gather_logits(x, torch.arange(3)) is not None
        assert fused_ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, gemma=True) is not None  # CPU: no switch
    assert seen == [1, 1, 1, 0] and entered == [1, 1, 1] and current == [0]


def test_ops_decline_what_their_kernels_do_not_take(monkeypatch):
    """Each op returns None (the caller's torch path) for an input its kernel does not take, or when
    autograd would need a backward; the kernel is never launched. The neighbouring inputs that the
    kernels do take are launched (stub kernels: only the routing is checked here)."""
    launched = []
    fake = SimpleNamespace(
        rms_norm_rows=lambda rows, *a, **k: launched.append("norm") or (torch.empty_like(rows), None),
        norm_rope_qk=lambda *a: launched.append("rope"))
    monkeypatch.setattr(fused_ops, "_kernels", lambda: fake)
    wide, x, q, pos = fused_ops.MAX_NORM_WIDTH, torch.randn(3, 8), torch.randn(2, 2, 8), torch.arange(2)
    w = torch.ones(8, requires_grad=True)
    with fused(True):
        with torch.no_grad():
            declined = [
                fused_ops.rms_norm(torch.randn(1, wide + 1), torch.ones(wide + 1), 1e-6, gemma=True),  # too wide
                fused_ops.rms_norm(torch.randn(8, 3).t(), torch.ones(8), 1e-6, gemma=False),  # rows not contiguous
                fused_ops.rms_norm(x, w, 1e-6, gemma=True, residual=torch.randn(1, 8)),  # a broadcast residual
                fused_ops.norm_rope_qk(q, q, pos, torch.ones(5)),  # 10 rotary channels in a head of 8
                fused_ops.norm_rope_qk(q, q, pos, torch.ones(2), (w[:4], 1e-6, w[:4], 1e-6)),  # norm weights of 4
            ]
            assert declined == [None] * 5 and launched == []
            assert fused_ops.rms_norm(torch.randn(1, wide), torch.ones(wide), 1e-6, gemma=True) is not None
            assert fused_ops.rms_norm(x, w, 1e-6, gemma=True) is not None
            assert fused_ops.norm_rope_qk(q, q, pos, torch.ones(4), (torch.ones(8), 1e-6, torch.ones(8), 1e-6))
            assert launched == ["norm", "norm", "rope"]
        assert fused_ops.rms_norm(x, w, 1e-6, gemma=True) is None  # w requires grad: the kernel has no backward
        assert launched == ["norm", "norm", "rope"]


@needs_interpreter
def test_kernels_in_the_interpreter():
    lines = interpreter_case_lines("tests.models.interpret_fused_ops")
    assert len(lines) == len(INTERPRETER_CASES) + 1, lines


# ---------------------------------------------------------------------------------------------- CUDA

@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n", [1, 64, 777, 6144, 16384])
def test_rms_norm_matches_the_modules(dtype, gemma, residual, n):
    check_rms_norm("cuda", dtype, n, gemma=gemma, residual=residual, rows=5, pad=3 if n % 2 else 0)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF)
def test_rms_norm_with_fp32_weights_promotes_like_torch(dtype):
    check_rms_norm("cuda", dtype, 1000, gemma=False, weight_dtype=torch.float32)
    check_rms_norm("cuda", dtype, 1000, gemma=True, weight_dtype=torch.float32, residual=True)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_never_leaves_its_row(dtype):
    check_rms_norm_nan_stays_in_its_row("cuda", dtype)
    check_rope_nan_stays_in_its_head("cuda", dtype)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", [
    dict(hq=16, hk=1, d=128, rd=64, norm=True, theta=5e6),   # M3 q/k (per rank)
    dict(hq=1, hk=1, d=128, rd=64, norm=True, theta=5e6),    # M3 index q / index k
    dict(hq=32, hk=8, d=128, rd=128, norm=False, theta=5e5),  # Eagle3 head, full rotary
    dict(hq=5, hk=3, d=80, rd=48, norm=True, theta=1e4),     # odd head counts, half not a power of two
    dict(hq=2, hk=2, d=66, rd=66, norm=False, theta=1e4),
])
def test_rope_matches_apply_rope(dtype, geometry):
    check_rope("cuda", dtype, t=7, **geometry)
    check_rope("cuda", dtype, t=3, positions=[0, 1, MAX_POSITION - 1], pad=8, **geometry)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_logits_places_the_draft_vocabulary(dtype):
    check_gather_logits("cuda", dtype)
    check_gather_logits("cuda", dtype, rows=4, vd=32000, v=200064, pad=0)


@needs_gpu
@pytest.mark.gpu
def test_models_with_and_without_the_kernels(tiny_dir):
    check_models_fused_vs_torch("cuda", torch.float32, tiny_dir, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs with Triton")
def test_kernels_on_the_second_gpu_while_the_first_is_current(monkeypatch):
    """Each fused launch runs with its tensors' device current (checked before the launch, so a
    wrong device fails here instead of launching on cuda:0 with cuda:1 addresses), and matches."""
    from m3_eagle_plugin.models import fused_kernels

    checked = []

    def on_tensor_device(name):
        real = getattr(fused_kernels, name)

        def call(first, *args, **kwargs):
            assert torch.cuda.current_device() == first.device.index, (name, torch.cuda.current_device())
            checked.append(name)
            return real(first, *args, **kwargs)
        return call

    proxy = SimpleNamespace(**{n: on_tensor_device(n) for n in ("rms_norm_rows", "norm_rope_qk", "gather_logits")})
    monkeypatch.setattr(fused_ops, "_kernels", lambda: proxy)
    with torch.cuda.device(0):
        for dtype in DTYPES:
            check_rms_norm("cuda:1", dtype, 777, gemma=True, residual=True, rows=5, pad=3)
            check_rms_norm("cuda:1", dtype, 6144, gemma=False, rows=4)
            check_rope("cuda:1", dtype, t=7, hq=16, hk=1, d=128, rd=64, norm=True, theta=5e6)
            check_gather_logits("cuda:1", dtype)
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 0
    assert {"rms_norm_rows", "norm_rope_qk", "gather_logits"} <= set(checked)


@needs_gpu
@pytest.mark.gpu
def test_env_override_and_autograd_fall_back(monkeypatch):
    x = torch.randn(2, 64, device="cuda")
    norm = _norm(True, 64, torch.Generator().manual_seed(0), torch.float32, "cuda")
    assert fused_ops.rms_norm(x, norm.weight, 1e-6, gemma=True) is not None
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    assert fused_ops.rms_norm(x, norm.weight, 1e-6, gemma=True) is None
    monkeypatch.delenv("M3_EAGLE_KERNELS")
    norm.requires_grad_(True)
    assert fused_ops.rms_norm(x, norm.weight, 1e-6, gemma=True) is None  # needs a backward
    norm(x).sum().backward()
    assert norm.weight.grad is not None


@needs_gpu
@pytest.mark.gpu
@settings(max_examples=40, deadline=None, derandomize=True)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 5000), rows=st.integers(1, 9), gemma=st.booleans(),
       residual=st.booleans(), pad=st.integers(0, 3), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       eps=st.sampled_from([1e-6, 1e-5]))
def test_rms_norm_property(dtype, n, rows, gemma, residual, pad, scale, eps):
    check_rms_norm("cuda", dtype, n, gemma=gemma, rows=rows, residual=residual, pad=pad, scale=scale, eps=eps)


@needs_gpu
@pytest.mark.gpu
@settings(max_examples=40, deadline=None, derandomize=True)
@given(dtype=st.sampled_from(DTYPES), t=st.integers(1, 9), hq=st.integers(1, 8), hk=st.integers(1, 4),
       half=st.integers(1, 64), rest=st.integers(0, 70), norm=st.booleans(), pad=st.integers(0, 3),
       theta=st.sampled_from([1e4, 5e5, 5e6]), pos32=st.booleans())
def test_rope_property(dtype, t, hq, hk, half, rest, norm, pad, theta, pos32):
    check_rope("cuda", dtype, t=t, hq=hq, hk=hk, d=2 * half + rest, rd=2 * half, norm=norm, pad=pad, theta=theta,
               pos_dtype=torch.int32 if pos32 else torch.int64)
