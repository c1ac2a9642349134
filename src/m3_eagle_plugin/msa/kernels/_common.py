"""Host-side helpers shared by the Triton kernels: availability, launch geometry, input checks.

Kept free of `triton` imports so the CPU package (and CI) can import it; the kernel modules
import `triton` at module level and are only imported once `triton_available()` says yes.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import numbers
import os
from typing import Any

import torch

from m3_eagle_plugin._ints import as_int

#: Query rows (tokens x heads) of one attention tile, at most.
MAX_TILE_ROWS = 64

#: SM count used to size split-K grids when no device is queried (H200 value).
DEFAULT_SM_COUNT = 132

FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)

#: K/V and index-K cache dtypes the kernels read.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + FP8_DTYPES


class KernelInputError(ValueError):
    """An input tensor has a shape, dtype, device or layout the kernels cannot take."""


class KernelTooLargeError(KernelInputError):
    """A kernel's tiles need more of a device resource (shared memory) than the device has, at
    every pipeline depth down to one stage (`launch`), or its grid more programs than CUDA takes
    (`check_grid`)."""


#: Largest CUDA grid y and z dimensions (x takes 2**31 - 1).
MAX_GRID_YZ = 65535


def check_grid(kernel: str, grid: tuple[int, ...], axes: str) -> None:
    """Refuse, before anything is launched, a grid whose y or z is past MAX_GRID_YZ (CUDA answers
    such a launch only with "invalid argument"), naming its `axes`: `KernelTooLargeError`, so
    `auto` runs the torch reference instead."""
    if any(n > MAX_GRID_YZ for n in grid[1:]):
        raise KernelTooLargeError(f"{kernel}: its grid {tuple(grid)} ({axes}) is past CUDA's {MAX_GRID_YZ} programs "
                                  "on the y and z axes")


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when Triton kernels can run on `device` (CUDA, compute capability >= 8.0, triton installed)."""
    if not triton_importable():
        return False
    capability = device_capability("cuda" if device is None else device)
    return capability is not None and capability[0] >= 8


_ENV_DATA = getattr(os.environ, "_data", None)  # CPython's encoded mapping behind os.environ


def env_value(name: str, default: str | None = None) -> str | None:
    """`os.environ.get(name, default)` without its cost for an unset name: `os.environ` raises and
    catches a KeyError there (about 2 us; an eager layer reads several per kernel call)."""
    if _ENV_DATA is None or getattr(os.environ, "_data", None) is not _ENV_DATA:  # not CPython's layout, or replaced
        return os.environ.get(name, default)
    raw = _ENV_DATA.get(os.environ.encodekey(name))
    return default if raw is None else os.environ.decodevalue(raw)


#: The kernels' on/off switches: name -> (default, accepted values). `M3_EAGLE_KERNELS` (the
#: backend choice) is checked by `backend.requested_backend`.
SWITCHES = {
    "M3_EAGLE_HANDOFF": ("1", ("0", "1")),
    "M3_EAGLE_PDL": ("1", ("0", "1", "all")),
    "M3_EAGLE_REPLAY": ("1", ("0", "1")),
}


def env_switch(name: str) -> str:
    """The value of the kernels' switch `name` (stripped, lower-cased; unset or empty: its
    default), refused unless accepted, so a typo such as `off` fails instead of meaning on."""
    default, modes = SWITCHES[name]
    mode = (env_value(name, default) or "").strip().lower() or default
    require(mode in modes, f"{name}={mode!r}: expected one of {', '.join(modes)}")
    return mode


def check_switches() -> None:
    """Every switch of `SWITCHES` read now (a bad value raises, naming it)."""
    for name in SWITCHES:
        env_switch(name)


def triton_interpreting() -> bool:
    """True under Triton's CPU interpreter, which runs no inline PTX: `TRITON_INTERPRET` read by
    Triton itself (its knob: `y` and `yes` interpret, a padded ` 1` does not), never a second parse
    that could disagree with it."""
    if not triton_importable():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def entries_apart(t: torch.Tensor) -> bool:
    """Whether no two entries of `t` share an address. Nested layouts (taken from the smallest
    stride up, each dim's stride passes the farthest offset the dims before it reach) answer at
    once; any other (a zero stride aside) is settled by counting every entry's offset, so dims that
    interleave without meeting (strides (6, 4, 1) over (2, 3, 2)) are not called overlapping. At
    most as many offsets as the span holds addresses: more entries than that must share one."""
    if t.numel() == 0:
        return True
    dims = sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 0
    for stride, size in dims:
        if stride == 0:
            return False
        if stride <= reach:
            return _offsets_distinct(dims)
        reach += (size - 1) * stride
    return True


def _offsets_distinct(dims: list[tuple[int, int]]) -> bool:
    """Whether the (stride, size) dims give every index its own offset, by enumerating them."""
    span = sum((size - 1) * stride for stride, size in dims) + 1
    if math.prod(size for _, size in dims) > span:  # pigeonhole: fewer addresses than entries
        return False
    offsets = torch.zeros(1, dtype=torch.int64)
    for stride, size in dims:
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64) * stride).flatten()
    return int(torch.unique(offsets).numel()) == int(offsets.numel())


def byte_aligned(t: torch.Tensor, nbytes: int) -> bool:
    """Whether `t`'s base address and every stride but the last are multiples of `nbytes` bytes."""
    return t.data_ptr() % nbytes == 0 and all(st * t.element_size() % nbytes == 0 for st in t.stride()[:-1])


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def cuda_present() -> bool:
    return torch.cuda.is_available()  # an NVML query on every call; the answer does not change


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, None for anything else (tests patch this to fake SM90)."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type != "cuda" or not cuda_present():
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def qo_len_hint(meta: Any, max_qo_len: int | None) -> int | None:
    """The caller's bound on query tokens per request, else the metadata's host value
    (`MsaDecodeMetadata.max_qo_len`, set by `prepare`), else None (kernels use a worst case).
    The bound must hold for every request (the verify grids are sized by it); one below the
    metadata's own value is refused."""
    host = getattr(meta, "max_qo_len", None)
    host = host if isinstance(host, int) and host > 0 else None
    if max_qo_len is not None:
        # not int(): 2.9 would size the grids for 2 tokens where there is no host value to catch it
        max_qo_len = as_int("max_qo_len", max_qo_len, 1, KernelInputError)
        require(host is None or max_qo_len >= host,
                f"max_qo_len {max_qo_len} is below the step's longest request ({host} tokens): the grids it "
                "sizes would leave tokens out")
        return max_qo_len
    return host


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def tokens_per_tile(num_tokens: int, num_requests: int, rows_per_token: int, max_qo_len: int | None) -> int:
    """Tokens of one request handled together (a power of two), so a tile has >= 16 rows for tl.dot.

    The kernels loop over a request's tokens in chunks of this size, so any split is correct;
    a chunk that covers the whole verify row (1 + draft_len tokens) reads each page once.
    """
    if max_qo_len is None:
        max_qo_len = -(-max(num_tokens, 1) // max(num_requests, 1))
    chunk = next_pow2(min(max(int(max_qo_len), 1), 16))
    # At most MAX_TILE_ROWS rows: a prefill chunk of 16 tokens x GQA group 16 would need 256 rows,
    # more shared memory than an SM has (measured: 256 KB asked, 227 KB on H200).
    fits = max(1, MAX_TILE_ROWS // rows_per_token)
    chunk = min(chunk, 1 << (fits.bit_length() - 1))
    return max(chunk, next_pow2(-(-16 // rows_per_token)))


def fits_one_tile(max_qo_len: int | None, tile_tokens: int) -> bool:
    """Whether the caller's bound on a request's tokens (`qo_len_hint`) puts all of them in one
    `tile_tokens`-token tile (decode and verify steps). A hint only: kernels stay correct past it."""
    return max_qo_len is not None and max_qo_len <= tile_tokens


def step_buffer(store: dict, device: torch.device | str, numel: int, *, fill: int,
                min_numel: int) -> torch.Tensor | None:
    """`numel` int32 entries of the per-device buffer kept in `store`, allocated on first use
    holding `fill` (at least `min_numel`, grown to the next power of two), or None while a CUDA
    graph is being captured and the buffer is too small: a captured graph must not own it, so
    callers fall back to a path without it. Kernels that use it leave it holding `fill` again.
    Made by a fill, never `torch.empty`: `replay` takes an empty allocation for a fresh output.
    A buffer replaced by a bigger one is kept (`_RETIRED`), never freed: a CUDA graph captured
    while it was current reads and writes it at every replay, and freed memory would go to other
    tensors (scores written over them, and a board or flags no longer holding `fill` between steps)."""
    device = torch.device(device)
    have = store.get(device)
    if have is None or have.numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        size = max(min_numel, 1 << max(0, numel - 1).bit_length())
        if have is not None:
            _RETIRED.append((store, device, have))  # sizes double: everything kept is at most the new buffer's size
        have = torch.full((size,), fill, device=device, dtype=torch.int32)
        store[device] = have
    return have[:numel]


#: Step buffers replaced by bigger ones (`step_buffer`), with their store, alive for the process: captured
#: graphs and recorded launches (`replay`) use them.
_RETIRED: list[tuple[dict, torch.device, torch.Tensor]] = []


def step_buffers(store: dict, device: torch.device | str) -> list[torch.Tensor]:
    """Every buffer `step_buffer` made in `store` for `device`: those it replaced (a captured graph or
    a recorded launch still uses them) and the current one."""
    device = torch.device(device)
    kept = [t for owner, where, t in _RETIRED if owner is store and where == device]
    return kept + ([store[device]] if device in store else [])


def require(cond: bool, message: str) -> None:
    if not cond:
        raise KernelInputError(message)


def selection_counts(topk: Any, local_blocks: Any, init_blocks: Any) -> tuple[int, int, int]:
    """(topk, local_blocks, init_blocks) as ints, the forced blocks within topk, as the reference
    (`msa.selection`) takes them: a kernel's constexprs would take 1.5 local blocks (two forced)
    or a bool."""
    topk = as_int("topk", topk, 1, KernelInputError)
    local_blocks = as_int("local_blocks", local_blocks, 0, KernelInputError)
    init_blocks = as_int("init_blocks", init_blocks, 0, KernelInputError)
    require(local_blocks + init_blocks <= topk, f"local_blocks {local_blocks} + init_blocks {init_blocks} exceed topk "
            f"{topk}: the forced blocks would not all be selected")
    return topk, local_blocks, init_blocks


def check_cache_view(name: str, cache: torch.Tensor, ndim: int) -> None:
    require(cache.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(cache.shape)}")
    require(cache.stride(-1) == 1, f"{name} must be contiguous in its last dim (stride {cache.stride()})")


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Paged K and V caches `[P, Hkv, B, D]` of one shape, each with a unit last stride."""
    check_cache_view("k_cache", k_cache, 4)
    check_cache_view("v_cache", v_cache, 4)
    require(k_cache.shape == v_cache.shape,
            f"k/v cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")


#: The metadata's 1-D fields the kernels read as `ptr + i`.
DENSE_META_FIELDS = ("kv_lens", "cu_qo_lens", "positions")


def check_meta(meta: Any, device: torch.device, dense_fields: tuple[str, ...] = DENSE_META_FIELDS) -> None:
    """The metadata fields the kernels read: present, on `device` (the operands'), the block table
    int32 with unit column stride, and `dense_fields` 1-D with unit stride."""
    for field in ("block_tables",) + dense_fields:
        require(hasattr(meta, field), f"metadata object lacks field {field!r}")
    require(meta.block_tables.dtype == torch.int32, "meta.block_tables must be int32")
    require(meta.block_tables.dim() == 2 and (meta.block_tables.stride(1) == 1 or meta.block_tables.shape[1] <= 1),
            f"meta.block_tables must be 2-D with unit column stride, got strides {tuple(meta.block_tables.stride())}")
    for field in dense_fields:
        value = getattr(meta, field)
        require(value.dim() == 1 and (value.stride(0) == 1 or value.shape[0] <= 1),
                f"meta.{field} must be 1-D with unit stride (the kernels read it densely), got shape "
                f"{tuple(value.shape)} and strides {tuple(value.stride())}")
    check_same_device(device, **{f"meta.{field}": getattr(meta, field) for field in ("block_tables",) + dense_fields})
    if "cu_qo_lens" in dense_fields:
        require(meta.cu_qo_lens.shape[0] == meta.kv_lens.shape[0] + 1,
                "meta.cu_qo_lens must have num_requests + 1 entries")
    if "kv_lens" in dense_fields:  # the kernels read row r of the table for every request r
        require(meta.block_tables.shape[0] >= meta.kv_lens.shape[0],
                f"meta.block_tables has {meta.block_tables.shape[0]} rows for {meta.kv_lens.shape[0]} requests "
                "(meta.kv_lens): the kernels would read past its end")


def check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    """Every tensor given (None: skipped) lives on `device`: a kernel launched there would read
    another device's address as its own."""
    for name, tensor in tensors.items():
        require(tensor is None or tensor.device == device,
                f"{name} is on {None if tensor is None else tensor.device}, the kernel's other operands on {device}")


def check_step_rows(name: str, rows: torch.Tensor, meta: Any) -> None:
    """`rows` (queries or index queries) hold a row for every metadata token (rows past them are
    graph padding): the kernels index them by the metadata alone."""
    num_tokens = meta.positions.shape[0]
    require(rows.shape[0] >= num_tokens, f"{name} has {rows.shape[0]} rows, fewer than the metadata's "
            f"{num_tokens} tokens")


def check_cache_block(name: str, block: int, meta: Any) -> None:
    """A cache view's pages hold the metadata's blocks (its block table is read with that size)."""
    meta_block = getattr(meta, "block_size", None)
    require(not isinstance(meta_block, int) or meta_block == block,
            f"{name} has {block}-token pages but the metadata's block_size is {meta_block}")


#: Query (and index query) dtypes the kernels compute in.
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def compute_dtype_of(q: torch.Tensor) -> torch.dtype:
    if q.dtype not in QUERY_DTYPES:
        raise KernelInputError(f"queries must be float32/float16/bfloat16, got {q.dtype}")
    return q.dtype


def _positive_finite(name: str, value: Any) -> float:
    """`value` as a Python float where it is a real, finite, positive number (a Python or NumPy
    scalar); a bool, a tensor or anything else is refused naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise KernelInputError(f"{name} must be a real number (a Python or NumPy scalar), got "
                               f"{type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise KernelInputError(f"{name} must be a positive finite number, got {value!r}")
    return number


def attention_scale(scale: Any) -> float:
    """The softmax scale as a Python float, refused where `msa`'s references refuse it (not a
    positive finite real number; a tensor, whose read would sync the device inside a graph capture)."""
    if isinstance(scale, torch.Tensor):
        raise KernelInputError("pass the softmax scale as a Python float so graph capture needs no host sync")
    return _positive_finite("scale", scale)


def scale_value(scale: float | torch.Tensor | None, name: str = "fp8 scale") -> float:
    """Per-tensor dequant scale as a Python float (None: 1.0); a tensor (its read would sync the
    device) and a value that is not a positive finite number are refused, naming `name`."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        raise KernelInputError("pass fp8 scales as Python floats so graph capture needs no host sync")
    return _positive_finite(name, scale)


def attention_scales(scale: Any, k_scale: Any = None, v_scale: Any = None) -> tuple[float, float]:
    """(softmax scale x K scale, V scale) as Python floats; a scale `msa`'s references refuse (not a
    positive finite real number), a tensor (a host sync inside a graph capture) or a product past
    the float range is refused by name."""
    qk = attention_scale(scale) * scale_value(k_scale, "k_scale")
    if not math.isfinite(qk):
        raise KernelInputError(f"scale x k_scale ({scale!r} x {k_scale!r}) is past the float range")
    return qk, scale_value(v_scale, "v_scale")
