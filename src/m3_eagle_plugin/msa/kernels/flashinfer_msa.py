"""FlashInfer's MSA ops (`flashinfer.msa_ops`) as a second backend for two verify-step kernels.

Why: FlashInfer 0.7.4's SM90 sparse decode attention (and, at some shapes, its index scoring +
top-k) is faster than our Triton kernels (measured: `peer_table_h200.json`). The dispatchers in
`backend.py` route `sparse_attention` and `select_blocks_paged` here when FlashInfer can run the
call exactly (`eligibility`) and the measured table says it is faster (`kernel_table.py`).
FlashInfer is imported lazily, never at module import; every check here reads host-side values
only (shapes, strides, data pointers, the metadata's host lengths), so a routed call stays
CUDA-graph capturable.

The contract (read from the 0.7.4 wheel; `bench/flashinfer_peer.py` has the long form):
* `msa_sparse_decode_attention(q [R*q_len, Hq, 128] bf16, k, v, q2k_indices int32 [Hkv, T, 16],
  *, page_table, seqused_k, seqlen_q, softmax_scale, v_global_scale)`: on SM90 K/V must be the two
  fp8 halves of ONE interleaved `[P, Hkv, 128, 256]` cache (K = `[..., :128]`, V = `[..., 128:]`),
  GQA group <= 16, one q_len for every request, no K/V scale tensors (the K scale folds into
  `softmax_scale`, the V scale is `v_global_scale`). Token i of a request sits at
  `seqused_k - seqlen_q + i`, our position rule.
* `msa_proxy_score(q [T, Hi, 128], k [P, 1, 128, 128] contiguous, cu_seqlens_q, *, page_table,
  seqused_k, causal, max_seqlen_q, max_k_tiles, output)` -> fp32 `[Hi, tiles, T]`, bf16 only in the
  decode regime (q_len <= 4); then `msa_topk_select(scores, 16, num_valid_pages=[T] int32,
  output [T, Hi, 16], force_begin_blocks, force_end_blocks)`. With per-token `num_valid_pages`
  (our `valid_blocks`) `force_end_blocks=local_blocks` forces each token's own local block(s),
  exactly our rule; without it the forced block is the last score column, which is a token's
  own block only when every token ends in the step's last block (the bench measures both forms).
"""
from __future__ import annotations

import functools
import importlib
import numbers
from typing import Any

import torch

from ..blocks import is_integer_dtype
from ._common import attention_scales
from ._common import device_capability, selection_counts  # device_capability: tests patch it here; the bench imports it here

SPARSE = "sparse_attention"
INDEX = "select_blocks_paged"
ROUTED_KERNELS = (INDEX, SPARSE)

HEAD_DIM = 128     # head dim and index dim FlashInfer's SM90 MSA kernels take
BLOCK = 128        # page / MSA block size
TOPK = 16          # msa_topk_select and q2k_indices width
MAX_GROUP = 16     # GQA group limit of the SM90 decode kernel
MAX_INDEX_Q_LEN = 4  # bf16 proxy scoring: decode regime only
SM90 = (9, 0)
FP8 = getattr(torch, "float8_e4m3fn", None)


# --- availability ------------------------------------------------------------------------------

def short_error(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:limit] if text else ''}"


@functools.cache
def _import_status() -> tuple[bool, bool, str]:
    """(flashinfer imports, flashinfer.msa_ops imports, version or why not)."""
    try:
        fi = importlib.import_module("flashinfer")
    except Exception as exc:  # ImportError, or a CUDA/driver mismatch raised at import time
        return False, False, f"unavailable ({short_error(exc)})"
    version = str(getattr(fi, "__version__", "version unknown"))
    try:
        importlib.import_module("flashinfer.msa_ops")
    except Exception as exc:
        return True, False, f"{version}, but flashinfer.msa_ops does not import ({short_error(exc)})"
    return True, True, version


def flashinfer_available() -> bool:
    """True when `flashinfer.msa_ops` imports (checked on first call, not at module import)."""
    return _import_status()[1]


def flashinfer_importable() -> bool:
    """True when `flashinfer` itself imports (enough for its paged prefill wrapper)."""
    return _import_status()[0]


def flashinfer_status() -> str:
    """FlashInfer's version, or why it (or its msa_ops) is unavailable."""
    return _import_status()[2]


def _msa():
    return importlib.import_module("flashinfer.msa_ops")


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str) -> str:
    """The name the measured table is matched against (`torch.cuda.get_device_name`), else the type."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return device.type
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def device_refusal(device: torch.device | str) -> str | None:
    """Why FlashInfer's SM90 MSA kernels cannot run on `device`, or None."""
    cap = device_capability(device)
    if cap is None:
        return f"needs an SM90 (Hopper) CUDA device, got {torch.device(device)}"
    if tuple(cap) != SM90:
        return f"needs SM90 (compute capability 9.0), device has {cap[0]}.{cap[1]}"
    return None


# --- layout helpers (shared with bench/flashinfer_peer.py) ---------------------------------------

def interleave_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Contiguous `[P, Hkv, B, 2D]`: per (page, head, token) its K row then its V row, the one
    interleaved cache SM90 MSA reads. Our K/V are `[P, Hkv, B, D]` views into a pool."""
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k/v differ: {tuple(k.shape)} {k.dtype} vs {tuple(v.shape)} {v.dtype}")
    d = k.shape[-1]
    packed = torch.empty(*k.shape[:-1], 2 * d, dtype=k.dtype, device=k.device)
    packed[..., :d].copy_(k)
    packed[..., d:].copy_(v)
    return packed


def split_interleaved(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V halves of an interleaved cache: views, V starting D elements after K. Both
    backends read these (our kernels only need a unit last-dim stride)."""
    d = packed.shape[-1] // 2
    return packed[..., :d], packed[..., d:]


def page_table(meta: Any) -> torch.Tensor:
    """int32 `[R, W]` contiguous; our -1 padding becomes page 0 (never read: it lies past every
    request's extent, but an out-of-pool id must not reach a kernel). One device op, no sync.
    One row per request (`meta.kv_lens`): a block table may keep more rows (`check_meta` and the
    references take them), which FlashInfer's decode attention refuses as another batch size."""
    return meta.block_tables[: meta.kv_lens.shape[0]].clamp_min(0).to(torch.int32).contiguous()


def q2k_indices(selection: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Our selection `[H, T, topk]` (H = KV heads, or 1 index head shared by all) as FlashInfer's
    `q2k_indices`: int32 `[Hkv, T, topk]` contiguous. Same logical block ids, ascending, -1 padded."""
    if selection.shape[0] == 1 and num_kv_heads > 1:
        selection = selection.expand(num_kv_heads, -1, -1)
    elif selection.shape[0] != num_kv_heads:
        raise ValueError(f"selection has {selection.shape[0]} heads for {num_kv_heads} KV heads")
    return selection.to(torch.int32).contiguous()


def selection_from_topk(output: torch.Tensor) -> torch.Tensor:
    """`msa_topk_select`'s `[T, H, 16]` as our `[H, T, 16]` (a view)."""
    return output.permute(1, 0, 2)


# --- eligibility (host-side checks only) --------------------------------------------------------

def host_q_len(meta: Any, num_tokens: int, max_qo_len: int | None = None) -> tuple[int | None, str]:
    """(the one q_len of every request, "") or (None, why not), from the metadata's `qo_lens_host`.
    Without it there is no route: `num_tokens == R * max_qo_len` does not prove the lengths equal,
    since a step may carry graph-padding rows past its last request (q_lens 1 and 3 plus 2 padding
    rows fill 2 x 3), and only the device's `cu_qo_lens` tells them apart. ``max_qo_len`` is
    checked against the host lengths when given."""
    lens = getattr(meta, "qo_lens_host", None)
    if not isinstance(lens, (tuple, list)) or not lens:
        return None, ("q_len per request unknown on the host (no qo_lens_host; a token count alone cannot "
                      "tell graph-padding rows from requests)")
    if len(set(lens)) != 1:
        return None, f"requests have different q_len {sorted(set(lens))} (FlashInfer takes one seqlen_q)"
    q_len = int(lens[0])
    if max_qo_len is not None and q_len > max_qo_len:
        return None, f"the requests' q_len {q_len} is past max_qo_len {max_qo_len}"
    requests = int(meta.kv_lens.shape[0])
    if q_len < 1 or num_tokens != requests * q_len:
        return None, f"{num_tokens} tokens are not {requests} requests x one q_len {q_len}"
    return q_len, ""


def interleaved_refusal(k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why `k`, `v` are not the two halves of one dense interleaved `[P, Hkv, B, 2D]` cache, or None."""
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        return f"K/V must be [P, Hkv, B, D] of one dtype, got {tuple(k.shape)} {k.dtype} / {tuple(v.shape)} {v.dtype}"
    _, heads, block, dim = k.shape
    want = (heads * block * 2 * dim, block * 2 * dim, 2 * dim, 1)
    if v.data_ptr() - k.data_ptr() != dim * k.element_size() or k.stride() != want or v.stride() != want:
        offset = (v.data_ptr() - k.data_ptr()) // k.element_size()
        return (f"K and V are not the two halves of one interleaved [P, Hkv, {block}, {2 * dim}] cache (V must start "
                f"{dim} elements after K, strides {want}; got offset {offset}, strides {tuple(k.stride())} / "
                f"{tuple(v.stride())})")
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return "K and V are not views of one allocation"
    return None


#: The metadata's tensors the routed calls pass to FlashInfer.
META_TENSORS = ("block_tables", "kv_lens", "cu_qo_lens", "valid_blocks")


def operands_elsewhere(first: str, tensor: torch.Tensor, meta: Any, **others: torch.Tensor) -> str | None:
    """Which of `others` and the metadata's tensors are not on `tensor`'s device (FlashInfer
    launches there and would read another device's addresses as its own), in words; else None."""
    given = {**others, **{f"meta.{name}": getattr(meta, name, None) for name in META_TENSORS}}
    away = [f"{name} on {t.device}" for name, t in given.items()
            if isinstance(t, torch.Tensor) and t.device != tensor.device]
    return f"operands on another device than {first} ({tensor.device}): {', '.join(away)}" if away else None


def _is_scale(value: Any) -> bool:
    """None or a real number, as our kernels take scales (`_common.scale_value`: a NumPy scalar too)."""
    return value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool))


def _common_refusal(device: torch.device, meta: Any, num_tokens: int, max_qo_len: int | None
                    ) -> tuple[int | None, str | None]:
    why = device_refusal(device)
    if why:
        return None, why
    if getattr(meta, "block_size", None) != BLOCK:
        return None, f"block size must be {BLOCK}, got {getattr(meta, 'block_size', None)}"
    if num_tokens == 0:
        return None, "empty step"
    q_len, why = host_q_len(meta, num_tokens, max_qo_len)
    return q_len, (why or None)


def sparse_eligibility(q, k_cache, v_cache, meta, selection, *, k_scale=None, v_scale=None,
                       max_qo_len: int | None = None) -> tuple[bool, str]:
    """Whether `msa_sparse_decode_attention` computes exactly `sparse_attention` for these inputs."""
    q_len, why = _common_refusal(q.device, meta, q.shape[0], max_qo_len)
    why = why or operands_elsewhere("q", q, meta, k_cache=k_cache, v_cache=v_cache, selection=selection)
    if why:
        return False, why
    if q.dim() != 3 or q.dtype != torch.bfloat16 or q.shape[-1] != HEAD_DIM:
        return False, f"q must be bf16 [T, Hq, {HEAD_DIM}], got {q.dtype} {tuple(q.shape)}"
    if FP8 is None or k_cache.dtype != FP8 or v_cache.dtype != FP8:
        return False, f"K/V must be float8_e4m3fn, got {k_cache.dtype} / {v_cache.dtype}"
    why = interleaved_refusal(k_cache, v_cache)
    if why:
        return False, why
    _, hkv, block, dim = k_cache.shape
    if block != BLOCK or dim != HEAD_DIM:
        return False, f"cache pages must be [{BLOCK}, {HEAD_DIM}], got [{block}, {dim}]"
    if q.shape[1] % hkv or q.shape[1] // hkv > MAX_GROUP:
        return False, f"GQA group {q.shape[1]}/{hkv} must be a whole number <= {MAX_GROUP}"
    if selection.dim() != 3 or tuple(selection.shape) != (hkv, q.shape[0], TOPK):
        return False, f"selection must be [Hkv={hkv}, T={q.shape[0]}, {TOPK}], got {tuple(selection.shape)}"
    if not is_integer_dtype(selection.dtype):
        return False, f"selection must be an integer tensor of block ids, got {selection.dtype}"  # not truncated
    if not (_is_scale(k_scale) and _is_scale(v_scale)):
        return False, "fp8 scales must be Python floats or NumPy scalars (FlashInfer takes no scale tensors)"
    return True, f"SM90, interleaved fp8 K/V, group {q.shape[1] // hkv}, q_len {q_len}"


def index_eligibility(index_q, index_k_cache, meta, *, topk: int, max_qo_len: int | None = None
                      ) -> tuple[bool, str]:
    """Whether proxy scoring + `msa_topk_select` (per-token num_valid_pages) computes exactly
    `select_blocks_paged` for these inputs without copying the index cache."""
    q_len, why = _common_refusal(index_q.device, meta, index_q.shape[0], max_qo_len)
    why = why or operands_elsewhere("index_q", index_q, meta, index_k_cache=index_k_cache)
    if why:
        return False, why
    if q_len > MAX_INDEX_Q_LEN:
        return False, f"bf16 proxy scoring takes q_len <= {MAX_INDEX_Q_LEN}, got {q_len}"
    if topk != TOPK:
        return False, f"msa_topk_select takes topk {TOPK} only, got {topk}"
    if index_q.dim() != 3 or index_q.dtype != torch.bfloat16 or index_q.shape[-1] != HEAD_DIM:
        return False, f"index_q must be bf16 [T, Hi, {HEAD_DIM}], got {index_q.dtype} {tuple(index_q.shape)}"
    if index_k_cache.dtype != torch.bfloat16 or tuple(index_k_cache.shape[1:]) != (BLOCK, HEAD_DIM):
        return False, (f"index-K cache must be bf16 [P, {BLOCK}, {HEAD_DIM}], got {index_k_cache.dtype} "
                       f"{tuple(index_k_cache.shape)}")
    if not index_k_cache.is_contiguous():
        return False, (f"index-K cache is a strided view (strides {tuple(index_k_cache.stride())}); FlashInfer "
                       f"needs a contiguous one-head [P, 1, {BLOCK}, {HEAD_DIM}] cache")
    return True, f"SM90, contiguous bf16 index cache, q_len {q_len}"


def eligibility(kernel: str, *args, **kwargs) -> tuple[bool, str]:
    """(ok, reason) for `kernel` ("sparse_attention" | "select_blocks_paged") on the dispatcher's
    own arguments; FlashInfer's import is checked last (the cheap checks usually decide first)."""
    if kernel == SPARSE:
        ok, why = sparse_eligibility(*args, **kwargs)
    elif kernel == INDEX:
        ok, why = index_eligibility(*args, **kwargs)
    else:
        return False, f"no FlashInfer route for {kernel}"
    if ok and not flashinfer_available():
        return False, f"flashinfer.msa_ops: {flashinfer_status()}"
    return ok, why


# --- routed calls (outputs in our formats) ------------------------------------------------------

def _tiles(meta: Any) -> int:
    """Score columns: the step's staged blocks (host value), else the block-table width."""
    tiles = getattr(meta, "max_step_blocks", None)
    return int(tiles) if isinstance(tiles, int) and tiles > 0 else int(meta.block_tables.shape[1])


def decode_scales(scale: float, k_scale: float | None = None, v_scale: float | None = None
                  ) -> tuple[float, float | None]:
    """(`softmax_scale`, the K scale folded in; `v_global_scale`, None for 1.0) of
    `msa_sparse_decode_attention`; a scale our kernels refuse (not a positive finite number, a
    tensor) is refused here too (`KernelInputError`), before anything runs."""
    softmax_scale, v_global = attention_scales(scale, k_scale, v_scale)
    return softmax_scale, None if v_global == 1.0 else v_global


def sparse_attention(q, k_cache, v_cache, meta, selection, *, scale: float, q_len: int,
                     k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:
    """`[T, Hq, D]` in `q.dtype`, as `msa.sparse_attention` (inputs passed `sparse_eligibility`)."""
    softmax_scale, v_global = decode_scales(scale, k_scale, v_scale)
    return _msa().msa_sparse_decode_attention(
        q.contiguous(), k_cache, v_cache, q2k_indices(selection, k_cache.shape[1]), page_table=page_table(meta),
        seqused_k=meta.kv_lens.to(torch.int32).contiguous(), seqlen_q=int(q_len), causal=True,
        softmax_scale=softmax_scale, v_global_scale=v_global)


def select_blocks(index_q, index_k_cache, meta, *, topk: int, q_len: int, local_blocks: int = 1,
                  init_blocks: int = 0) -> torch.Tensor:
    """int32 `[Hi, T, topk]`, ascending, -1 padded, as `msa.select_blocks_paged` (inputs passed
    `index_eligibility`)."""
    topk, local_blocks, init_blocks = selection_counts(topk, local_blocks, init_blocks)
    msa = _msa()
    tokens, heads = index_q.shape[0], index_q.shape[1]
    tiles = _tiles(meta)
    scores = torch.empty(heads, tiles, tokens, dtype=torch.float32, device=index_q.device)
    msa.msa_proxy_score(index_q.contiguous(), index_k_cache.unsqueeze(1), meta.cu_qo_lens.to(torch.int32).contiguous(),
                        page_table=page_table(meta), seqused_k=meta.kv_lens.to(torch.int32).contiguous(),
                        causal=True, max_seqlen_q=int(q_len), max_k_tiles=tiles, output=scores)
    out = torch.empty(tokens, heads, topk, dtype=torch.int32, device=index_q.device)
    msa.msa_topk_select(scores, topk, num_valid_pages=meta.valid_blocks.to(torch.int32).contiguous(), output=out,
                        force_begin_blocks=int(init_blocks), force_end_blocks=int(local_blocks))
    return selection_from_topk(out).contiguous()
