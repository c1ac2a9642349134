"""Shared builders and oracles for the Triton kernel tests (random paged steps, selection checks)."""
from __future__ import annotations

import math

import pytest
import torch

from m3_eagle_plugin.bench.inputs import Geometry, make_cache, shuffled_block_tables
from m3_eagle_plugin.bench.step_meta import build_step_meta

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need a CUDA device")

SMALL = Geometry(q_heads=8, kv_heads=2, head_dim=32, index_heads=2, index_dim=32, block=16, topk=4)
M3 = Geometry()


def random_step(geo: Geometry, qo_lens: list[int], kv_lens: list[int], *, kv_dtype=torch.bfloat16,
                index_dtype=torch.bfloat16, q_dtype=torch.bfloat16, seed: int = 0, pad_tokens: int = 0,
                spare_pages: int = 3, correlation: float = 0.0, device: str = "cuda"):
    """(meta, cache, q, index_q) of one step on `device`; each block table has one unused entry
    past its longest request (-1 in every row)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    num_pages = sum(-(-kv // geo.block) for kv in kv_lens) + spare_pages
    width = max(-(-kv // geo.block) for kv in kv_lens) + 1
    tables = shuffled_block_tables(kv_lens, geo.block, num_pages, gen, width=width)
    meta = build_step_meta(qo_lens, kv_lens, tables, geo.block, device=device, pad_tokens=pad_tokens)
    cache = make_cache(num_pages, geo, kv_dtype=kv_dtype, index_dtype=index_dtype, device=device, generator=dgen)
    total = sum(qo_lens) + pad_tokens
    q = torch.randn(total, geo.q_heads, geo.head_dim, device=device, generator=dgen).to(q_dtype)
    index_q = torch.randn(total, geo.index_heads, geo.index_dim, device=device, generator=dgen)
    if correlation:
        index_q = correlation * index_q[:1] + (1 - correlation ** 2) ** 0.5 * index_q
    return meta, cache, q, index_q.to(index_dtype)


def exact_block_scores(index_q, index_k_cache, meta) -> list[torch.Tensor]:
    """Per token: float64 `[Hi, n_valid]` max visible score of each block (the oracle's view)."""
    block = index_k_cache.shape[1]
    out = []
    cu = meta.cu_qo_lens.tolist()
    for r, kv in enumerate(meta.kv_lens.tolist()):
        nb = -(-kv // block)
        pages = index_k_cache[meta.block_tables[r, :nb].long()].double().reshape(nb * block, -1)
        for t in range(cu[r], cu[r + 1]):
            p = int(meta.positions[t])
            s = index_q[t].double() @ pages[: p + 1].T                      # [Hi, p + 1]
            nv = p // block + 1
            padded = torch.full((s.shape[0], nv * block), -math.inf, dtype=torch.float64, device=s.device)
            padded[:, : p + 1] = s
            out.append(padded.view(s.shape[0], nv, block).amax(-1).cpu())
    return out


def assert_valid_selection(selection: torch.Tensor, scores: list[torch.Tensor], topk: int,
                           local_blocks: int = 1, init_blocks: int = 0, tol: float = 1e-2) -> None:
    """Shape/order/padding rules plus top-k optimality up to `tol` (ties may break either way)."""
    sel = selection.cpu()
    for t, s in enumerate(scores):
        nv = s.shape[1]
        for h in range(sel.shape[0]):
            row = sel[h, t]
            want = min(topk, nv)
            ids = row[:want]
            assert (row[want:] == -1).all(), f"token {t} head {h}: padding {row.tolist()}"
            assert (ids >= 0).all() and (ids < nv).all(), f"token {t}: ids out of range {row.tolist()}"
            assert (ids[1:] > ids[:-1]).all(), f"token {t}: ids not strictly ascending {row.tolist()}"
            forced = {b for b in range(nv) if b >= nv - local_blocks or b < init_blocks}
            chosen = set(ids.tolist())
            assert forced.issubset(chosen) or len(forced) > topk, f"token {t}: forced {forced} missing in {chosen}"
            free_chosen = [s[h, b].item() for b in chosen - forced]
            unchosen = [s[h, b].item() for b in range(nv) if b not in chosen]
            if free_chosen and unchosen:
                assert min(free_chosen) >= max(unchosen) - tol, f"token {t} head {h}: not a top-{topk} set"


def assert_close_rel(out: torch.Tensor, expect: torch.Tensor, rel: float) -> None:
    assert torch.isfinite(out).all(), "kernel output has NaN/inf"
    err = ((out.double() - expect.double()).norm() / expect.double().norm().clamp_min(1e-30)).item()
    assert err < rel, f"relative error {err:.3e} >= {rel:.1e}"


def msa_metadata(step_meta, max_draft_len: int = 4):
    """The package's own `MsaDecodeMetadata` for the same step (contract oracle for the kernels)."""
    from m3_eagle_plugin.msa import MsaDecodeMetadata

    qo, kv = step_meta.qo_lens.tolist(), step_meta.kv_lens.tolist()
    meta = MsaDecodeMetadata(len(qo), max(sum(qo), 1), step_meta.block_tables.shape[1], step_meta.block_size,
                             "cuda", max_draft_len=max_draft_len)
    meta.prepare(qo, kv, step_meta.block_tables.cpu())
    return meta


def poison_allocator_like(t: torch.Tensor) -> None:
    """Leave NaN in the caching allocator's next block of `t`'s size, so an output the kernel
    forgets to write reads NaN rather than a lucky zero."""
    junk = torch.full_like(t, float("nan"))
    del junk


def capture_after_warmup(fn):
    """(CUDA graph, its outputs) of `fn()`: one warm-up call on a side stream (allocations and
    per-device buffers happen outside the capture, as a host's warm-up step does), then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def check_zeroed_shared_growing(get) -> None:
    """The contract of a per-device int32 buffer kept zero between launches (`_common.step_buffer`
    behind `handoff.ready_flags` and `merge.split_arrivals`): zero-filled, one buffer shared by
    smaller requests, grown past its first size and shared again."""
    a = get("cpu", 8)
    assert a.shape == (8,) and a.dtype == torch.int32 and (a == 0).all()
    assert get("cpu", 3).data_ptr() == a.data_ptr()
    big = get("cpu", (1 << 16) + 5)
    assert big.shape == ((1 << 16) + 5,) and (big == 0).all()
    assert get("cpu", 1).data_ptr() == big.data_ptr()


def sm90_compiler_available() -> bool:
    """Whether Triton's compiler is importable (it targets sm_90 offline, no GPU needed)."""
    import importlib.util

    try:
        return importlib.util.find_spec("triton.backends.compiler") is not None
    except ImportError:  # no triton at all
        return False


def compile_for_sm90(kernel, constexprs: dict, types: dict, *, num_warps: int = 4, num_stages: int = 3):
    """Triton's compiled `kernel` for an H100/H200 target, on any machine: `constexprs` as given
    (other constexpr parameters at their defaults), pointers and scalars typed by `types`, else
    `*i32` for `*_ptr` parameters and `i32` for the rest. Pointers and strides (`s_*`) are
    specialized as multiples of 16, as Triton does for the aligned caches of a real launch (it
    pipelines loads through shared memory only then). Skips the test without ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {p.name: p.default for p in kernel.params if p.is_constexpr and p.name not in constexprs}
    consts.update(constexprs)
    signature = {p.name: "constexpr" if p.name in consts else types.get(p.name, "*i32" if p.name.endswith("_ptr")
                                                                              else "i32")
                 for p in kernel.params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
               if p.name not in consts and (p.name.endswith("_ptr") or p.name.startswith("s_"))}
    try:
        return triton.compile(ASTSource(kernel, signature, consts, aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except FileNotFoundError as missing:  # a Triton build without its bundled ptxas
        pytest.skip(f"no ptxas: {missing}")


def one_request_step(tokens, *, hint=True, q_heads=2, dim=16, block=16):
    """A CPU step (duck-typed metadata) of one request with `tokens` query tokens at the end of its
    context; every token selects page 0 only. For the checks that run before any kernel, where the
    values do not matter."""
    import types

    pages = -(-tokens // block)
    meta = types.SimpleNamespace(
        block_tables=torch.arange(pages, dtype=torch.int32).view(1, pages),
        kv_lens=torch.tensor([tokens], dtype=torch.int32), cu_qo_lens=torch.tensor([0, tokens], dtype=torch.int32),
        positions=torch.arange(tokens, dtype=torch.int32), block_size=block, **({"max_qo_len": tokens} if hint else {}))
    q = torch.zeros(tokens, q_heads, dim)
    kc = torch.zeros(pages, 1, block, dim)
    sel = torch.full((1, tokens, 2), -1, dtype=torch.int32)
    sel[..., 0] = 0
    return q, kc, meta, sel


def seeded_draws(seed: int):
    """`draw(lo, hi)`: an int in [lo, hi] from a generator seeded with `seed`; the interpreter's
    property cases draw their shapes with it (hypothesis would cost CI too much there)."""
    gen = torch.Generator().manual_seed(seed)
    return lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=gen))


def seeded_requests(draw, *, max_requests: int, max_qo: int, max_extra: int,
                    min_requests: int = 1) -> tuple[tuple, tuple]:
    """(qo_lens, kv_lens) of min_requests..max_requests requests: 1..max_qo tokens at the end of
    0..max_extra more."""
    qo_lens = tuple(draw(1, max_qo) for _ in range(draw(min_requests, max_requests)))
    return qo_lens, tuple(q + draw(0, max_extra) for q in qo_lens)
