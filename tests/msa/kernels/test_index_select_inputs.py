"""The index scoring and top-k launchers refuse inputs their grids would misread (checked on the
host before any launch, so these run on any machine)."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from m3_eagle_plugin.msa.kernels import KernelInputError  # noqa: E402

from .kernel_case_helpers import SMALL, random_step  # noqa: E402


def _step():
    return random_step(SMALL, [4, 2], [70, 30], index_dtype=torch.float32, device="cpu")


def test_index_q_with_fewer_rows_than_the_metadata_is_refused():
    from m3_eagle_plugin.msa.kernels.index_select import index_block_scores

    meta, cache, _, index_q = _step()
    with pytest.raises(KernelInputError, match="index_q has 2 rows, fewer than the metadata's 6 tokens"):
        index_block_scores(index_q[:2], cache.index_k, meta)


def test_an_index_cache_of_another_block_size_is_refused():
    from m3_eagle_plugin.msa.kernels.index_select import index_block_scores

    meta, cache, _, index_q = _step()
    other = types.SimpleNamespace(**{f: getattr(meta, f) for f in ("block_tables", "kv_lens", "cu_qo_lens",
                                                                   "positions")}, block_size=2 * SMALL.block)
    with pytest.raises(KernelInputError, match=f"has {SMALL.block}-token pages but the metadata's block_size"):
        index_block_scores(index_q, cache.index_k, other)


def test_forced_blocks_past_topk_are_refused_as_the_reference_does():
    from m3_eagle_plugin.msa.kernels.index_select import topk_from_block_scores

    meta, _, _, _ = _step()
    scores = torch.zeros(1, 6, meta.block_tables.shape[1])
    with pytest.raises(KernelInputError, match="local_blocks 1 \\+ init_blocks 2 exceed topk 2"):
        topk_from_block_scores(scores, meta, topk=2, local_blocks=1, init_blocks=2)


def _out_cases(heads: int, tokens: int, width: int) -> dict:
    """Scoring outputs the kernel would misfill, and what the refusal names."""
    wide = torch.empty(heads, tokens, 2 * width)
    return {
        "too narrow": (torch.empty(heads, tokens, width - 1), f"out must be \\[Hi={heads}, T={tokens}, {width}\\]"),
        "too few tokens": (torch.empty(heads, tokens - 1, width), f"out must be \\[Hi={heads}, T={tokens}, {width}\\]"),
        "fp16": (torch.empty(heads, tokens, width, dtype=torch.float16), "out must be float32"),
        "strided blocks": (wide[..., ::2], "out must have unit stride in its last"),
        "heads sharing rows": (torch.empty(1, tokens, width).expand(heads, -1, -1), "give two entries one address"),
    }


@pytest.mark.parametrize("case", ["too narrow", "too few tokens", "fp16", "strided blocks", "heads sharing rows"])
def test_a_scoring_out_the_kernel_would_misfill_is_refused_before_launch(monkeypatch, case):
    """The kernel stores every visible block's score through `out`'s strides, for every index head
    and token: a smaller, narrower, 16-bit, block-strided or self-overlapping `out` would be written
    past its end or into itself."""
    from m3_eagle_plugin.msa.kernels import index_select

    monkeypatch.setattr(index_select, "launch", lambda *a, **k: pytest.fail("launched"))
    meta, cache, _, index_q = _step()
    out, expect = _out_cases(index_q.shape[1], index_q.shape[0], meta.block_tables.shape[1])[case]
    with pytest.raises(KernelInputError, match=expect):
        index_select.index_block_scores(index_q, cache.index_k, meta, out=out)


def test_a_scoring_out_in_the_kernels_layout_passes_the_checks(monkeypatch):
    """A strided view (a slice of a wider buffer) is taken: the kernel reads `out`'s row strides."""
    from m3_eagle_plugin.msa.kernels import index_select

    launched = []
    monkeypatch.setattr(index_select, "launch", lambda *a, **k: launched.append(a))
    meta, cache, _, index_q = _step()
    width = meta.block_tables.shape[1]
    out = torch.empty(index_q.shape[1], index_q.shape[0], width + 3)[..., :width]
    assert index_select.index_block_scores(index_q, cache.index_k, meta, out=out) is out
    assert launched


def test_a_scoring_out_whose_heads_interleave_without_meeting_is_taken(monkeypatch):
    """Every entry its own address (enumerated below), though head 1's rows sit between head 0's:
    the kernel stores through `out`'s strides, so it is written correctly; it was refused as
    giving "two entries one address"."""
    import itertools

    from m3_eagle_plugin.msa.kernels import index_select

    launched = []
    monkeypatch.setattr(index_select, "launch", lambda *a, **k: launched.append(a))
    meta, cache, _, index_q = _step()
    width, tokens = meta.block_tables.shape[1], index_q.shape[0]
    index_q = index_q[:, :1].expand(-1, 2, -1).contiguous()  # two index heads
    strides = (3 * width, 2 * width, 1)  # token rows 2W apart, head 1 offset by 3W: into the gaps
    out = torch.empty(2 * width * tokens + 2 * width).as_strided((2, tokens, width), strides)
    offsets = [sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, out.shape))]
    assert len(set(offsets)) == len(offsets)
    assert index_select.index_block_scores(index_q, cache.index_k, meta, out=out) is out
    assert launched


@pytest.mark.parametrize("scores, expect", [
    (lambda h, t, w: torch.zeros(h, t, w, dtype=torch.float16), "block_scores must be float32"),
    (lambda h, t, w: torch.zeros(h, t, 2 * w)[..., ::2], "block_scores must have unit stride in its last"),
    (lambda h, t, w: torch.zeros(h, t - 1, w), "block_scores has 5 token rows, fewer than the metadata's 6"),
], ids=["fp16", "strided blocks", "too few tokens"])
def test_top_k_refuses_scores_it_would_misread_before_launch(monkeypatch, scores, expect):
    """The top-k reads fp32 rows of adjacent blocks and writes a selection row for every metadata
    token into an output sized by `block_scores`' tokens."""
    from m3_eagle_plugin.msa.kernels import index_select

    monkeypatch.setattr(index_select, "launch", lambda *a, **k: pytest.fail("launched"))
    meta, _, _, index_q = _step()
    bad = scores(index_q.shape[1], meta.valid_blocks.shape[0], meta.block_tables.shape[1])
    with pytest.raises(KernelInputError, match=expect):
        index_select.topk_from_block_scores(bad, meta, topk=2)


def test_top_k_refuses_scores_narrower_than_the_blocks_its_tokens_may_hold(monkeypatch):
    """Each row is read up to `valid_blocks[t]` entries, a device value, so the host bounds it by
    the block table's width (here 6: the longest request's five 16-token blocks and one spare), or
    by the metadata's own `max_step_blocks` where it keeps one (five for 70 tokens)."""
    from m3_eagle_plugin.msa.kernels import index_select

    launched = []
    monkeypatch.setattr(index_select, "launch", lambda *a, **k: launched.append(a[0]))
    meta, _, _, index_q = _step()
    heads, tokens = index_q.shape[1], meta.valid_blocks.shape[0]
    assert meta.block_tables.shape[1] == 6
    with pytest.raises(KernelInputError, match="block_scores has 5 block columns, fewer than the 6 blocks"):
        index_select.topk_from_block_scores(torch.zeros(heads, tokens, 5), meta, topk=2)
    fields = ("block_tables", "kv_lens", "cu_qo_lens", "valid_blocks")
    hosted = types.SimpleNamespace(max_step_blocks=5, **{name: getattr(meta, name) for name in fields})
    with pytest.raises(KernelInputError, match="block_scores has 4 block columns, fewer than the 5 blocks"):
        index_select.topk_from_block_scores(torch.zeros(heads, tokens, 4), hosted, topk=2)
    assert not launched
    index_select.topk_from_block_scores(torch.zeros(heads, tokens, 5), hosted, topk=2)
    index_select.topk_from_block_scores(torch.zeros(heads, tokens, 6), meta, topk=2)
    assert len(launched) == 2


@pytest.mark.parametrize("kw, name", [
    (dict(topk=4, local_blocks=1.5), "local_blocks"),  # constexpr 1.5: nv - 1.5 forced two local blocks
    (dict(topk=4, init_blocks=0.5), "init_blocks"),
    (dict(topk=4, local_blocks=True), "local_blocks"),
    (dict(topk=True), "topk"),
    (dict(topk=3.0), "topk"),
])
def test_selection_counts_the_reference_refuses_are_refused_before_any_launch(monkeypatch, kw, name):
    from m3_eagle_plugin.msa import select_blocks_paged
    from m3_eagle_plugin.msa.kernels import index_select

    meta, cache, _, index_q = _step()

    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(index_select, "launch", no_launch)
    with pytest.raises(TypeError, match=f"{name} must be an int"):  # the torch reference
        select_blocks_paged(index_q, cache.index_k, meta, **kw)
    scores = torch.zeros(index_q.shape[1], 6, meta.block_tables.shape[1])
    with pytest.raises(KernelInputError, match=f"{name} must be an int"):
        index_select.topk_from_block_scores(scores, meta, **kw)
    for handoff in (False, True):  # refused before the scoring runs, not after it
        with pytest.raises(KernelInputError, match=f"{name} must be an int"):
            index_select.select_blocks_verify(index_q, cache.index_k, meta, handoff=handoff, **kw)


def test_an_index_cache_of_no_pages_takes_no_tma_descriptor(monkeypatch):
    """A step of no request (graph-padding rows only) over a cache of zero pages selects as the
    reference (nothing) with every padding row -1; on a GPU with TMA the scoring built a descriptor
    first, which Triton refuses for a zero dim with a bare AssertionError."""
    from m3_eagle_plugin.msa import MsaDecodeMetadata, select_blocks_paged
    from m3_eagle_plugin.msa.kernels import index_select

    monkeypatch.setattr(index_select, "device_capability", lambda device: (9, 0))  # an SM90 GPU: TMA applies
    monkeypatch.setattr(index_select, "launch", lambda *a, **k: pytest.fail("launched"))
    meta = MsaDecodeMetadata(2, 4, 2, 16, "cpu", max_draft_len=3)
    meta.prepare([], [], torch.zeros(0, 2, dtype=torch.int32))
    index_k = torch.zeros(0, 16, 16, dtype=torch.float16)
    index_q = torch.randn(2, 1, 16).half()
    assert index_select.page_descriptor(index_k) is None
    assert select_blocks_paged(index_q[:0], index_k, meta, topk=2).shape == (1, 0, 2)
    for handoff in (False, True):
        sel = index_select.select_blocks_verify(index_q, index_k, meta, topk=2, handoff=handoff)
        assert sel.tolist() == [[[-1, -1], [-1, -1]]]
