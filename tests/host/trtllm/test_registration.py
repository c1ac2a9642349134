"""Model registration wins on lazy and eager zoos and is undone by uninstall()."""
from __future__ import annotations

import pytest

from m3_eagle_plugin.host import trtllm as adapter

ARCHS = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")


@pytest.mark.parametrize("lazy_zoo", [True, False], ids=["lazy-zoo", "eager-zoo"])
def test_plugin_classes_win_and_uninstall_restores(host, lazy_zoo):
    from tensorrt_llm._torch.models import modeling_utils

    modeling_utils.LAZY_ZOO = lazy_zoo
    builtin = {arch: modeling_utils.get_registered_model_class(arch) for arch in ARCHS}
    assert {c.__module__ for c in builtin.values()} == {"tensorrt_llm._torch.models.modeling_minimaxm3"}
    adapter.install()
    plugin = {arch: modeling_utils.get_registered_model_class(arch) for arch in ARCHS}
    assert plugin["MiniMaxM3SparseForCausalLM"].__name__ == "MiniMaxM3Eagle3ForCausalLM"
    assert plugin["MiniMaxM3SparseForConditionalGeneration"].__name__ == \
        "MiniMaxM3VLEagle3ForConditionalGeneration"
    # a built-in re-registration after the plugin (e.g. a late zoo import) must not clobber it
    # on a lazy zoo; on an eager zoo the host keeps the last registration, as upstream does
    modeling_utils.register_auto_model(ARCHS[0])(builtin[ARCHS[0]])
    expected = plugin[ARCHS[0]] if lazy_zoo else builtin[ARCHS[0]]
    assert modeling_utils.MODEL_CLASS_MAPPING[ARCHS[0]] is expected
    adapter.uninstall()
    assert {arch: modeling_utils.MODEL_CLASS_MAPPING.get(arch) for arch in ARCHS} == builtin


def test_registration_failure_leaves_no_trace(current_host, monkeypatch):
    from tensorrt_llm._torch.models import modeling_utils
    from tensorrt_llm._torch.speculative import interface

    from m3_eagle_plugin.host.trtllm import registration

    modeling_utils.get_registered_model_class(ARCHS[0])
    before = dict(modeling_utils.MODEL_CLASS_MAPPING)
    predicate = interface.should_use_separate_draft_kv_cache

    def broken():
        raise ImportError("model module exploded")

    monkeypatch.setattr(registration, "builtin_model_classes", broken)
    with pytest.raises(adapter.HostPatchError, match="model module exploded"):
        adapter.install()
    assert modeling_utils.MODEL_CLASS_MAPPING == before
    assert interface.should_use_separate_draft_kv_cache is predicate


def test_uninstall_leaves_no_lazy_zoo_record_behind(current_host):
    """The lazy zoo (#17281) records every registration per module and rebuilds the mapping from those
    records whenever a declaration of external providers arrives (#18284: a driver's
    `export_external_model_modules()`, received by its workers). An uninstalled plugin must not come
    back from them, e.g. in a process whose activation failed and was undone."""
    from tensorrt_llm._torch.models import modeling_utils

    adapter.install()
    plugin = {arch: modeling_utils.get_registered_model_class(arch) for arch in ARCHS}
    declared = modeling_utils.export_external_model_modules()
    assert declared == {arch: cls.__module__ for arch, cls in plugin.items()}
    adapter.uninstall()
    assert modeling_utils.export_external_model_modules() == {}
    modeling_utils.register_external_model_modules(declared)
    for arch, cls in plugin.items():
        assert modeling_utils.get_registered_model_class(arch) is not cls
        assert arch not in cls.__dict__.get("_registered_architectures", ())
