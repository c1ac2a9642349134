"""Partial NeoX RoPE vs a naive per-pair rotation and vs transformers' M3 rotary code."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.models.rope import RotaryEmbedding, apply_rope


def naive_rope(x: torch.Tensor, positions: list[int], rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotate channel pairs (i, i + rotary_dim/2) by position * theta^(-2i/rotary_dim)."""
    out = x.clone().double()
    half = rotary_dim // 2
    for t, p in enumerate(positions):
        for i in range(half):
            angle = p * theta ** (-2 * i / rotary_dim)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[t, ..., i].double(), x[t, ..., i + half].double()
            out[t, ..., i] = a * c - b * s
            out[t, ..., i + half] = b * c + a * s
    return out.to(x.dtype)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(head_dim=st.sampled_from([8, 16, 32]), frac=st.sampled_from([0.25, 0.5, 1.0]),
       positions=st.lists(st.integers(0, 5000), min_size=1, max_size=6), heads=st.integers(1, 3),
       theta=st.sampled_from([1e4, 5e6]))
def test_matches_naive_rotation(head_dim, frac, positions, heads, theta):
    rd = int(head_dim * frac)
    x = torch.randn(len(positions), heads, head_dim, generator=torch.Generator().manual_seed(len(positions)))
    cos, sin = RotaryEmbedding(rd, theta).cos_sin(torch.tensor(positions))
    got = apply_rope(x, cos, sin)
    torch.testing.assert_close(got, naive_rope(x, positions, rd, theta), atol=2e-5, rtol=1e-5)
    assert torch.equal(got[..., rd:], x[..., rd:])


def test_matches_transformers_partial_rope():
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf

    from ._oracle import tiny_text_config

    cfg = tiny_text_config()
    pos = torch.tensor([0, 3, 17, 250])
    cos_hf, sin_hf = hf.MiniMaxM3VLRotaryEmbedding(cfg)(torch.zeros(1), pos[None])
    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 2, 4, 16)
    q_hf, k_hf = hf.apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = RotaryEmbedding(8, 10000.0).cos_sin(pos)
    torch.testing.assert_close(apply_rope(q[0].transpose(0, 1), cos, sin), q_hf[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k[0].transpose(0, 1), cos, sin), k_hf[0].transpose(0, 1))


def test_bad_rotary_dim():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7, 1e4)
    cos, sin = RotaryEmbedding(8, 1e4).cos_sin(torch.tensor([1]))
    with pytest.raises(ValueError, match="exceeds"):
        apply_rope(torch.zeros(1, 4), cos, sin)


def test_tables_equal_transformers_bit_for_bit_at_long_positions():
    """fp32 frequencies theta ** (-2i / d) and the fp32 product position * inv_freq, as transformers forms
    them, at MiniMax-M3's own geometry (64 of 128 dims, theta 5e6): a frequency or angle rounded any other
    way (through fp64) moves cos/sin by ~1e-5 past position 10**5, inside assert_close's fp32 tolerance."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf

    from ._oracle import tiny_text_config

    cfg = tiny_text_config(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                         "partial_rotary_factor": 0.5})
    pos = torch.tensor([0, 3, 250, 4097, 131071, 1000003])
    cos_hf, sin_hf = hf.MiniMaxM3VLRotaryEmbedding(cfg)(torch.zeros(1), pos[None])
    cos, sin = RotaryEmbedding(64, 5e6).cos_sin(pos)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
