"""The Triton top-k program against a plain sort oracle on scores built to tie: equal scores (the
lower block id wins), +0.0 against -0.0 (equal), -inf scores, fewer visible blocks than top-k,
forced local/init blocks, and random rows. Run on the GPU by `test_index_select.py` and on CPU
through Triton's interpreter by `test_interpreter.py` (one PASS/FAIL line per case)."""
from __future__ import annotations

import math
import sys

import torch

from m3_eagle_plugin.bench.step_meta import build_step_meta


def oracle(scores: torch.Tensor, valid: list[int], topk: int, local: int, init: int) -> torch.Tensor:
    """int32 [H, T, topk]: per row the `topk` visible blocks by (NaN scores first, as torch's sort
    ranks them, then forced, then score desc; id asc within each), ascending, -1 padded."""
    heads, tokens, _ = scores.shape
    out = torch.full((heads, tokens, topk), -1, dtype=torch.int32)
    for h in range(heads):
        for t in range(tokens):
            nv = valid[t]
            def key(b):
                forced, s = b >= nv - local or b < init, float(scores[h, t, b])
                return (1, 0.0, b) if forced else (0, 0.0, b) if math.isnan(s) else (2, -s, b)
            rank = sorted(range(nv), key=key)
            chosen = sorted(rank[:topk])
            out[h, t, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def _case(device, kv_lens, make_scores, *, topk=4, local=1, init=0, qo=2, block=16):
    from m3_eagle_plugin.msa.kernels.index_select import topk_from_block_scores

    width = max(-(-kv // block) for kv in kv_lens)
    tables = torch.arange(len(kv_lens) * width, dtype=torch.int32).reshape(len(kv_lens), width)
    meta = build_step_meta([qo] * len(kv_lens), kv_lens, tables, block, device=device)
    scores = make_scores(2, len(kv_lens) * qo, width).to(torch.float32)
    want = oracle(scores, meta.valid_blocks.cpu().tolist(), topk, local, init)
    for union_group in (None, 16):  # one token per program, and token chunks writing union lists
        got, _ = topk_from_block_scores(scores.to(device), meta, topk=topk, local_blocks=local, init_blocks=init,
                                        max_qo_len=qo, union_group=union_group)
        assert torch.equal(got.cpu(), want), (union_group, got.cpu(), want)


def case_all_equal(device):
    _case(device, [160, 130, 33], lambda h, t, w: torch.ones(h, t, w))


def case_signed_zeros_tie(device):
    def scores(h, t, w):
        s = torch.zeros(h, t, w)
        s[..., ::2] = -0.0
        return s
    _case(device, [160, 97], scores)


def case_negative_and_minus_inf(device):
    def scores(h, t, w):
        s = -torch.arange(h * t * w, dtype=torch.float32).reshape(h, t, w) % 7 - 3.0
        s[..., 1::3] = float("-inf")
        return s
    _case(device, [160, 128, 129], scores, init=1)


def case_nan_scores_rank_first_whatever_their_sign(device):
    # A NaN with its sign bit set (as torch.float("-nan") makes) is still first, and ties the others.
    def scores(h, t, w):
        s = torch.randn(h, t, w, generator=torch.Generator().manual_seed(5))
        s[..., 3::7] = float("nan")
        s[..., 5::7] = -torch.tensor(float("nan"))
        return s
    assert (-torch.tensor(float("nan"))).view(torch.int32) < 0
    _case(device, [300, 160, 97], scores, topk=5, local=1, init=1)


def case_fewer_visible_than_topk(device):
    _case(device, [20, 40, 160], lambda h, t, w: torch.randn(h, t, w, generator=torch.Generator().manual_seed(1)),
          topk=8, local=2)


def case_topk_not_a_power_of_two(device):
    for topk in (1, 3, 5, 7):
        _case(device, [300, 129, 77], lambda h, t, w: torch.randn(h, t, w, generator=torch.Generator().manual_seed(topk)),
              topk=topk, local=min(topk, 2))


def case_rows_no_wider_than_topk(device):
    _case(device, [40, 20, 48], lambda h, t, w: torch.randn(h, t, w, generator=torch.Generator().manual_seed(3)))


def case_random_rows_long(device):
    gen = torch.Generator().manual_seed(2)
    _case(device, [2000, 1500, 700], lambda h, t, w: torch.randn(h, t, w, generator=gen).round(decimals=1),
          topk=16, local=1, init=2, qo=4)


def case_wide_rows_tied_at_the_cut(device):
    # 1024 blocks a row (a 128K context's width): coarse scores tie at the top-k's cut in most rows
    gen = torch.Generator().manual_seed(4)
    _case(device, [16384, 9000], lambda h, t, w: torch.randn(h, t, w, generator=gen).round(), topk=16, local=1)


CASES = [case_all_equal, case_signed_zeros_tie, case_negative_and_minus_inf,
         case_nan_scores_rank_first_whatever_their_sign, case_fewer_visible_than_topk, case_topk_not_a_power_of_two, case_rows_no_wider_than_topk, case_random_rows_long,
         case_wide_rows_tied_at_the_cut]


def main() -> int:
    failed = 0
    for case in CASES:
        try:
            case("cpu")
            print("PASS", case.__name__)
        except Exception as exc:  # noqa: BLE001 - report every case
            failed += 1
            print("FAIL", case.__name__, f"{type(exc).__name__}: {exc}"[:400])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
