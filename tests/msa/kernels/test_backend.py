"""Backend chooser: report contents, the env override, and the CPU fallback to the torch references."""
from __future__ import annotations

import pytest
import torch

from m3_eagle_plugin.bench.inputs import Geometry, make_step
from m3_eagle_plugin.msa import MsaDecodeMetadata
from m3_eagle_plugin.msa import dense_attention as ref_dense
from m3_eagle_plugin.msa import select_blocks_paged as ref_select
from m3_eagle_plugin.msa import sparse_attention as ref_sparse
from m3_eagle_plugin.msa.kernels import (
    KernelBackendError,
    KernelInputError,
    backend_report,
    dense_attention,
    on_update_kv_lens,
    select_blocks_paged,
    sparse_attention,
    use_triton,
)


def test_cpu_report_names_torch_and_why(monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    report = backend_report("cpu")
    assert report["backend"] == "torch"
    assert set(report["kernels"]) == {"select_blocks_paged", "sparse_attention", "dense_attention", "on_update_kv_lens"}
    assert set(report["kernels"].values()) == {"torch"}
    assert report["reason"] in ("triton is not installed", "device cpu is not a CUDA device")


def test_env_override(monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    assert backend_report()["backend"] == "torch" and not use_triton("cpu")
    monkeypatch.setenv("M3_EAGLE_KERNELS", "bogus")
    with pytest.raises(KernelInputError, match="M3_EAGLE_KERNELS"):
        use_triton("cpu")
    monkeypatch.setenv("M3_EAGLE_KERNELS", "triton")
    with pytest.raises(KernelBackendError):
        use_triton("cpu")


def _cpu_step():
    geo = Geometry(q_heads=4, kv_heads=2, head_dim=16, index_heads=2, index_dim=16, block=16, topk=3)
    step = make_step(2, 70, 3, geo, kv_dtype=torch.float32, index_dtype=torch.float32, q_dtype=torch.float32,
                     device="cpu", seed=3)
    sm = step["meta"]
    meta = MsaDecodeMetadata(2, 6, sm.block_tables.shape[1], geo.block, "cpu", max_draft_len=2)
    meta.prepare(sm.qo_lens.tolist(), sm.kv_lens.tolist(), sm.block_tables)
    return geo, step, meta


def test_cpu_dispatch_is_the_package_reference(monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    geo, step, meta = _cpu_step()
    cache, q = step["cache"], step["q"]
    sel = select_blocks_paged(step["index_q"], cache.index_k, meta, topk=geo.topk)
    assert torch.equal(sel, ref_select(step["index_q"], cache.index_k, meta, topk=geo.topk))
    assert torch.equal(sparse_attention(q, cache.k, cache.v, meta, sel[: geo.kv_heads], scale=0.25),
                       ref_sparse(q, cache.k, cache.v, meta, sel[: geo.kv_heads], scale=0.25))
    assert torch.equal(dense_attention(q, cache.k, cache.v, meta, scale=0.25),
                       ref_dense(q, cache.k, cache.v, meta, scale=0.25))
    with pytest.raises(KernelBackendError, match="fp8"):
        dense_attention(q, cache.k, cache.v, meta, scale=0.25, k_scale=0.5)


def test_cpu_on_update_kv_lens_falls_back(monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    _, _, meta = _cpu_step()
    on_update_kv_lens(meta, torch.tensor([69, 68], dtype=torch.int32))
    assert meta.kv_lens.tolist() == [69, 68]
    assert meta.positions.tolist() == [66, 67, 68, 65, 66, 67]


def test_no_kernel_module_shadows_an_exported_dispatcher():
    """Importing `kernels.<name>` as a submodule would rebind the package attribute `<name>`."""
    from pathlib import Path

    import m3_eagle_plugin.msa.kernels as kernels

    modules = {p.stem for p in Path(kernels.__file__).parent.glob("*.py")}
    assert not modules & set(kernels.__all__), sorted(modules & set(kernels.__all__))
