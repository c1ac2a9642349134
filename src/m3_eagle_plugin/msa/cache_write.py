"""Scatter a step's new K, V and index-K into paged caches (torch references).

Slots are ``page * B + offset`` as produced by ``MsaDecodeMetadata.cache_slots``; a negative slot
means "do not write". The caches may be strided views into a pooled "mega-slot" tensor, so the
writers only index them (``index_put_``) and never reshape, which makes the writes land in the
pool's storage. Negative slots are redirected without host synchronisation (see
``_redirect_skipped``), so the writers are safe inside CUDA-graph capture. A slot past the cache
is refused before anything is written where the slots are a host tensor (free to read); device
slots are not checked, since that would read them back to the host.
"""

from __future__ import annotations

from typing import Callable

import torch

from .blocks import MsaInputError, as_int64, is_integer_dtype, require_tensors

__all__ = ["write_kv", "write_index_k", "check_index_k"]


def _redirect_skipped(
    slots: torch.Tensor, values: torch.Tensor, read_slot: Callable[[int], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Point skipped tokens at a harmless write without reading anything back to the host.

    A skipped token re-writes the first kept token's slot with that token's own value (a
    duplicate, identical write). When no token is kept, every token re-writes slot 0 with the
    value it already holds.
    """
    keep = slots >= 0
    # 1-element index tensors, not 0-d ones: indexing with a 0-d tensor would read it on the host.
    first_kept = torch.argmax(keep.to(torch.float32)).view(1)
    any_kept = keep.any().view(1)
    no_slot = torch.zeros_like(any_kept, dtype=slots.dtype)
    fallback_slot = torch.where(any_kept, slots.index_select(0, first_kept), no_slot)
    shape = (-1,) + (1,) * (values.dim() - 1)
    fallback_value = torch.where(
        any_kept.view(shape), values.index_select(0, first_kept), read_slot(0).to(values.dtype).unsqueeze(0)
    )
    safe_slots = torch.where(keep, slots, fallback_slot)
    safe_values = torch.where(keep.view(shape), values, fallback_value)
    return safe_slots, safe_values


def _check_slots(slots: torch.Tensor, num_tokens: int, capacity: int) -> torch.Tensor:
    """Shape and dtype always; the range only for host slots, before the first write, so a slot
    past the cache fails the whole call instead of after the K cache (or a prefix of it) is written."""
    if slots.dim() != 1 or slots.shape[0] != num_tokens:
        raise MsaInputError(f"slots must be [T={num_tokens}], got {tuple(slots.shape)}")
    if not is_integer_dtype(slots.dtype):  # a complex slot would drop its imaginary part
        raise TypeError(f"slots must be an integer tensor, got {slots.dtype}")
    slots = as_int64("slots", slots)
    if slots.device.type == "cpu" and num_tokens and int(slots.max()) >= capacity:
        raise MsaInputError(f"slot {int(slots.max())} is past the cache's {capacity} slots (pages * block size)")
    return slots


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into HND caches ``[P, Hkv, B, D]`` at ``slots`` ``[T]``."""
    require_tensors(k_cache=k_cache, v_cache=v_cache, slots=slots, k=k, v=v)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise MsaInputError(
            f"k_cache and v_cache must both be [P, Hkv, B, D], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_pages, num_heads, block_size, dim = k_cache.shape
    if k.dim() != 3 or k.shape[1:] != (num_heads, dim) or v.shape != k.shape:
        raise MsaInputError(
            f"k and v must both be [T, Hkv={num_heads}, D={dim}], got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    slots = _check_slots(slots, k.shape[0], num_pages * block_size)
    if k.shape[0] == 0 or num_pages == 0:  # no page: every (checked) slot is skipped, and slot 0 is no fallback
        return
    heads = torch.arange(num_heads, device=k_cache.device)[None, :]
    for cache, values in ((k_cache, k), (v_cache, v)):

        def read_slot(slot: int, cache: torch.Tensor = cache) -> torch.Tensor:
            return cache[slot // block_size, :, slot % block_size, :]

        safe_slots, safe_values = _redirect_skipped(slots, values.to(cache.dtype), read_slot)
        pages = torch.div(safe_slots, block_size, rounding_mode="floor")[:, None]
        offsets = (safe_slots % block_size)[:, None]
        cache.index_put_((pages, heads, offsets), safe_values)


def check_index_k(index_k_cache: torch.Tensor, slots: torch.Tensor, ik: torch.Tensor, name: str = "ik") -> torch.Tensor:
    """`write_index_k`'s checks without its write (a caller writing K/V first checks these before
    anything is written); returns the slots as int64. `name` is how errors call `ik`."""
    require_tensors(index_k_cache=index_k_cache, slots=slots, **{name: ik})
    if index_k_cache.dim() != 3:
        raise MsaInputError(f"index_k_cache must be [P, B, Di], got {tuple(index_k_cache.shape)}")
    num_pages, block_size, dim = index_k_cache.shape
    if ik.dim() != 2 or ik.shape[1] != dim:
        raise MsaInputError(f"{name} must be [T, Di={dim}], got {tuple(ik.shape)}")
    return _check_slots(slots, ik.shape[0], num_pages * block_size)


def write_index_k(index_k_cache: torch.Tensor, slots: torch.Tensor, ik: torch.Tensor) -> None:
    """Write index keys ``ik`` ``[T, Di]`` into the index-K cache ``[P, B, Di]`` at ``slots``."""
    slots = check_index_k(index_k_cache, slots, ik)
    num_pages, block_size, _ = index_k_cache.shape
    if ik.shape[0] == 0 or num_pages == 0:
        return

    def read_slot(slot: int) -> torch.Tensor:
        return index_k_cache[slot // block_size, slot % block_size, :]

    safe_slots, safe_values = _redirect_skipped(slots, ik.to(index_k_cache.dtype), read_slot)
    pages = torch.div(safe_slots, block_size, rounding_mode="floor")
    index_k_cache.index_put_((pages, safe_slots % block_size), safe_values)
