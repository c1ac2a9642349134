"""install() / uninstall() / report() on the host double, in both module layouts."""
from __future__ import annotations

import threading

import pytest

from m3_eagle_plugin.host import trtllm as adapter
from m3_eagle_plugin.host.trtllm.contract import PATCH_IDS

from .test_patching import snapshot


def _rocket():
    from tensorrt_llm.llmapi.llm_args import RocketSparseAttentionConfig

    return RocketSparseAttentionConfig()


def _m3():
    from tensorrt_llm.llmapi.llm_args import MiniMaxM3SparseAttentionConfig

    return MiniMaxM3SparseAttentionConfig()


def test_install_patches_everything_and_uninstall_restores(host):
    before = snapshot()
    report = adapter.install()
    assert report["installed"] and report["patches"] == sorted(PATCH_IDS)
    assert report["layout"] == host.layout and report["host_version"] == "1.3.0rc24"
    assert set(report["models"]) == {"MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"}
    assert report["error"] is None
    from tensorrt_llm._torch.pyexecutor import _util

    assert _util.get_sparse_attn_kv_cache_manager(_m3()).__name__ == "M3EagleKVCacheManagerV2"
    adapter.uninstall()
    assert all(snapshot()[k] is before[k] for k in before)
    assert _util.get_sparse_attn_kv_cache_manager(_m3()).__name__ == "MiniMaxM3KVCacheManagerV2"
    assert adapter.report()["installed"] is False and adapter.report()["models"] == {}


def test_double_install_is_a_noop_and_force_reapplies(host):
    first = adapter.install()
    from tensorrt_llm._torch.speculative import interface

    wrapped = interface.should_use_separate_draft_kv_cache
    assert adapter.install() == first
    assert interface.should_use_separate_draft_kv_cache is wrapped
    again = adapter.install(force=True)
    assert again["installed"] and interface.should_use_separate_draft_kv_cache is not wrapped
    assert interface.should_use_separate_draft_kv_cache.__wrapped__ is wrapped.__wrapped__


def test_missing_symbol_raises_and_leaves_the_double_untouched(host):
    from m3_eagle_plugin.host.trtllm.contract import import_first, symbol
    from tensorrt_llm._torch.models import modeling_minimaxm3, modeling_utils  # noqa: F401 (host registers)

    dispatch = import_first(symbol("m3_backend_resolver").modules)
    del dispatch._resolve_minimax_m3_backend_cls
    mapping_before = dict(modeling_utils.MODEL_CLASS_MAPPING)
    from tensorrt_llm._torch.speculative import interface

    predicate = interface.should_use_separate_draft_kv_cache
    with pytest.raises(adapter.HostPatchError, match="nothing was patched.*_resolve_minimax_m3_backend_cls"):
        adapter.install()
    assert interface.should_use_separate_draft_kv_cache is predicate
    assert modeling_utils.MODEL_CLASS_MAPPING == mapping_before
    assert adapter.report()["installed"] is False
    assert "_resolve_minimax_m3_backend_cls" in adapter.report()["error"]


def test_non_m3_models_see_identical_behaviour(host):
    from tensorrt_llm._torch.pyexecutor import _util
    from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig

    class _Cfg:
        sparse_attention_config = None

    spec = Eagle3DecodingConfig()
    two_model = Eagle3DecodingConfig(one_model=False)
    probes = {
        "rocket manager": lambda: _util.get_sparse_attn_kv_cache_manager(_rocket()),
        "dense manager": lambda: _util.get_kv_cache_manager_cls(_Cfg()),
        "predicate one-model": lambda: _util.should_use_separate_draft_kv_cache(spec),
        "predicate two-model": lambda: _util.should_use_separate_draft_kv_cache(two_model),
        "predicate none": lambda: _util.should_use_separate_draft_kv_cache(None),
        "creator": lambda: _util.KvCacheCreator(speculative_config=spec, sparse_attention_config=_rocket())
        ._should_create_separate_draft_kv_cache(),
    }
    before = {name: probe() for name, probe in probes.items()}
    with pytest.raises(ValueError, match="Unsupported") as unpatched_error:
        _util.get_sparse_attn_kv_cache_manager(type("C", (), {"algorithm": "bogus"})())
    adapter.install()
    assert {name: probe() for name, probe in probes.items()} == before
    with pytest.raises(ValueError, match="Unsupported") as patched_error:
        _util.get_sparse_attn_kv_cache_manager(type("C", (), {"algorithm": "bogus"})())
    assert str(patched_error.value) == str(unpatched_error.value)


def test_install_from_many_threads_applies_once(current_host):
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(adapter.install())) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reports) == 6 and all(r["installed"] for r in reports)
    assert len({tuple(r["bindings"]) for r in reports}) == 1


def test_components_are_named_for_the_registry():
    from m3_eagle_plugin.registry import make_plugin_manager

    pm = make_plugin_manager()
    assert pm.kv_cache_manager("tensorrt_llm", {"algorithm": "minimax_m3"}) == adapter.COMPONENTS["kv_cache_manager"]
    assert pm.model_classes("tensorrt_llm")["MiniMaxM3SparseForCausalLM"] == adapter.COMPONENTS["model"]
    assert {p.id for p in pm.host_patches("tensorrt_llm")} == set(PATCH_IDS)


def test_a_failure_while_collecting_patches_is_reported(host, monkeypatch):
    """A plugin's m3_eagle_host_patches hook that raises: install() refuses with nothing patched,
    and report() (what `m3-eagle doctor` prints) says why instead of `error: None`."""
    before = snapshot()

    def exploding_hook():
        raise RuntimeError("hook exploded")

    monkeypatch.setattr(adapter, "_host_patches", exploding_hook)
    with pytest.raises(adapter.HostPatchError, match="hook exploded"):
        adapter.install()
    assert all(snapshot()[k] is before[k] for k in before)
    report = adapter.report()
    assert report["installed"] is False and "hook exploded" in (report["error"] or "")


def test_a_host_module_failing_to_import_is_named_not_blamed_on_the_patch_hooks(tmp_path):
    """A host module that exists but raises on import (flashinfer against a mismatched CUDA driver):
    install() said "collecting host patches failed", the plugin hooks' message; it names the import of
    the host and the symbol it was looking up, with nothing patched."""
    from .conftest import _activate, _deactivate
    from .fakehost import build_fake_host

    root = build_fake_host(tmp_path)
    fmha = root / "tensorrt_llm/_torch/attention/backends/fmha/flashinfer_trtllm_gen.py"
    fmha.write_text('raise RuntimeError("CUDA driver version is insufficient")\n' + fmha.read_text())
    _activate(root)
    try:
        with pytest.raises(adapter.HostPatchError) as caught:
            adapter.install()
        message = str(caught.value)
        assert "collecting host patches" not in message
        for needle in ("importing the host failed", "_is_supported_with_reason",
                       "fmha.flashinfer_trtllm_gen", "CUDA driver version is insufficient"):
            assert needle in message
        report = adapter.report()
        assert report["installed"] is False and report["bindings"] == [] and report["error"] == message
    finally:
        _deactivate(root)


def test_uninstall_clears_the_unified_draft_kv_marks_even_when_reverting_fails(monkeypatch):
    """A failed revert used to skip clearing the marks (they keep the marked spec configs alive, and a
    later install would answer "unified" for them); the revert's error still reaches the caller."""
    from m3_eagle_plugin.host.trtllm import scope

    spec_config = object()
    scope.mark_unified_draft_kv(spec_config)

    def failing_revert():
        raise adapter.HostPatchError("reverting the patches was incomplete: boom")

    monkeypatch.setattr(adapter._engine, "revert", failing_revert)
    try:
        with pytest.raises(adapter.HostPatchError, match="boom"):
            adapter.uninstall()
        assert not scope.wants_unified_draft_kv(spec_config)
    finally:
        scope.clear_unified_marks()


def test_a_plugin_returning_something_other_than_patches_is_refused(current_host):
    """Another plugin's m3_eagle_host_patches returning a non-Patch: install() refuses with nothing
    patched and names what it got, rather than failing somewhere inside the engine."""
    from m3_eagle_plugin.hooks import hookimpl
    from m3_eagle_plugin.registry import get_plugin_manager

    class Sloppy:
        @hookimpl
        def m3_eagle_host_patches(self, host):
            return ["route-everything"]

    before = snapshot()
    pm = get_plugin_manager()
    pm.register(Sloppy(), name="test-sloppy-patches")
    try:
        with pytest.raises(adapter.HostPatchError, match="'route-everything'.*expected m3_eagle_plugin"):
            adapter.install()
    finally:
        pm.unregister(name="test-sloppy-patches")
    assert all(snapshot()[k] is before[k] for k in before)
    assert adapter.report()["installed"] is False and "route-everything" in adapter.report()["error"]


def test_force_retries_an_incomplete_rollback_and_applies(current_host, monkeypatch):
    """An activation whose rollback left something patched (an undo that raised) is reverted again by
    install(force=True), which then applies cleanly; without force the engine refuses."""
    from m3_eagle_plugin.host.trtllm import registration
    from m3_eagle_plugin.host.trtllm.patches import forward_env_to_mpi_pool as mpi_step

    register = registration.register_model_classes
    forward = mpi_step.forward_env_to_mpi_pool
    broken = {"undo": True, "step": True}

    def flaky_register(classes):
        undo = register(classes)

        def flaky_undo():
            if broken["undo"]:
                raise RuntimeError("registry undo exploded")
            undo()
        return flaky_undo

    def failing_forward():
        if broken["step"]:
            raise RuntimeError("mpi step exploded")
        return forward()

    monkeypatch.setattr(registration, "register_model_classes", flaky_register)
    monkeypatch.setattr(mpi_step, "forward_env_to_mpi_pool", failing_forward)
    with pytest.raises(adapter.HostPatchError, match="registry undo exploded"):
        adapter.install()
    assert adapter.report()["still_patched"]
    with pytest.raises(adapter.HostPatchError, match=r"call revert\(\) first .*uninstall\(\) or install\(force=True\)"):
        adapter.install()  # the remedies an install() caller can reach
    broken.update(undo=False, step=False)
    report = adapter.install(force=True)
    assert report["installed"] and report["still_patched"] == [] and report["error"] is None
    adapter.uninstall()


def test_the_registry_names_the_model_class_each_architecture_is_registered_with(current_host):
    """What status / doctor / the activation line report as the model classes (the registry's answer
    for tensorrt_llm) is the class the host then builds for each architecture: the VL architecture
    gets the VL class, not the text one."""
    from m3_eagle_plugin.registry import get_plugin_manager
    from tensorrt_llm._torch.models.modeling_utils import get_registered_model_class

    reported = get_plugin_manager().model_classes("tensorrt_llm")
    adapter.install()
    built = {}
    for arch in reported:
        cls = get_registered_model_class(arch)
        built[arch] = f"{cls.__module__}:{cls.__qualname__}"
    assert reported == built == adapter.report()["models"]
    assert built["MiniMaxM3SparseForConditionalGeneration"].endswith(":MiniMaxM3VLEagle3ForConditionalGeneration")


def test_a_plugin_architecture_served_by_a_builtin_class_is_registered(current_host):
    """A plugin adding an architecture and naming one of the built-in classes for it: the class is
    registered for that architecture too (it was skipped as "the built-in one")."""
    from m3_eagle_plugin.hooks import hookimpl
    from m3_eagle_plugin.host.trtllm import COMPONENTS
    from m3_eagle_plugin.registry import get_plugin_manager
    from tensorrt_llm._torch.models.modeling_utils import get_registered_model_class

    class Alias:
        @hookimpl
        def m3_eagle_model_classes(self, host):
            return {"MyM3AliasForCausalLM": COMPONENTS["model"]}

    pm = get_plugin_manager()
    pm.register(Alias(), name="test-alias-arch")
    try:
        adapter.install()
        cls = get_registered_model_class("MyM3AliasForCausalLM")
    finally:
        adapter.uninstall()
        pm.unregister(name="test-alias-arch")
    assert cls is not None and f"{cls.__module__}:{cls.__qualname__}" == COMPONENTS["model"]
