"""A minimal, host-built decode/verify step metadata for benchmarks and kernel tests.

Why: the kernels read a handful of device tensors from the step metadata (see docs/internals.md).
This builder derives them directly from `(qo_lens, kv_lens, block_tables)` with plain Python, so
benchmarks and tests do not depend on (or test against) `MsaDecodeMetadata` itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class StepMeta:
    block_tables: torch.Tensor   # int32 [R, W]
    kv_lens: torch.Tensor        # int32 [R]
    qo_lens: torch.Tensor        # int32 [R]
    cu_qo_lens: torch.Tensor     # int32 [R + 1]
    qo_offsets: torch.Tensor     # int32 [R]
    positions: torch.Tensor      # int32 [T]
    token_kv_lens: torch.Tensor  # int32 [T]
    valid_blocks: torch.Tensor   # int32 [T]
    token_request: torch.Tensor  # int32 [T]
    cache_slots: torch.Tensor    # int64 [T]
    block_size: int
    qo_lens_host: tuple[int, ...] = ()  # the requests' q_lens on the host (padding rows are not requests)

    @property
    def num_requests(self) -> int:
        return int(self.kv_lens.shape[0])


def build_step_meta(qo_lens: Sequence[int], kv_lens: Sequence[int], block_tables: torch.Tensor,
                    block_size: int, device: torch.device | str | None = None,
                    pad_tokens: int = 0) -> StepMeta:
    """Per-token fields of a step; `pad_tokens` appends graph-padding tokens (slot -1, request 0)."""
    if len(qo_lens) != len(kv_lens) or len(qo_lens) != block_tables.shape[0]:
        raise ValueError("qo_lens, kv_lens and block_tables must describe the same requests")
    device = block_tables.device if device is None else torch.device(device)
    tables = block_tables.to(torch.int64).cpu()
    positions, request, slots, cu = [], [], [], [0]
    for r, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        if qo < 1 or kv < qo:
            raise ValueError(f"request {r}: need 1 <= qo_len <= kv_len, got qo={qo} kv={kv}")
        blocks = -(-kv // block_size)
        if blocks > tables.shape[1]:
            raise ValueError(f"request {r}: kv_len {kv} needs {blocks} blocks, block_tables has {tables.shape[1]}")
        if (tables[r, :blocks] < 0).any():  # else its cache slots came out negative, silently
            raise ValueError(f"request {r}: block_tables has an unmapped page (< 0) among its first {blocks}")
        for t in range(qo):
            p = kv - qo + t
            positions.append(p)
            request.append(r)
            slots.append(int(tables[r, p // block_size]) * block_size + p % block_size)
        cu.append(cu[-1] + qo)
    positions += [0] * pad_tokens
    request += [0] * pad_tokens
    slots += [-1] * pad_tokens
    pos = torch.tensor(positions, dtype=torch.int32)
    live = torch.arange(len(positions)) < cu[-1]

    def i32(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(device)

    return StepMeta(
        block_tables=block_tables.to(device=device, dtype=torch.int32).contiguous(),
        kv_lens=i32(list(kv_lens)),
        qo_lens=i32(list(qo_lens)),
        cu_qo_lens=i32(cu),
        qo_offsets=i32([kv - qo for qo, kv in zip(qo_lens, kv_lens)]),
        positions=i32(pos),
        token_kv_lens=i32(torch.where(live, pos + 1, 0)),
        valid_blocks=i32(torch.where(live, (pos + block_size) // block_size, 0)),
        token_request=i32(request),
        cache_slots=torch.tensor(slots, dtype=torch.int64).to(device),
        block_size=block_size,
        qo_lens_host=tuple(int(qo) for qo in qo_lens),
    )
