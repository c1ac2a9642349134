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
    KernelTooLargeError,
    backend_report,
    check_backend,
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
    assert set(report["kernels"]) == {"select_blocks_paged", "sparse_attention", "dense_attention", "on_update_kv_lens",
                                      "write_step_kv"}
    assert set(report["kernels"].values()) == {"torch"}
    assert report["reason"] in ("triton is not installed", "device cpu is not a CUDA device")


def test_env_override(monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    assert backend_report()["backend"] == "torch" and not use_triton("cpu")
    monkeypatch.setenv("M3_EAGLE_KERNELS", "bogus")
    with pytest.raises(KernelInputError, match="M3_EAGLE_KERNELS must be auto, triton, torch or flashinfer"):
        use_triton("cpu")
    monkeypatch.setenv("M3_EAGLE_KERNELS", "triton")
    with pytest.raises(KernelBackendError):
        use_triton("cpu")


@pytest.mark.parametrize("name", ["M3_EAGLE_HANDOFF", "M3_EAGLE_PDL", "M3_EAGLE_REPLAY"])
def test_check_backend_refuses_a_bad_switch_up_front(monkeypatch, name):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    assert check_backend("cpu") in ("auto", "torch")
    monkeypatch.setenv(name, "off")
    with pytest.raises(KernelInputError, match=f"{name}='off': expected one of"):
        check_backend("cpu")


def test_report_shows_flashinfer_the_table_and_its_verdicts(monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.delenv("M3_EAGLE_KERNEL_TABLE", raising=False)
    report = backend_report("cpu")
    fi = report["flashinfer"]
    assert fi["routes"] == ["select_blocks_paged", "sparse_attention"] and "SM90" in fi["device"]
    assert fi["status"]  # a version, or why FlashInfer is unavailable
    table = report["kernel_table"]
    assert table["source"].startswith("shipped ") and table["source"].endswith("peer_table_h200.json")
    assert (table["device"], table["date"]) == ("NVIDIA H200", "2026-11-30")
    assert table["applies"].startswith("no: this device is cpu")
    verdicts = report["table_verdicts"]
    assert "B64/32K q4 -> flashinfer (ours 32.13 / FlashInfer 30.99 us)" in verdicts["sparse_attention"]
    assert "B1/8K q4 -> ours (ours 3.98 / FlashInfer 4.8 us)" in verdicts["select_blocks_paged"]
    assert "B16/32K q1 -> ours (ours 7.86 / FlashInfer 9.26 us)" in verdicts["sparse_attention"]
    assert verdicts["dense_attention"][-1].startswith("decision: ours")
    assert any(line.startswith("dense_attn_peer B8/4K q4 -> ours") for line in verdicts["dense_attention"])


def test_report_names_a_malformed_table(monkeypatch, tmp_path):
    from m3_eagle_plugin.msa.kernels import kernel_table

    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(bad))
    kernel_table.clear_caches()
    report = backend_report("cpu")
    assert str(bad) in report["kernel_table"]["error"] and "table_verdicts" not in report


def test_env_flashinfer_mode(monkeypatch):
    """`flashinfer` forces the two routed kernels (raising where FlashInfer cannot run); the others
    behave as under auto (here: the torch references)."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    assert backend_report("cpu")["requested"] == "flashinfer" and not use_triton("cpu")
    geo, step, meta = _cpu_step()
    cache, q = step["cache"], step["q"]
    assert torch.equal(dense_attention(q, cache.k, cache.v, meta, scale=0.25),
                       ref_dense(q, cache.k, cache.v, meta, scale=0.25))
    sel = ref_select(step["index_q"], cache.index_k, meta, topk=geo.topk)
    with pytest.raises(KernelBackendError, match="M3_EAGLE_KERNELS=flashinfer.*sparse_attention.*SM90"):
        sparse_attention(q, cache.k, cache.v, meta, sel[: geo.kv_heads], scale=0.25)
    with pytest.raises(KernelBackendError, match="select_blocks_paged.*SM90"):
        select_blocks_paged(step["index_q"], cache.index_k, meta, topk=geo.topk)


def _cpu_step(q_heads: int = 4):
    geo = Geometry(q_heads=q_heads, kv_heads=2, head_dim=16, index_heads=2, index_dim=16, block=16, topk=3)
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


@pytest.mark.parametrize("mode", ["auto", "torch"])
@pytest.mark.parametrize("content, problem", [(None, "cannot read"), ('{"device": "X"}', "'date' must be")])
def test_check_backend_loads_the_named_kernel_table_up_front(monkeypatch, tmp_path, mode, content, problem):
    """`m3-eagle run` calls check_backend before reading any weight: a missing or malformed
    M3_EAGLE_KERNEL_TABLE is refused there, not at the first kernel choice mid-run (any mode: the
    variable names a file that is wrong whatever the mode)."""
    from m3_eagle_plugin.msa.kernels import kernel_table

    path = tmp_path / "table.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("M3_EAGLE_KERNELS", mode)
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    kernel_table.clear_caches()
    with pytest.raises(kernel_table.KernelTableError, match=f"kernel table {path}: {problem}"):
        check_backend("cpu")
    kernel_table.clear_caches()


def test_check_backend_parses_the_named_table_once(monkeypatch, tmp_path):
    from m3_eagle_plugin.msa.kernels import kernel_table

    path = tmp_path / "table.json"
    path.write_text('{"device": "X", "date": "d", "command": "c", "rows": []}')
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    kernel_table.clear_caches()
    assert check_backend("cpu") == "auto"
    path.write_text("{broken")  # parsed by check_backend: the choices to come use that table, not a re-read
    assert kernel_table.load_table().source == str(path)
    kernel_table.clear_caches()


def _too_large(*args, **kwargs):
    raise KernelTooLargeError("stand-in: these tiles need more shared memory than the device has")


@pytest.fixture
def kernels_too_large(monkeypatch):
    """Every kernel entry the dispatchers call refuses its tiles, as `launch` does past one stage."""
    from m3_eagle_plugin.msa.kernels import backend, dense_verify, index_select, sparse_verify, verify_step

    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    for module, name in ((dense_verify, "dense_verify_attention"), (sparse_verify, "sparse_verify_attention"),
                         (index_select, "select_blocks_verify"), (verify_step, "sparse_verify_step")):
        monkeypatch.setattr(module, name, _too_large)
    return backend


def test_auto_runs_the_torch_reference_where_a_kernel_is_too_large(monkeypatch, kernels_too_large):
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    backend = kernels_too_large
    warned = []
    monkeypatch.setattr(backend, "_FELL_BACK", set())
    monkeypatch.setattr(backend, "get_logger", lambda: type("L", (), {"warning": lambda *a: warned.append(a)})())
    geo, step, meta = _cpu_step()
    cache, q, index_q = step["cache"], step["q"], step["index_q"]
    sel = ref_select(index_q, cache.index_k, meta, topk=geo.topk)
    assert torch.equal(backend.select_blocks_paged(index_q, cache.index_k, meta, topk=geo.topk), sel)
    expect = ref_sparse(q, cache.k, cache.v, meta, sel, scale=0.25)
    assert torch.equal(backend.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.25), expect)
    assert torch.equal(backend.sparse_layer_attention(q, cache.k, cache.v, index_q, cache.index_k, meta,
                                                      topk=geo.topk, scale=0.25), expect)
    assert torch.equal(backend.dense_attention(q, cache.k, cache.v, meta, scale=0.25),
                       ref_dense(q, cache.k, cache.v, meta, scale=0.25))
    assert len(warned) == 1 and "stand-in" in str(warned[0])  # one refusal, said once however often it falls back


def test_auto_runs_the_torch_reference_where_the_attention_grid_is_past_cudas_limit(monkeypatch):
    """The real refusal, not a stand-in: a grid with more than 65535 programs on z (here a token's
    splits, 3 tokens a request x 32768) is refused before launch, and `auto` runs the reference;
    a forced `triton` says why."""
    from m3_eagle_plugin.msa.kernels import backend, sparse_verify

    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    monkeypatch.setattr(backend, "_FELL_BACK", set())
    monkeypatch.setattr(backend, "get_logger", lambda: type("L", (), {"warning": lambda *a: None})())
    monkeypatch.setattr(sparse_verify, "token_splits", lambda *a, **k: 1 << 15)  # stands in for a 64K-token step
    monkeypatch.setattr(sparse_verify, "launch", lambda *a, **k: pytest.fail("launched a grid CUDA refuses"))
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    geo, step, meta = _cpu_step()
    cache, q = step["cache"], step["q"]
    sel = ref_select(step["index_q"], cache.index_k, meta, topk=geo.topk)[: geo.kv_heads]
    assert torch.equal(backend.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.25),
                       ref_sparse(q, cache.k, cache.v, meta, sel, scale=0.25))
    monkeypatch.setenv("M3_EAGLE_KERNELS", "triton")
    with pytest.raises(KernelTooLargeError, match="3 tokens a request x 32768 splits"):
        backend.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.25)


def test_fp8_scales_on_a_shape_the_kernels_skip_say_why(monkeypatch):
    from m3_eagle_plugin.msa.kernels import backend

    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    geo, step, meta = _cpu_step(q_heads=6)
    cache = step["cache"]
    with pytest.raises(KernelBackendError, match="6 query heads over 2 KV heads: the group must be a power of two"):
        backend.dense_attention(step["q"], cache.k, cache.v, meta, scale=0.25, k_scale=0.5)


def test_a_too_large_kernel_is_an_error_when_forced_or_with_fp8_scales(monkeypatch, kernels_too_large):
    backend = kernels_too_large
    geo, step, meta = _cpu_step()
    cache, q = step["cache"], step["q"]
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    with pytest.raises(KernelTooLargeError):  # the reference has no fp8 scales: say what failed
        backend.dense_attention(q, cache.k, cache.v, meta, scale=0.25, k_scale=0.5)
    monkeypatch.setenv("M3_EAGLE_KERNELS", "triton")
    with pytest.raises(KernelTooLargeError):
        backend.dense_attention(q, cache.k, cache.v, meta, scale=0.25)
    with pytest.raises(KernelTooLargeError):
        backend.select_blocks_paged(step["index_q"], cache.index_k, meta, topk=geo.topk)


@pytest.mark.parametrize("value, mode", [("TORCH", "torch"), (" Torch ", "torch"), ("", "auto"), ("  ", "auto")])
def test_the_backend_variable_is_read_stripped_and_lower_cased(monkeypatch, value, mode):
    """As the kernels' other switches: case and surrounding blanks do not matter, empty means the default."""
    from m3_eagle_plugin.msa.kernels.backend import requested_backend

    monkeypatch.setenv("M3_EAGLE_KERNELS", value)
    assert requested_backend() == mode


def test_torch_mode_keeps_triton_off_where_it_could_run(monkeypatch):
    from m3_eagle_plugin.msa.kernels import backend

    monkeypatch.setattr(backend, "triton_available", lambda device=None: True)
    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    assert backend.use_triton("cpu") is False
    monkeypatch.setenv("M3_EAGLE_KERNELS", "auto")
    assert backend.use_triton("cpu") is True


def test_report_names_the_missing_triton_before_the_device(monkeypatch):
    """The reasons in order: the override, then a missing Triton, then a device that is not CUDA."""
    from m3_eagle_plugin.msa.kernels import backend

    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setattr(backend, "triton_importable", lambda: True)
    assert backend.backend_report("cpu")["reason"] == "device cpu is not a CUDA device"
    monkeypatch.setattr(backend, "triton_importable", lambda: False)
    assert backend.backend_report("cpu")["reason"] == "triton is not installed"


def test_report_verdicts_count_a_tie_as_ours_and_keep_the_whole_step_apart(monkeypatch, tmp_path):
    """dense_attention has no FlashInfer route: its decision line counts the shapes where ours is at or
    below FlashInfer (a tie is ours, as in the choice; an unmeasured FlashInfer counts as neither). The
    sparse layer's whole-step rows are listed once, under `sparse_step`, not as a dispatcher."""
    import json

    from m3_eagle_plugin.msa.kernels import kernel_table

    rows = [{"kernel": "dense_attn", "batch": b, "context": 4096, "qo_len": 4, "ours_us": 10.0, "flashinfer_us": fi}
            for b, fi in ((1, 10.0), (2, 12.0), (4, 8.0), (8, None))]
    rows.append({"kernel": "sparse_step", "batch": 1, "context": 4096, "qo_len": 4, "ours_us": 5.0,
                 "flashinfer_us": 6.0})
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "X", "date": "d", "command": "c", "rows": rows}))
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    kernel_table.clear_caches()
    try:
        verdicts = backend_report("cpu")["table_verdicts"]
    finally:
        kernel_table.clear_caches()
    assert verdicts["dense_attention"][-1] == ("decision: ours (no FlashInfer route; ours faster in 2 of 4 "
                                               "measured shapes)")
    assert set(verdicts) == {"select_blocks_paged", "sparse_attention", "dense_attention", "sparse_step"}
    assert verdicts["sparse_step"][0] == "B1/4K q4 -> ours (ours 5 / FlashInfer 6 us)"


def test_sparse_attention_takes_a_group_the_padded_tile_holds(monkeypatch):
    """The per-token sparse layout pads a tile's rows: a GQA group that is not a power of two but at
    most MAX_TILE_ROWS (here 3) runs the kernel, where the dense attention runs the reference."""
    from m3_eagle_plugin.msa.kernels import backend, sparse_verify

    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    monkeypatch.setattr(sparse_verify, "sparse_verify_attention", lambda *a, **k: "kernel")
    geo, step, meta = _cpu_step(q_heads=6)
    cache = step["cache"]
    sel = ref_select(step["index_q"], cache.index_k, meta, topk=geo.topk)
    assert backend.sparse_attention(step["q"], cache.k, cache.v, meta, sel, scale=0.25) == "kernel"


def test_a_too_large_sparse_kernel_with_fp8_scales_raises_its_own_refusal(monkeypatch, kernels_too_large):
    """Under `auto` the reference cannot stand in (it takes no fp8 scales): the tile refusal itself is
    raised, not a second error about the scales."""
    backend = kernels_too_large
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    geo, step, meta = _cpu_step()
    cache, q = step["cache"], step["q"]
    sel = ref_select(step["index_q"], cache.index_k, meta, topk=geo.topk)
    with pytest.raises(KernelTooLargeError, match="stand-in"):
        backend.sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.25, v_scale=0.5)


@pytest.mark.parametrize("scales", [{"k_scale": 0.5}, {"v_scale": 0.5}])
def test_cpu_sparse_attention_refuses_either_fp8_scale(monkeypatch, scales):
    """The references take no fp8 scales: one scale alone is refused, never silently dropped."""
    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    geo, step, meta = _cpu_step()
    cache, q = step["cache"], step["q"]
    sel = ref_select(step["index_q"], cache.index_k, meta, topk=geo.topk)
    with pytest.raises(KernelBackendError, match="fp8 KV scales need the Triton kernels"):
        sparse_attention(q, cache.k, cache.v, meta, sel, scale=0.25, **scales)
    with pytest.raises(KernelBackendError, match="fp8 KV scales need the Triton kernels"):
        dense_attention(q, cache.k, cache.v, meta, scale=0.25, **scales)


def test_cpu_write_step_kv_checks_index_k_before_writing_k_and_v(monkeypatch):
    """All or nothing, as the fused writer: index-K rows of the wrong width or pages of another block
    size than K/V (one slot names one token in both caches) are refused before K/V are written.
    Index-K pages of the K/V block size are taken whatever the KV head count."""
    from m3_eagle_plugin.msa.blocks import MsaInputError
    from m3_eagle_plugin.msa.kernels import backend

    monkeypatch.setenv("M3_EAGLE_KERNELS", "torch")
    slots = torch.tensor([5, 17])  # page 0 offset 5, page 1 offset 1 (16-token pages)
    k, v, ik = torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0), torch.full((2, 4), 3.0)
    k_cache, v_cache, index_k_cache = torch.zeros(3, 2, 16, 8), torch.zeros(3, 2, 16, 8), torch.zeros(3, 16, 4)
    backend.write_step_kv(k_cache, v_cache, slots, k, v, index_k_cache, ik)
    assert bool((k_cache[0, :, 5] == 1).all() and (k_cache[1, :, 1] == 1).all()) and int(k_cache.sum()) == 32
    assert bool((v_cache[0, :, 5] == 2).all() and (v_cache[1, :, 1] == 2).all()) and int(v_cache.sum()) == 64
    assert bool((index_k_cache[0, 5] == 3).all() and (index_k_cache[1, 1] == 3).all())
    assert int(index_k_cache.sum()) == 24
    for bad_cache, bad_ik, problem in ((torch.zeros(6, 8, 4), ik, "index-K block size 8 differs from the K/V "
                                        "block size 16"), (index_k_cache, torch.zeros(2, 5), "index_k must be")):
        k_cache, v_cache = torch.zeros(3, 2, 16, 8), torch.zeros(3, 2, 16, 8)
        with pytest.raises(MsaInputError, match=problem):
            backend.write_step_kv(k_cache, v_cache, slots, k, v, bad_cache, bad_ik)
        assert not k_cache.any() and not v_cache.any()


def test_layer_runs_our_whole_step_where_neither_half_goes_to_flashinfer(monkeypatch):
    """No FlashInfer route (CPU): the kernels' whole step in one call, its attention output returned."""
    from m3_eagle_plugin.msa.kernels import backend, index_select, sparse_verify, verify_step

    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    monkeypatch.setattr(verify_step, "sparse_verify_step", lambda *a, **k: ("selection", "whole step"))
    for module, name in ((index_select, "select_blocks_verify"), (sparse_verify, "sparse_verify_attention")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("ran a half on its own"))
    geo, step, meta = _cpu_step()
    cache = step["cache"]
    assert backend.sparse_layer_attention(step["q"], cache.k, cache.v, step["index_q"], cache.index_k, meta,
                                          topk=geo.topk, scale=0.25) == "whole step"


@pytest.mark.parametrize("mode", ["triton", "flashinfer"])
def test_report_names_a_forced_backend_that_cannot_run_here(monkeypatch, mode):
    """A forced backend that cannot run on the device: `check_backend` (`m3-eagle run`) refuses it,
    and the report says so (`error`, the same words) rather than what `auto` would run; under
    `triton` no kernel falls back to the references (a call raises), so none is reported as torch."""
    monkeypatch.setenv("M3_EAGLE_KERNELS", mode)
    with pytest.raises(KernelBackendError) as refused:
        check_backend("cpu")
    report = backend_report("cpu")
    assert report["error"] == str(refused.value)
    geo, step, meta = _cpu_step()
    cache = step["cache"]
    if mode == "triton":
        with pytest.raises(KernelBackendError):
            dense_attention(step["q"], cache.k, cache.v, meta, scale=0.25)
        assert set(report["kernels"].values()) == {"triton"} and str(refused.value) in report["reason"]
    monkeypatch.setenv("M3_EAGLE_KERNELS", "auto")
    assert "error" not in backend_report("cpu")


def test_flashinfer_mode_runs_the_reference_where_an_unrouted_kernel_is_too_large(monkeypatch, kernels_too_large):
    """`flashinfer` forces only the two routed kernels; the dense attention behaves as under `auto`,
    so a tile refusal runs the torch reference there too."""
    backend = kernels_too_large
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    monkeypatch.setattr(backend, "_FELL_BACK", set())
    monkeypatch.setattr(backend, "get_logger", lambda: type("L", (), {"warning": lambda *a: None})())
    geo, step, meta = _cpu_step()
    cache, q = step["cache"], step["q"]
    assert torch.equal(backend.dense_attention(q, cache.k, cache.v, meta, scale=0.25),
                       ref_dense(q, cache.k, cache.v, meta, scale=0.25))
    with pytest.raises(KernelTooLargeError):  # fp8 scales: no reference takes them
        backend.dense_attention(q, cache.k, cache.v, meta, scale=0.25, k_scale=0.5)


def test_index_queries_of_two_dims_are_refused_naming_the_shape_where_triton_runs(monkeypatch):
    """A [T, Di] index_q is refused with the reference's own message (it names the shape it wants),
    not a tuple-unpacking error from inside the kernel wrapper."""
    from m3_eagle_plugin.msa.kernels import backend

    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    geo, step, meta = _cpu_step()
    flat = step["index_q"][:, 0]
    with pytest.raises(ValueError) as want:
        ref_select(flat, step["cache"].index_k, meta, topk=geo.topk)
    with pytest.raises(ValueError) as got:
        backend.select_blocks_paged(flat, step["cache"].index_k, meta, topk=geo.topk)
    assert str(got.value) == str(want.value) and "index_q must be" in str(got.value)


@pytest.mark.parametrize("topk", [16.0, -1], ids=repr)
def test_layer_names_a_topk_the_selection_cannot_take_before_sizing_a_selection_by_it(monkeypatch, topk):
    """Where the kernels run, the layer's FlashInfer check sized a placeholder selection by `topk`:
    16.0 and -1 failed inside torch (`new_empty`), not as the count the reference refuses."""
    from m3_eagle_plugin.msa.kernels import backend

    monkeypatch.delenv("M3_EAGLE_KERNELS", raising=False)
    monkeypatch.setattr(backend, "use_triton", lambda device: True)
    geo, step, meta = _cpu_step()
    cache = step["cache"]
    with pytest.raises((TypeError, ValueError), match="topk must be"):
        ref_select(step["index_q"], cache.index_k, meta, topk=topk)
    with pytest.raises(KernelInputError, match="topk must be an int"):
        backend.sparse_layer_attention(step["q"], cache.k, cache.v, step["index_q"], cache.index_k, meta, topk=topk,
                                       scale=0.25)
