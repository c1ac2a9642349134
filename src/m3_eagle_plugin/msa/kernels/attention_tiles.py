"""Triton device functions shared by the verify attention kernels (`sparse_verify`, `dense_verify`).

Why: the sparse layouts and the dense causal ladder differ in which pages a program walks, not in
what it does with a page: load K and V of a key tile, fold it into an online softmax (exp2, with
the scale folded into `qk_scale` = scale x LOG2E), and write finished rows or split partials.
One copy of that inner loop keeps the kernels' numerics identical.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: log2(e): the kernels take exp2, so the softmax scale is pre-multiplied by it.
LOG2E = 1.4426950408889634


@triton.jit
def softmax_tile(q, k, m_i, l_i, qk_scale, row_has, key_pos, pos, IEEE: tl.constexpr):
    """Scores of one key tile -> (p, alpha, m_new, l_new) of flash attention in log2 units; keys
    masked per row by selection and causality."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    visible = row_has[:, None] & (key_pos[None, :] <= pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, row_has, key_pos, pos, pos_max, IEEE: tl.constexpr,
                        GUARD_V: tl.constexpr = True):
    """One key tile of flash attention (`softmax_tile`, then P V into `acc`).

    `pos_max` is the largest position of the tile's rows: every key at or below it was written
    (positions precede the step's kv length), so only keys above it can hold garbage. Callers
    that load V with that mask already pass GUARD_V=False.
    """
    # A key past every row's position can hold anything (an unwritten tail slot is NaN after
    # torch.empty or an fp8 NaN pattern), and p = 0 does not cancel it: 0 * NaN = NaN. Zero those
    # V rows (unmapped pages already load as 0). An elementwise test: no cross-warp reduction.
    if GUARD_V:
        v = tl.where((key_pos <= pos_max)[:, None], v, 0.0).to(q.dtype)
    p, alpha, m_new, l_i = softmax_tile(q, k, m_i, l_i, qk_scale, row_has, key_pos, pos, IEEE)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc


@triton.jit
def e4m3_lanes_to_f16(x, HIGH: tl.constexpr, ASM: tl.constexpr):
    """f16 of the low (HIGH=False) or high e4m3 byte of each 16-bit lane of `x`.

    With ASM, two lanes (a thread's two consecutive keys in the MMA operand layout) become one
    f16x2 through one byte permute and one convert; the interpreter takes the portable form.
    """
    if ASM:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; .reg .b16 l, h; prmt.b32 t, $1, 0, " + ("0x0031" if HIGH else "0x0020") + "; "
                "mov.b32 {l, h}, t; cvt.rn.f16x2.e4m3x2 $0, l; }",
            constraints="=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=2)
    return ((x >> (8 if HIGH else 0)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def load_keys(q, k_ptr, s_k_b, v_ptr, s_v_b, k_at, v_at, key, d, k_ok, v_ok, VPAIR: tl.constexpr):
    """K (in q's dtype) and V of keys `key` past element offsets `k_at` / `v_at` (a page and KV
    head: one offset, or one per key as `[BN, 1]`). With VPAIR (e4m3 V, f16 MMAs) V is read as
    16-bit lanes of two head dims: a lane layout the MMA operand load can transpose (a byte
    layout cannot); `fold_keys` splits it into the even and the odd dims."""
    k = tl.load(k_ptr + k_at + key[:, None] * s_k_b + d[None, :], mask=k_ok, other=0.0).to(q.dtype)
    if VPAIR:
        lane = tl.arange(0, d.shape[0] // 2)
        rows = (v_ptr + v_at + key[:, None] * s_v_b).to(tl.pointer_type(tl.int16), bitcast=True)
        v = tl.load(rows + lane[None, :], mask=v_ok, other=0)
    else:
        v = tl.load(v_ptr + v_at + key[:, None] * s_v_b + d[None, :], mask=v_ok, other=0.0).to(q.dtype)
    return k, v


@triton.jit
def attend_page_tile(q, k_ptr, s_k_p, s_k_h, s_k_b, v_ptr, s_v_p, s_v_h, s_v_b, g, page, key, kpos, d, row_has,
                     pos, pos_max, m_i, l_i, acc, acc_hi, qk_scale, IEEE: tl.constexpr, VPAIR: tl.constexpr,
                     ASM: tl.constexpr):
    """Load keys `key` of a page (K and V of KV head g) and fold them into the online softmax.

    An unmapped page (-1) is never dereferenced and never attended; V rows past `pos_max` load as
    0. Under VPAIR the even head dims accumulate in `acc`, the odd ones in `acc_hi` (each
    `[rows, D / 2]`); `join_dim_halves` interleaves them back.
    """
    mapped = page >= 0
    page = tl.maximum(page, 0).to(tl.int64)
    k, v = load_keys(q, k_ptr, s_k_b, v_ptr, s_v_b, page * s_k_p + g * s_k_h, page * s_v_p + g * s_v_h, key, d,
                     mapped, mapped & (kpos <= pos_max)[:, None], VPAIR)
    return fold_keys(q, k, v, m_i, l_i, acc, acc_hi, qk_scale, row_has & mapped, kpos, pos, pos_max, IEEE, VPAIR,
                     ASM)


@triton.jit
def attend_two_pages(q, k_ptr, s_k_p, s_k_h, s_k_b, v_ptr, s_v_p, s_v_h, s_v_b, g, page, key, kpos, d, row_has,
                     pos, pos_max, m_i, l_i, acc, acc_hi, qk_scale, IEEE: tl.constexpr, VPAIR: tl.constexpr,
                     ASM: tl.constexpr):
    """`attend_page_tile` over a tile of two pages: `page`, `key` and `kpos` are per key (the
    tile's first half from one page, the second half from another; page -1 where unmapped).

    Why: the one-page tile stalls on dependencies (ncu, B16/32K q4: 3.7 cycles a warp
    instruction, one warp a scheduler, 22% of issue slots busy); a two-page tile halves a
    program's tiles and gives each warp twice the independent MMAs and reductions per barrier.
    """
    mapped = page >= 0
    kpos = tl.where(mapped, kpos, 2147483647)  # an unmapped key is past every position
    page = tl.maximum(page, 0).to(tl.int64)[:, None]
    k, v = load_keys(q, k_ptr, s_k_b, v_ptr, s_v_b, page * s_k_p + g * s_k_h, page * s_v_p + g * s_v_h, key, d,
                     mapped[:, None], (kpos <= pos_max)[:, None], VPAIR)
    return fold_keys(q, k, v, m_i, l_i, acc, acc_hi, qk_scale, row_has, kpos, pos, pos_max, IEEE, VPAIR, ASM)


@triton.jit
def fold_keys(q, k, v, m_i, l_i, acc, acc_hi, qk_scale, row_has, kpos, pos, pos_max, IEEE: tl.constexpr,
              VPAIR: tl.constexpr, ASM: tl.constexpr):
    """Fold a loaded key tile into the online softmax: K in q's dtype, V likewise or as e4m3
    lanes under VPAIR, zero past `pos_max` either way."""
    if VPAIR:
        p, alpha, m_i, l_i = softmax_tile(q, k, m_i, l_i, qk_scale, row_has, kpos, pos, IEEE)
        p = p.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, e4m3_lanes_to_f16(v, False, ASM))
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, e4m3_lanes_to_f16(v, True, ASM))
    else:
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, row_has, kpos, pos,
                                            pos_max, IEEE, GUARD_V=False)
    return m_i, l_i, acc, acc_hi


@triton.jit
def join_dim_halves(acc, acc_hi, VPAIR: tl.constexpr):
    """The `[rows, D]` accumulator: even and odd head dims interleaved back under VPAIR."""
    out = acc
    if VPAIR:
        out = tl.reshape(tl.join(acc, acc_hi), [acc.shape[0], 2 * acc.shape[1]])
    return out


@triton.jit
def store_rows(o_ptr, s_o_t, s_o_h, lse_ptr, acc, m_i, l_i, tok, head, d, row_ok, num_heads, split, v_scale,
               D: tl.constexpr, SPLITS: tl.constexpr):
    """Write finished rows: the output itself (one split), or a partial and its LSE for `merge_splits`."""
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    if SPLITS == 1:
        o = acc / safe_l[:, None] * v_scale
        tl.store(o_ptr + tok[:, None] * s_o_t + head[:, None] * s_o_h + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        prow = (tok.to(tl.int64) * num_heads + head) * SPLITS + split
        tl.store(o_ptr + prow[:, None] * D + d[None, :], (acc / safe_l[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + prow, lse, mask=row_ok)


@triton.jit
def zero_graph_padding(o_ptr, s_o_t, s_o_h, cu_ptr, num_tokens, g, G: tl.constexpr, D: tl.constexpr):
    """One split writes `out` itself (no merge pass, no memset): the rows of tokens past the last
    request (graph padding) get zeros, spread over the programs of each KV-head group. Every
    attention kernel's grid is (requests, KV heads, programs per request)."""
    p = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
    d = tl.arange(0, D)
    for t in range(tl.load(cu_ptr + tl.num_programs(0)) + p, num_tokens, tl.num_programs(0) * tl.num_programs(2)):
        for h in range(g * G, g * G + G):
            tl.store(o_ptr + t * s_o_t + h * s_o_h + d, tl.zeros([D], o_ptr.dtype.element_ty))
