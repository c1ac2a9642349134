"""The kernel dispatchers on cuda:1 while cuda:0 is current (Triton launches on the current
device). Run by `test_device_guard.py` in a subprocess on a machine with two GPUs: a launch on the
wrong device can leave the CUDA context unusable.

Prints one line per case and exits 1 if any case fails.
"""
from __future__ import annotations

import sys
import traceback

import torch

from m3_eagle_plugin.bench import torch_reference as ref
from m3_eagle_plugin.bench.inputs import Geometry
from m3_eagle_plugin.msa import kernels
from tests.msa.kernels.kernel_case_helpers import assert_close_rel, random_step

GEO = Geometry(q_heads=16, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=4)
SCALE = GEO.head_dim ** -0.5


def _step():
    return random_step(GEO, [4] * 8, [100 + 29 * i for i in range(8)], kv_dtype=torch.float16,
                       index_dtype=torch.float16, q_dtype=torch.float16, device="cuda:1")


def sparse_layer():
    meta, cache, q, index_q = _step()
    sel = ref.select_blocks(index_q, cache.index_k, meta, topk=GEO.topk)
    expect = ref.sparse_attention(q, cache.k, cache.v, meta, sel, scale=SCALE)
    out = kernels.sparse_layer_attention(q, cache.k, cache.v, index_q, cache.index_k, meta, topk=GEO.topk,
                                         scale=SCALE)
    assert_close_rel(out.float(), expect.float(), 3e-3)


def dense():
    meta, cache, q, _ = _step()
    expect = ref.dense_attention(q, cache.k, cache.v, meta, scale=SCALE)
    assert_close_rel(kernels.dense_attention(q, cache.k, cache.v, meta, scale=SCALE).float(), expect.float(), 3e-3)


def cache_write():
    meta, cache, _, _ = _step()
    k = torch.randn(meta.positions.shape[0], GEO.kv_heads, GEO.head_dim, device="cuda:1").half()
    slots = torch.arange(k.shape[0], device="cuda:1", dtype=torch.int32) * 3
    k_cache, v_cache = cache.k.clone(), cache.v.clone()
    kernels.write_step_kv(k_cache, v_cache, slots, k, 2 * k)
    block = k_cache.shape[2]
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // block, :, slot % block], k[t])
        assert torch.equal(v_cache[slot // block, :, slot % block], 2 * k[t])


CASES = (sparse_layer, dense, cache_write)


def main() -> int:
    torch.cuda.set_device(0)
    failed = 0
    for case in CASES:
        try:
            case()
            torch.cuda.synchronize(1)
            assert torch.cuda.current_device() == 0, "the caller's current device changed"
            print(f"PASS {case.__name__}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {case.__name__}: {traceback.format_exc(limit=3)!r}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
