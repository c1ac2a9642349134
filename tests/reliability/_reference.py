"""Naive per-token metadata, written from the contract in docs/internals.md, as the test oracle."""
from __future__ import annotations

import math

import torch


def token_fields(qo_lens: list[int], kv_lens: list[int], table: torch.Tensor, block_size: int) -> dict:
    """What `MsaDecodeMetadata.prepare` must produce for valid input, one loop per token."""
    slots, valid, kv, pos, row = [], [], [], [], []
    for r, (qo, kvl) in enumerate(zip(qo_lens, kv_lens)):
        for t in range(qo):
            p = kvl - qo + t
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size)
            valid.append(math.ceil(min(p + 1, kvl) / block_size))
            kv.append(p + 1)
            pos.append(p)
            row.append(r)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return {"cache_slots": as_int(slots), "valid_blocks": as_int(valid), "token_kv_lens": as_int(kv),
            "positions": as_int(pos), "token_request": as_int(row)}

