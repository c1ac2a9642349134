"""Block geometry shared by every MSA layer: block-size checks and per-token visible-block counts.

MSA splits keys into blocks of ``block_size`` tokens (one block = one cache page). Each query
token sees its own causal prefix, so the number of visible blocks is a per-token quantity;
this module computes it without host synchronisation so it can run inside CUDA graphs.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from m3_eagle_plugin._ints import as_int

__all__ = [
    "MsaInputError",
    "validate_block_size",
    "checked_int",
    "is_integer_dtype",
    "per_token_valid_blocks",
    "valid_blocks_from_positions",
]


#: The largest value an int32 length, count or page id holds (the metadata's fields are int32).
INT32_MAX = (1 << 31) - 1


class MsaInputError(ValueError):
    """Raised when an MSA function or the step metadata receives inconsistent input."""


def checked_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int (`_ints.as_int`) of at least ``minimum``; TypeError / MsaInputError naming ``name``."""
    value = as_int(name, value)
    if value < minimum:
        raise MsaInputError(f"{name} must be >= {minimum}, got {value}")
    return value


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """True for integer tensors of ids or lengths: not float (torch would truncate), complex or bool."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def as_int64(name: str, values: torch.Tensor) -> torch.Tensor:
    """Integer ``values`` as int64. The cast reads a uint64 entry past int64 as negative (2**63 became a
    length -2**63, a skipped slot, 0 blocks): refused for host values; device ones are not read back."""
    wide = values.to(torch.int64)
    if values.dtype == torch.uint64 and wide.device.type == "cpu" and bool((wide < 0).any()):
        raise MsaInputError(f"{name} has an entry past int64: {max(values.tolist())}")
    return wide


def validate_block_size(block_size: object) -> int:
    """Return ``block_size`` as an int after checking it is a positive power of two, at most 2**62."""
    block_size = as_int("block_size", block_size)
    if block_size <= 0 or block_size & (block_size - 1):
        raise MsaInputError(f"block_size must be a positive power of two, got {block_size}")
    if block_size > 1 << 62:  # 2**63 is no int64: torch read it as -2**63 (0 blocks) and 2**64 overflowed
        raise MsaInputError(f"block_size {block_size} is past 2**62: the block counts are int64 arithmetic")
    return block_size


def require_tensors(**named: object) -> None:
    """Refuse, by name, an argument that is not a tensor (a list failed on `.dim`, naming nothing)."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")


def check_page_size(k_cache: torch.Tensor, meta: Any) -> None:
    """A step's metadata must count blocks of the cache's page size (`k_cache`: `[pages, heads, page,
    dim]`): its slots of another block size name other pages' tokens (another request's)."""
    page = k_cache.shape[2]
    if page != meta.block_size:
        raise ValueError(f"the cache's pages hold {page} tokens, the step metadata's block size is "
                         f"{meta.block_size}: build the metadata with the cache's page size")


def valid_blocks_from_positions(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Visible-block count of tokens at ``positions``: ``ceil((p + 1) / B)``, 0 for ``p < 0``.

    ``positions`` must be an integer tensor (a float position 2.5 is not a token). The counts are
    int32: host (CPU) positions whose count would not fit are refused; device positions are not
    read back (that would sync), so callers keep them inside the int32 range of the metadata.
    """
    block_size = validate_block_size(block_size)
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a tensor, got {type(positions).__name__}")
    if not is_integer_dtype(positions.dtype):
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    # In int64: int32 p + 1 wraps to -2**31 at p = INT32_MAX (0 blocks instead of 2**31 / B).
    wide = as_int64("positions", positions)
    if wide.device.type == "cpu" and wide.numel() and int(wide.max()) // block_size >= INT32_MAX:
        raise MsaInputError(  # the max of the wide copy: torch has none for uint16/uint32 tensors
            f"positions up to {int(wide.max())} give block counts past int32 (block_size {block_size})")
    # p // B + 1 (= ceil((p + 1) / B)): no p + 1, which wraps to 0 blocks at the last int64 position.
    return (torch.div(wide.clamp(min=-1), block_size, rounding_mode="floor") + 1).to(torch.int32)


def request_pages(meta: Any) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """For each request with query tokens and KV: (request index, its token rows, its pages).

    Pages are the first ``ceil(kv_len / B)`` block-table entries as int64, ``-1`` where unmapped;
    the references gather a request's pages once and serve all its tokens from them.
    """
    start = 0
    for r, (qo, kv) in enumerate(zip(meta.qo_lens_host, meta.kv_lens_host)):
        rows = slice(start, start + qo)
        start += qo
        if qo and kv:
            yield r, rows, meta.block_tables[r, : -(-kv // meta.block_size)].to(torch.int64)


def int_entries(name: str, values: Sequence[int]) -> list[int]:
    """`values` as a list of Python ints (torch would truncate 1.5 to 1 and read True as 1)."""
    return [as_int(f"{name} entries", x) for x in values]


def _as_length_tensor(name: str, values: torch.Tensor | Sequence[int], device: torch.device | None) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise MsaInputError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        if not is_integer_dtype(values.dtype):  # float, complex (imag dropped) and bool refused
            raise TypeError(f"{name} must be an integer tensor, got {values.dtype}")
        return as_int64(name, values)
    entries = int_entries(name, values)
    for r, x in enumerate(entries):
        if not -(1 << 63) <= x < (1 << 63):
            raise MsaInputError(f"request {r}: {name} entry {x} does not fit int64")
    return torch.as_tensor(entries, dtype=torch.int64, device=device)


def per_token_valid_blocks(
    qo_lens: torch.Tensor | Sequence[int],
    kv_lens: torch.Tensor | Sequence[int],
    block_size: int,
    *,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token visible-block counts of a step, int32 ``[sum(qo_lens)]``.

    Token ``t`` of request ``r`` sees ``ceil(min(kv_lens[r] - qo_lens[r] + t + 1, kv_lens[r]) / B)``
    blocks (never negative). Output lives on the inputs' device: a host sequence beside a tensor goes to
    the tensor's device, two tensors on different devices are refused. Pass ``num_tokens`` (the sum of
    ``qo_lens``, known on the host) to keep device inputs free of host synchronisation; without
    it a device ``qo_lens`` total is read back (a host sequence's is summed on the host). Host
    lengths (CPU, or a sequence) are checked: none negative, and ``num_tokens`` equal to their sum.
    A ``kv_len`` below its ``qo_len`` (a shrinking correction) leaves the early tokens 0 blocks.
    """
    block_size = validate_block_size(block_size)
    if num_tokens is not None:
        num_tokens = checked_int("num_tokens", num_tokens, minimum=0)
    device = qo_lens.device if isinstance(qo_lens, torch.Tensor) else None
    if device is None and isinstance(kv_lens, torch.Tensor):
        device = kv_lens.device
    host_qo = None if isinstance(qo_lens, torch.Tensor) else int_entries("qo_lens", qo_lens)
    host_kv = None if isinstance(kv_lens, torch.Tensor) else int_entries("kv_lens", kv_lens)
    qo = _as_length_tensor("qo_lens", qo_lens if host_qo is None else host_qo, device)
    kv = _as_length_tensor("kv_lens", kv_lens if host_kv is None else host_kv, device)
    if qo.shape != kv.shape:
        raise MsaInputError(f"qo_lens and kv_lens differ in length: {qo.numel()} vs {kv.numel()}")
    if qo.device != kv.device:
        raise MsaInputError(f"qo_lens is on {qo.device} but kv_lens is on {kv.device}: pass both tensors "
                            "on one device (a host sequence goes to the other's device)")
    if qo.device.type == "cpu":  # host values: checked for free (on a device this would sync)
        _check_host_lengths(qo, kv, num_tokens)
    else:  # a host sequence beside a device tensor: its values are known without a read-back
        if host_kv is not None:  # unchecked, a negative kv_len read as 0 blocks and 2**32 + 5 wrapped to 5
            _check_host_kv(host_kv)
        if host_qo is not None:  # and the total of a host qo_lens
            _check_host_qo(host_qo, num_tokens)
            num_tokens = sum(host_qo)
    if num_tokens is None:
        num_tokens = int(qo.sum())  # free for CPU inputs; device callers pass num_tokens
    if num_tokens < 0:
        raise MsaInputError(f"num_tokens must be >= 0, got {num_tokens}")
    request_ids = torch.arange(qo.numel(), device=qo.device)
    token_request = torch.repeat_interleave(request_ids, qo.clamp(min=0), output_size=num_tokens)
    first_token = torch.cumsum(qo, 0) - qo
    intra = torch.arange(num_tokens, device=qo.device) - first_token[token_request]
    kv_tok = kv[token_request]
    seen = torch.minimum(kv_tok - qo[token_request] + intra + 1, kv_tok).clamp(min=0)
    return torch.div(seen + (block_size - 1), block_size, rounding_mode="floor").to(torch.int32)


def _check_host_qo(qo: list[int], num_tokens: int | None) -> None:
    for r, q in enumerate(qo):
        if q < 0:
            raise MsaInputError(f"request {r}: lengths must be >= 0, got qo_len={q}")
    _check_total(sum(qo), num_tokens)


def _check_host_kv(kv: list[int]) -> None:
    for r, k in enumerate(kv):
        if k < 0:
            raise MsaInputError(f"request {r}: lengths must be >= 0, got kv_len={k}")
        if k > INT32_MAX:  # the counts come back int32, like the metadata's lengths
            raise MsaInputError(f"request {r}: kv_len {k} does not fit int32")


def _check_total(total: int, num_tokens: int | None) -> None:
    """The step's token count, summed in Python ints: its int64 sum wrapped (4 x 2**62 tokens summed to 0,
    and the token gather then wrote past its output: a segfault)."""
    if total > (1 << 63) - 1:
        raise MsaInputError(f"qo_lens sum to {total} tokens, past int64")
    if num_tokens is not None and num_tokens != total:
        raise MsaInputError(f"num_tokens is {num_tokens} but qo_lens sum to {total}")


def _check_host_lengths(qo: torch.Tensor, kv: torch.Tensor, num_tokens: int | None) -> None:
    bad = ((qo < 0) | (kv < 0)).nonzero()
    if bad.numel():
        r = int(bad[0])
        raise MsaInputError(f"request {r}: lengths must be >= 0, got qo_len={int(qo[r])}, kv_len={int(kv[r])}")
    if kv.numel() and int(kv.max()) > INT32_MAX:  # the counts come back int32, like the metadata's lengths
        r = int(kv.argmax())
        raise MsaInputError(f"request {r}: kv_len {int(kv[r])} does not fit int32")
    _check_total(sum(qo.tolist()), num_tokens)
