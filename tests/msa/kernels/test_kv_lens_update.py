"""Fused on_update_kv_lens kernel vs the naive re-derivation; graph-capture safety."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from kernel_case_helpers import SMALL, needs_gpu, random_step
from m3_eagle_plugin.bench import torch_reference as ref

pytestmark = needs_gpu


def _outputs(meta):
    return {k: torch.full_like(getattr(meta, k), 12345) for k in
            ("kv_lens", "qo_offsets", "positions", "token_kv_lens", "valid_blocks", "cache_slots")}


def _launch(meta, new, outs):
    from m3_eagle_plugin.msa.kernels.kv_lens_update import update_kv_lens

    update_kv_lens(staged_kv_lens=meta.kv_lens, new_kv_lens=new, qo_lens=meta.qo_lens, cu_qo_lens=meta.cu_qo_lens,
                   token_request=meta.token_request, block_tables=meta.block_tables, block_size=SMALL.block,
                   kv_lens_out=outs["kv_lens"], qo_offsets_out=outs["qo_offsets"], positions_out=outs["positions"],
                   token_kv_lens_out=outs["token_kv_lens"], valid_blocks_out=outs["valid_blocks"],
                   cache_slots_out=outs["cache_slots"])


def _check(meta, new, outs):
    expect = ref.update_kv_lens(meta.kv_lens, new, meta.qo_lens, meta.block_tables, SMALL.block,
                                meta.positions.shape[0])
    for key, want in expect.items():
        got = outs[key].long().cpu()[: want.shape[0]]
        assert torch.equal(got, want), f"{key}: {got.tolist()} != {want.tolist()}"


def test_correction_shrinks_lengths_and_graph_replay():
    meta, _, _, _ = random_step(SMALL, [4, 4, 4], [70, 40, 17], pad_tokens=2)
    new = torch.tensor([67, 100, 16], dtype=torch.int32, device="cuda")  # 100 > staged: clamped to 40
    outs = _outputs(meta)
    _launch(meta, new, outs)
    _check(meta, new, outs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(meta, new, outs)
    new.copy_(torch.tensor([66, 38, 15], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _check(meta, new, outs)


def test_without_new_lengths_rederives_staged():
    meta, _, _, _ = random_step(SMALL, [2, 5], [33, 80])
    outs = _outputs(meta)
    _launch(meta, None, outs)
    _check(meta, None, outs)
    assert torch.equal(outs["cache_slots"], meta.cache_slots)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 90), st.integers(0, 4)), min_size=1, max_size=6),
    seed=st.integers(0, 100),
)
def test_property_idempotent_and_exact(reqs, seed):
    qo_lens = [q for q, _, _ in reqs]
    kv_lens = [q + extra + shrink for q, extra, shrink in reqs]
    meta, _, _, _ = random_step(SMALL, qo_lens, kv_lens, seed=seed)
    new = torch.tensor([kv - s for kv, (_, _, s) in zip(kv_lens, reqs)], dtype=torch.int32, device="cuda")
    outs = _outputs(meta)
    _launch(meta, new, outs)
    _check(meta, new, outs)
    first = {k: v.clone() for k, v in outs.items()}
    _launch(meta, outs["kv_lens"].clone(), outs)
    for k in first:
        assert torch.equal(first[k], outs[k]), k
