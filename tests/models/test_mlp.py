"""SwiGLU-OAI MLP and the sigmoid-routed MoE vs the formulas and vs transformers' MoE block."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.models.mlp import M3SparseMoE, SigmoidRouter, swiglu_oai


def naive_swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g = torch.minimum(gate, torch.tensor(limit, dtype=gate.dtype))
    u = torch.maximum(torch.minimum(up, torch.tensor(limit, dtype=up.dtype)), torch.tensor(-limit, dtype=up.dtype))
    return (u + 1) * g / (1 + torch.exp(-alpha * g))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(rows=st.integers(1, 4), width=st.integers(1, 8), scale=st.floats(0.1, 20.0),
       limit=st.sampled_from([7.0, 2.0]))
def test_swiglu_oai_formula(rows, width, scale, limit):
    gen = torch.Generator().manual_seed(rows * 31 + width)
    gate, up = torch.randn(rows, width, generator=gen) * scale, torch.randn(rows, width, generator=gen) * scale
    got = swiglu_oai(torch.cat([gate, up], dim=-1), 1.702, limit)
    torch.testing.assert_close(got, naive_swiglu_oai(gate, up, 1.702, limit))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(tokens=st.integers(1, 6), experts=st.integers(2, 8), data=st.data())
def test_router_selects_with_bias_and_combines_without_it(tokens, experts, data):
    top_k = data.draw(st.integers(1, experts))
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    router = SigmoidRouter(8, experts, top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 8, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen))
    x = torch.randn(tokens, 8, generator=gen)
    weights, ids = router(x)
    scores = torch.sigmoid(x.double() @ router.weight.double().T)
    biased = scores + router.e_score_correction_bias.double()
    for t in range(tokens):
        chosen = sorted(ids[t].tolist())
        assert chosen == sorted(torch.argsort(biased[t], descending=True)[:top_k].tolist())
        want = scores[t, ids[t]] / scores[t, ids[t]].sum()
        torch.testing.assert_close(weights[t].double(), want, atol=1e-6, rtol=0)


def test_moe_matches_transformers_block():
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLSparseMoeBlock

    from ._oracle import randomize_, tiny_text_config

    cfg = tiny_text_config()
    hf = MiniMaxM3VLSparseMoeBlock(cfg)
    randomize_(hf, seed=9)
    ours = M3SparseMoE(64, 6, 2, 32, 24, 2.0, 1.702, 7.0)
    ours.load_state_dict(hf.state_dict(), strict=True)  # same tensor names and layouts
    x = torch.randn(11, 64) * 2
    with torch.no_grad():
        want = hf(x[None])[0]
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=0)
        ours.graph_safe = True
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=0)


def test_graph_safe_moe_ignores_an_overflowing_unchosen_expert():
    """The graph-safe path runs every expert; one never chosen whose gate overflows to -inf
    (-inf * sigmoid(-inf) = NaN) must leave the output as transformers' block computes it."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLSparseMoeBlock

    from ._oracle import randomize_, tiny_text_config

    hf = MiniMaxM3VLSparseMoeBlock(tiny_text_config())
    randomize_(hf, seed=9)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.tensor([-10.0, 0, 0, 0, 0, 0]))  # expert 0: never chosen
        hf.experts.gate_up_proj[0, :32] = -1e38  # its gate half: -inf for positive inputs
    ours = M3SparseMoE(64, 6, 2, 32, 24, 2.0, 1.702, 7.0)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).abs()
    with torch.no_grad():
        want = hf(x[None])[0]
        assert torch.isfinite(want).all()
        for graph_safe in (False, True):
            ours.graph_safe = graph_safe
            torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=0)


def test_bf16_router_logits_are_computed_in_fp32():
    """The documented rule: router logits in fp32 whatever the model dtype. From the same bf16 weights
    and inputs, the combine weights equal a float64 computation to fp32 accuracy (bf16 logits would
    be off by ~1e-3)."""
    gen = torch.Generator().manual_seed(7)
    router = SigmoidRouter(64, 8, 3).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 64, generator=gen))
    x = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    weights, ids = router(x)
    scores = torch.sigmoid(x.double() @ router.weight.double().T)
    for t in range(16):
        assert sorted(ids[t].tolist()) == sorted(torch.argsort(scores[t], descending=True)[:3].tolist())
        want = scores[t, ids[t]] / scores[t, ids[t]].sum()
        torch.testing.assert_close(weights[t].double(), want, atol=2e-6, rtol=0)
