"""The scoring -> top-k hand-off (`handoff`): each top-k program polls its own request's scores on
a sentinel-filled board instead of waiting for the whole scoring grid.

Against two independent things: the same selection computed with two plain launches (the top-k
after the whole scoring grid, on a fresh score buffer), and the float64 block-score oracle's
top-k rules. The board must hold only the sentinel again after every launch (the next step's
top-k trusts any other value), including after graph replays.

Device-agnostic: on a CUDA GPU (where the top-k launches early through PDL and really polls)
the checks run here; on CPU `tests._interpreter` runs them through Triton's interpreter.
"""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.bench.inputs import Geometry
from tests._interpreter import check_module_cases, needs_interpreter

from .kernel_case_helpers import (assert_valid_selection, capture_after_warmup, check_zeroed_shared_growing,
                                  compile_for_sm90, exact_block_scores, random_step, sm90_compiler_available)

GEO = Geometry(q_heads=16, kv_heads=1, head_dim=32, index_heads=2, index_dim=32, block=16, topk=4)


def _board_clean(device):
    from m3_eagle_plugin.msa.kernels import handoff

    board = handoff.score_board(device, 1).untyped_storage()
    words = torch.empty(0, dtype=torch.int32, device=device).set_(board).cpu()
    dirty = (words != handoff.SENTINEL).nonzero().flatten()
    assert dirty.numel() == 0, f"board entries left written: {dirty[:8].tolist()}"


def check_handoff_selects_like_two_launches(device, *, qo_lens=(4, 1, 3), kv_lens=(150, 16, 97), union_group=None,
                                            local=1, init=0, pad_tokens=0, seed=0, topk=GEO.topk):
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    # fp16, not the production bf16: Triton's interpreter has no bf16 dot.
    meta, cache, _, index_q = random_step(GEO, list(qo_lens), list(kv_lens), kv_dtype=torch.float16,
                                          index_dtype=torch.float16, seed=seed, pad_tokens=pad_tokens, device=device)
    kw = dict(topk=topk, local_blocks=local, init_blocks=init, max_qo_len=max(qo_lens), union_group=union_group)
    got = select_blocks_verify(index_q, cache.index_k, meta, handoff=True, **kw)
    want = select_blocks_verify(index_q, cache.index_k, meta, handoff=False, **kw)
    _board_clean(device)
    if union_group is not None:
        (got, got_union), (want, want_union) = got, want
        assert torch.equal(got_union.counts, want_union.counts)
        listed = torch.arange(got_union.ids.shape[-1], device=device) < got_union.counts[..., None]
        for name in ("ids", "pages", "bits"):  # entries past each list's count are unwritten
            assert torch.equal(getattr(got_union, name)[listed], getattr(want_union, name)[listed]), name
    assert torch.equal(got.cpu(), want.cpu())
    live = sum(qo_lens)
    assert (got[:, live:].cpu() == -1).all()
    assert_valid_selection(got[:, :live], exact_block_scores(index_q, cache.index_k, meta), topk,
                           local_blocks=local, init_blocks=init)


def check_board_reused_across_batches(device):
    """Growing, shrinking and reshaped batches reuse one board (its rows land on different
    entries each time): each launch leaves it clean, so no step reads another's scores."""
    for qo_lens, kv_lens in (((2, 3), (40, 70)), ((1,) * 6, (16, 17, 31, 48, 1, 90)), ((4, 4), (64, 33))):
        check_handoff_selects_like_two_launches(device, qo_lens=qo_lens, kv_lens=kv_lens)


#: The interpreter's share (small launches: CI has two cores).
INTERPRETER_CASES = [
    (check_handoff_selects_like_two_launches, dict()),
    (check_handoff_selects_like_two_launches, dict(union_group=16, local=2, init=1, pad_tokens=3, seed=1)),
    (check_board_reused_across_batches, dict()),
    (check_handoff_selects_like_two_launches, dict(qo_lens=(1, 2), kv_lens=(60, 30), topk=8)),  # all blocks chosen
]


def test_board_is_sentinel_filled_shared_and_grows():
    from m3_eagle_plugin.msa.kernels.handoff import MIN_ENTRIES, SENTINEL, score_board

    a = score_board("cpu", 8)
    assert a.shape == (8,) and a.dtype == torch.float32
    assert (a.view(torch.int32) == SENTINEL).all() and a.isnan().all()
    assert score_board("cpu", 3).data_ptr() == a.data_ptr()
    big = score_board("cpu", MIN_ENTRIES + 5)
    assert big.shape == (MIN_ENTRIES + 5,) and (big.view(torch.int32) == SENTINEL).all()
    assert score_board("cpu", 1).data_ptr() == big.data_ptr()


def test_a_first_small_board_is_allocated_at_4_mb(monkeypatch):
    """At least MIN_ENTRIES entries (its comment: 4 MB), so growing batches rarely need a new board."""
    from m3_eagle_plugin.msa.kernels import handoff

    monkeypatch.setattr(handoff, "_BOARDS", {})
    handoff.score_board("cpu", 8)
    assert handoff._BOARDS[torch.device("cpu")].numel() * 4 == 4 << 20


def test_ready_flags_are_zero_shared_and_grow():
    from m3_eagle_plugin.msa.kernels.handoff import ready_flags

    check_zeroed_shared_growing(ready_flags)


def test_sentinel_is_no_float_arithmetic_result():
    """The board's idle value is a signalling NaN; float arithmetic (here the ops the scoring
    applies: a product sum, a max, -inf masking) only yields the canonical quiet NaN."""
    from m3_eagle_plugin.msa.kernels.handoff import SENTINEL

    bad = torch.tensor([SENTINEL], dtype=torch.int32).view(torch.float32)
    made = torch.stack([(bad * 1.0)[0], (bad + 0.0)[0], torch.maximum(bad, torch.tensor([0.0]))[0],
                        torch.tensor(float("nan")), torch.tensor(float("inf")) - float("inf")])
    assert (made.view(torch.int32) != SENTINEL).all()


def test_sentinel_is_the_negative_signalling_nan_its_comment_names():
    """The bits by hand: sign set, exponent all ones, quiet bit (22) clear, a mantissa (a NaN, not
    an infinity); and the hex the module's comment gives (it once named another pattern)."""
    import inspect
    import re

    from m3_eagle_plugin.msa.kernels import handoff

    bits = handoff.SENTINEL & 0xFFFFFFFF
    assert bits >> 31 == 1 and (bits >> 23) & 0xFF == 0xFF and not bits & (1 << 22) and bits & 0x7FFFFF
    named = re.search(r"signalling NaN \((0x[0-9A-Fa-f]{8})\)", inspect.getsource(handoff))
    assert named and int(named.group(1), 16) == bits, (named and named.group(1), hex(bits))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("fn,kw", INTERPRETER_CASES + [
    # M3 shape: 128-token pages, top-16, 32 requests of 4 verify tokens at 4-8K context.
    (check_handoff_selects_like_two_launches, dict(qo_lens=(4,) * 32, kv_lens=tuple(4000 + 131 * i for i in range(32)),
                                                   pad_tokens=5, seed=3)),
    # top-k at least the table's padded width (every visible block chosen), one warp a program: the
    # polled row is then read by nothing, which Triton 3.6 failed to compile
    (check_handoff_selects_like_two_launches, dict(qo_lens=(1, 1), kv_lens=(400, 200), topk=32)),
])
def test_on_gpu(fn, kw):
    fn("cuda", **kw)


@needs_cuda
def test_graph_replay_leaves_the_board_clean():
    """Captured once, replayed three times with the output poisoned in between: same selection as
    eager, board clean after each replay; a capture that needs a bigger board takes the plain path."""
    from m3_eagle_plugin.msa.kernels import handoff
    from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify

    meta, cache, _, index_q = random_step(GEO, [4, 2, 4, 1], [300, 45, 1000, 16], pad_tokens=2)
    kw = dict(topk=GEO.topk, max_qo_len=4)
    eager = select_blocks_verify(index_q, cache.index_k, meta, **kw)
    graph, replayed = capture_after_warmup(lambda: select_blocks_verify(index_q, cache.index_k, meta, **kw))
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert handoff.score_board("cuda", handoff.score_board("cuda", 1).untyped_storage().nbytes()) is None
    for _ in range(3):
        replayed.fill_(7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
        _board_clean("cuda")


@needs_interpreter
def test_kernel_in_the_interpreter():
    check_module_cases("tests.msa.kernels.test_handoff")


@needs_interpreter
def test_a_step_cut_off_between_its_launches_leaves_the_handoff_idle():
    """A Ctrl-C raised as the scoring's (or the whole selection's) launch returns: no scores left on
    the board, no flags left set for an attention never launched (`interpret_cut_off`)."""
    check_module_cases("tests.msa.kernels.interpret_cut_off")


@needs_cuda
@pytest.mark.parametrize("case", range(2))
def test_a_step_cut_off_between_its_launches_leaves_the_handoff_idle_on_gpu(case):
    from .interpret_cut_off import INTERPRETER_CASES

    fn, kw = INTERPRETER_CASES[case]
    fn("cuda", **kw)


def test_a_reset_reaches_the_boards_and_flags_a_bigger_step_replaced(monkeypatch):
    """A step recorded before a bigger one grew the board or the flags replays on the old ones
    (`replay`), so a step cut off there leaves those dirty: the reset must reach them too."""
    from m3_eagle_plugin.msa.kernels import handoff

    monkeypatch.setattr(handoff, "_BOARDS", {})
    monkeypatch.setattr(handoff, "_READY", {})
    cpu = torch.device("cpu")
    old_board = handoff.score_board(cpu, 8)
    old_flags = handoff.ready_flags(cpu, 8)
    handoff.score_board(cpu, handoff._BOARDS[cpu].numel() + 1)
    handoff.ready_flags(cpu, handoff._READY[cpu].numel() + 1)
    assert handoff._BOARDS[cpu].data_ptr() != old_board.data_ptr() and handoff._READY[cpu].data_ptr() != \
        old_flags.data_ptr(), "neither buffer was replaced"
    for board in (old_board, handoff._BOARDS[cpu]):
        board.fill_(0.5)  # scores no top-k took back
    for flags in (old_flags, handoff._READY[cpu]):
        flags.fill_(2)  # set for an attention never launched
    handoff.reset_board(cpu)
    assert (old_board.view(torch.int32) == handoff.SENTINEL).all(), "the replaced board kept its scores"
    handoff.reset_handoff(cpu)
    for board in (old_board, handoff._BOARDS[cpu]):
        assert (board.view(torch.int32) == handoff.SENTINEL).all()
    for flags in (old_flags, handoff._READY[cpu]):
        assert (flags == 0).all()


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("", True), (" 0 ", False)])
def test_env_turns_the_handoff_off(monkeypatch, value, on):
    from m3_eagle_plugin.msa.kernels.handoff import handoff_enabled

    if value is None:
        monkeypatch.delenv("M3_EAGLE_HANDOFF", raising=False)
    else:
        monkeypatch.setenv("M3_EAGLE_HANDOFF", value)
    assert handoff_enabled() is on


def test_bad_env_value_names_the_allowed_ones(monkeypatch):
    from m3_eagle_plugin.msa.kernels import KernelInputError
    from m3_eagle_plugin.msa.kernels.handoff import handoff_enabled

    monkeypatch.setenv("M3_EAGLE_HANDOFF", "yes")
    with pytest.raises(KernelInputError, match="M3_EAGLE_HANDOFF='yes': expected one of 0, 1"):
        handoff_enabled()


@pytest.mark.skipif(not sm90_compiler_available(), reason="needs Triton's compiler")
@pytest.mark.parametrize("nbp,topk,warps", [(32, 32, 1), (64, 100, 2), (128, 128, 1), (1024, 16, 8)])
def test_the_polling_top_k_compiles_for_sm90_where_every_block_is_chosen(nbp, topk, warps):
    """Compiled for an H100/H200 target on any machine (no GPU needed): with the hand-off on and
    the padded width at most top-k, the top-k once crashed Triton 3.6's compiler."""
    from m3_eagle_plugin.msa.kernels._common import next_pow2
    from m3_eagle_plugin.msa.kernels.index_select import _topk_union_kernel

    constexprs = dict(QP=1, NCH=1, NBP=nbp, TOPK=topk, TOPK_P=next_pow2(topk), LOCAL=1, INIT=0, WRITE_UNION=False,
                      HANDOFF=True, ANNOUNCE=0, PDL=True)
    compile_for_sm90(_topk_union_kernel, constexprs, {"score_ptr": "*fp32"}, num_warps=warps)
