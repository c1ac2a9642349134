"""The fused `on_update_kv_lens` kernel on CPU through Triton's interpreter, at kv lengths within
a block of 2^31 (int32 arithmetic that wraps there would give negative block counts). Launched by
`test_interpreter.py` with TRITON_INTERPRET=1; also run on the GPU by `test_kv_lens_update.py`.

Prints one line per case and exits 1 if any case fails.
"""
from __future__ import annotations

import sys

import torch

from m3_eagle_plugin.msa.kernels.kv_lens_update import derive_token_fields

INT32_MAX = (1 << 31) - 1


def near_int32_max_mismatches(device: str, block: int = 16) -> list[str]:
    """Fields that differ from a Python-integer derivation, for two requests whose kv lengths sit
    at and just under INT32_MAX (a one-column table: every position maps to its request's page)."""
    kv, qo, pages = [INT32_MAX, INT32_MAX - 200], [4, 1], [5, 7]
    req, intra = [0, 0, 0, 0, 1], [0, 1, 2, 3, 0]
    i32 = dict(dtype=torch.int32, device=device)
    out = {name: torch.full((5,), 12345, **i32) for name in ("positions", "token_kv_lens", "valid_blocks",
                                                            "cache_slots")}
    derive_token_fields(
        kv_lens=torch.tensor(kv, **i32), kv_lens_staged=torch.tensor(kv, **i32), qo_lens=torch.tensor(qo, **i32),
        qo_offsets=torch.zeros(2, **i32), token_request=torch.tensor(req, **i32),
        token_intra=torch.tensor(intra, **i32), token_live=torch.ones(5, **i32),
        block_table_flat=torch.tensor(pages, **i32), max_blocks_per_seq=1, block_size=block, **out)
    pos = [kv[r] - qo[r] + t for r, t in zip(req, intra)]
    want = {"positions": pos, "token_kv_lens": [p + 1 for p in pos],
            "valid_blocks": [-(-(p + 1) // block) for p in pos],
            "cache_slots": [pages[r] * block + p % block for r, p in zip(req, pos)]}
    return [f"{name}: kernel {out[name].tolist()} vs {want[name]}" for name in want if out[name].tolist() != want[name]]


def main() -> int:
    bad = near_int32_max_mismatches("cpu")
    print(("FAIL kv lengths near 2^31: " + "; ".join(bad)) if bad else "PASS kv lengths near 2^31")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
