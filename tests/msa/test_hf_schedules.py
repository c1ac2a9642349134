"""Differential tests: random small MiniMax-M3 configs and random serving schedules against transformers.

Each example builds a transformers dense layer (0) and sparse layer (1) with a random block size,
top-k, local-block count, head counts and dims, runs them on whole random sequences (the oracle:
every token's dense output, sparse output and block selection), and replays the same tokens through
the plugin the way a server does: one ``MsaDecodeMetadata`` allocated once and prepared per step, a
``PagedKVCache`` (with a shared draft layer in the same mega-slot) whose pages are reserved, rewound
and reused, mixed steps of prompt chunks, idle rows and 1 + K verify rows whose rejected draft tokens
are garbage written to the cache, and optimistic lengths corrected on the device (overlap scheduler).
Every row whose prefix is the true sequence must give transformers' output and selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.kv import PagedKVCache
from m3_eagle_plugin.msa import (
    MsaDecodeMetadata,
    dense_attention,
    select_blocks_paged,
    sparse_attention,
    write_index_k,
    write_kv,
)

hf = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")

TOL = dict(atol=2e-5, rtol=2e-5)
DRAFT_LEN = 3


@dataclass(frozen=True)
class Shape:
    block: int
    topk: int
    local: int
    kv_heads: int
    group: int
    head_dim: int
    index_dim: int


@dataclass
class Sequence:
    """Token-major tensors of one request: per layer q [S, Hq, D], k/v [S, Hkv, D], out [S, Hq, D];
    index q [S, Hkv, Di], index k [S, Di], selection sets [Hkv][S]."""

    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    out: list[torch.Tensor]
    index_q: torch.Tensor
    index_k: torch.Tensor
    selection: list[list[frozenset[int]]]


class Oracle:
    """A transformers dense layer (0) and sparse layer (1) of one random config."""

    def __init__(self, shape: Shape, seed: int) -> None:
        torch.manual_seed(seed)
        self.shape = shape
        self.config = hf.MiniMaxM3VLTextConfig(
            vocab_size=32, hidden_size=32, intermediate_size=16, dense_intermediate_size=16,
            shared_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=shape.kv_heads * shape.group, num_key_value_heads=shape.kv_heads,
            head_dim=shape.head_dim, num_local_experts=2, num_experts_per_tok=1,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
            index_n_heads=shape.kv_heads, index_head_dim=shape.index_dim, index_block_size=shape.block,
            index_topk_blocks=shape.topk, index_local_blocks=shape.local,
            layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"],
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        self.config._attn_implementation = "eager"
        self.layers = [hf.MiniMaxM3VLAttention(self.config, layer_idx=i).eval() for i in (0, 1)]
        self.rotary = hf.MiniMaxM3VLRotaryEmbedding(self.config)
        with torch.no_grad():
            for attn in self.layers:
                attn.q_norm.weight.normal_(0.0, 0.3)
                attn.k_norm.weight.normal_(0.0, 0.3)
            indexer = self.layers[1].indexer
            indexer.q_norm.weight.normal_(0.0, 0.3)
            indexer.k_norm.weight.normal_(0.0, 0.3)
            indexer.q_proj.weight.mul_(3.0)  # sharper index scores: top-k decisions far from ties

    @torch.no_grad()
    def run(self, length: int, seed: int) -> Sequence:
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(1, length, self.config.hidden_size, generator=gen)
        position_ids = torch.arange(length)[None]
        cos, sin = self.rotary(hidden, position_ids)
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        dim = self.shape.head_dim
        seq = Sequence([], [], [], [], None, None, None)
        for attn in self.layers:
            q = attn.q_norm(attn.q_proj(hidden).view(1, length, -1, dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(hidden).view(1, length, -1, dim)).transpose(1, 2)
            v = attn.v_proj(hidden).view(1, length, -1, dim).transpose(1, 2)
            q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
            captured = {}
            hook = attn.o_proj.register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0]))
            try:
                attn(hidden, (cos, sin), causal, cache=None, position_ids=position_ids)
            finally:
                hook.remove()
            seq.q.append(q[0].transpose(0, 1).contiguous())
            seq.k.append(k[0].transpose(0, 1).contiguous())
            seq.v.append(v[0].transpose(0, 1).contiguous())
            seq.out.append(captured["x"][0].view(length, -1, dim))
        indexer, di = self.layers[1].indexer, self.shape.index_dim
        iq = indexer.q_norm(indexer.q_proj(hidden).view(1, length, -1, di)).transpose(1, 2)
        ik = indexer.k_norm(indexer.k_proj(hidden).view(1, length, 1, di)).transpose(1, 2)
        iq, ik = hf.apply_rotary_pos_emb(iq, ik, cos[..., :di], sin[..., :di])
        seq.index_q = iq[0].transpose(0, 1).contiguous()
        seq.index_k = ik[0, 0].contiguous()
        chosen = indexer(hidden, (cos, sin), None, position_ids)[0]
        seq.selection = [[frozenset(b for b in row if b >= 0) for row in head.tolist()] for head in chosen]
        return seq


SHAPES = st.builds(
    Shape,
    block=st.sampled_from([1, 2, 4, 8]),
    topk=st.integers(1, 5),
    local=st.integers(0, 3),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([8, 16]),
    index_dim=st.sampled_from([4, 8]),
).filter(lambda s: s.local <= s.topk)


class Replay:
    """The plugin side: one cache and one metadata for the whole schedule."""

    def __init__(self, shape: Shape, seqs: dict[int, Sequence], num_blocks: int, seed: int) -> None:
        self.shape, self.seqs = shape, seqs
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = PagedKVCache.for_minimax_m3(
            2, [1], shape.kv_heads, shape.head_dim, shape.index_dim, shape.block, num_blocks,
            num_draft_layers=1, dtype=torch.float32,
        )  # fmt: skip
        with torch.no_grad():  # stale bytes everywhere: nothing may read a slot it did not write
            for pool in self.cache.geometry.pools:
                self.cache.storage(pool.pool_id).fill_(float("nan"))
        self.width = num_blocks
        self.meta = MsaDecodeMetadata(
            len(seqs), sum(s.index_k.shape[0] for s in seqs.values()) + len(seqs) * (1 + DRAFT_LEN), num_blocks,
            shape.block, "cpu", max_draft_len=DRAFT_LEN, num_index_heads=shape.kv_heads,
            num_pages=num_blocks,
        )  # fmt: skip

    def garbage(self, like: torch.Tensor, n: int) -> torch.Tensor:
        return torch.randn((n, *like.shape[1:]), generator=self.gen) * 3.0

    def step(self, rows: list[tuple[int, int, int, int]], staging: str) -> list[str]:
        """``rows``: (rid, cached prefix P, true tokens a, garbage tokens g) of one step; a row writes
        tokens P .. P + a + g - 1. ``staging``: the lengths ``prepare`` stages before the device
        correction: ``exact``, ``optimistic`` (a few tokens more) or ``capacity`` (every row at the
        table's full width, unreserved columns at page 0, as a CUDA-graph replay stages them).
        Checks the true tokens' outputs; returns failure messages."""
        cache, meta, s = self.cache, self.meta, self.shape
        rids = [rid for rid, *_ in rows]
        qo = [a + g for _, _, a, g in rows]
        kv = [p + a + g for _, p, a, g in rows]
        for rid, length in zip(rids, kv):
            cache.reserve(rid, length)
        optimistic = [k + (extra if q else 0) for k, q, extra in zip(kv, qo, self._extras(len(rows)))]
        if staging == "exact":
            optimistic = kv
        for rid, length in zip(rids, optimistic):
            cache.reserve(rid, length)  # the block table must cover what prepare stages
        table = cache.block_table(rids, self.width)
        if staging == "capacity":
            optimistic = [self.width * s.block] * len(rows)
            table = table.clamp(min=0)
        meta.prepare(qo, optimistic, table)
        meta.on_update_kv_lens(torch.tensor(kv, dtype=torch.int32))

        def tokens(field, layer=None):
            parts = []
            for rid, p, a, g in rows:
                src = getattr(self.seqs[rid], field)
                src = src if layer is None else src[layer]
                parts.append(torch.cat([src[p : p + a], self.garbage(src, g)]))
            return torch.cat(parts)

        scale = s.head_dim ** -0.5
        outs = []
        for layer in (0, 1):
            write_kv(cache.k(layer), cache.v(layer), meta.cache_slots, tokens("k", layer), tokens("v", layer))
        write_index_k(cache.index_k(1), meta.cache_slots, tokens("index_k"))
        # the shared draft layer (dense, in the target's mega-slot, read through its virtual op pool)
        # gets layer 0's K/V, so it must give layer 0's output
        write_kv(cache.k(2), cache.v(2), meta.cache_slots, tokens("k", 0), tokens("v", 0))
        outs.append(dense_attention(tokens("q", 0), cache.k(0), cache.v(0), meta, scale=scale))
        selection = select_blocks_paged(tokens("index_q"), cache.index_k(1), meta, topk=s.topk, local_blocks=s.local)
        outs.append(sparse_attention(tokens("q", 1), cache.k(1), cache.v(1), meta, selection, scale=scale))
        outs.append(dense_attention(tokens("q", 0), cache.k(2), cache.v(2), meta, scale=scale))

        failures = []
        start = 0
        for (rid, p, a, g) in rows:
            seq = self.seqs[rid]
            for t in range(a):
                row, pos = start + t, p + t
                for layer, expected in ((0, seq.out[0]), (1, seq.out[1]), (2, seq.out[0])):
                    if not torch.allclose(outs[layer][row], expected[pos], **TOL):
                        err = (outs[layer][row] - expected[pos]).abs().max().item()
                        failures.append(f"request {rid} position {pos} layer {layer}: off by {err:.3g}")
                for h in range(s.kv_heads):
                    got = frozenset(b for b in selection[h, row].tolist() if b >= 0)
                    if got != seq.selection[h][pos]:
                        failures.append(f"request {rid} position {pos} head {h}: selected {sorted(got)}, "
                                        f"transformers {sorted(seq.selection[h][pos])}")
            start += a + g
        for rid, p, a, _ in rows:
            cache.rewind(rid, min(cache.num_tokens(rid), p + a))  # rejected drafts and the optimistic tail
        return failures

    def _extras(self, n: int) -> list[int]:
        return torch.randint(0, DRAFT_LEN + 1, (n,), generator=self.gen).tolist()


@settings(max_examples=30, deadline=None, derandomize=True)
@given(shape=SHAPES, lengths=st.lists(st.integers(1, 26), min_size=1, max_size=4), data=st.data())
def test_random_configs_and_schedules_match_transformers(shape, lengths, data) -> None:
    seed = data.draw(st.integers(0, 2**16), label="seed")
    oracle = Oracle(shape, seed)
    seqs = {rid: oracle.run(n, seed=seed + 1 + rid) for rid, n in enumerate(lengths)}
    need = sum(-(-(n + 2 * DRAFT_LEN + 1) // shape.block) for n in lengths)
    replay = Replay(shape, seqs, need + 2, seed)
    done = {rid: 0 for rid in seqs}
    joined: set[int] = set()
    failures: list[str] = []
    for _ in range(60):
        pending = [rid for rid in seqs if done[rid] < len(seqs[rid].index_k)]
        if not pending:
            break
        rows = []
        for rid in pending:
            if rid not in joined:
                if not data.draw(st.booleans(), label=f"join {rid}"):
                    continue
                replay.cache.add_request(rid)
                joined.add(rid)
            left = len(seqs[rid].index_k) - done[rid]
            kind = data.draw(st.sampled_from(["chunk", "verify", "idle"]), label="row")
            if kind == "idle":
                rows.append((rid, done[rid], 0, 0))
            elif kind == "chunk":
                rows.append((rid, done[rid], data.draw(st.integers(1, left), label="chunk"), 0))
            else:
                drafts = data.draw(st.integers(0, DRAFT_LEN), label="drafts")
                accepted = data.draw(st.integers(0, drafts), label="accepted")
                true = min(left, 1 + accepted)
                rows.append((rid, done[rid], true, 1 + drafts - true))
        if not rows:
            continue
        staging = data.draw(st.sampled_from(["exact", "optimistic", "capacity"]), label="staging")
        failures += replay.step(rows, staging)
        for rid, _, a, _ in rows:
            done[rid] += a
        for rid in list(joined):
            if done[rid] == len(seqs[rid].index_k) and data.draw(st.booleans(), label=f"free {rid}"):
                replay.cache.free(rid)  # its pages go to later joins, stale bytes and all
                joined.discard(rid)
                done[rid] = len(seqs[rid].index_k)
    assert not failures, f"{shape}: " + "; ".join(failures[:8])
