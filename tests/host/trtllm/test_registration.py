"""Model registration wins on lazy and eager zoos and is undone by uninstall()."""
from __future__ import annotations

import functools

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


def _builtin_mapping():
    from tensorrt_llm._torch.models import modeling_utils

    return {arch: modeling_utils.get_registered_model_class(arch) for arch in ARCHS}


def test_a_host_that_keeps_its_first_registration_still_maps_the_plugin(current_host, monkeypatch):
    """A registry whose `register_auto_model` keeps whatever an architecture had: the mapping is
    checked after registering and set to the plugin's class; uninstall gives the built-ins back."""
    from tensorrt_llm._torch.models import modeling_utils

    builtin = _builtin_mapping()

    def keeps_first(name):
        def decorator(cls):
            modeling_utils.MODEL_CLASS_MAPPING.setdefault(name, cls)
            return cls
        return decorator

    monkeypatch.setattr(modeling_utils, "register_auto_model", keeps_first)
    adapter.install()
    assert modeling_utils.MODEL_CLASS_MAPPING[ARCHS[0]].__name__ == "MiniMaxM3Eagle3ForCausalLM"
    assert modeling_utils.MODEL_CLASS_MAPPING[ARCHS[1]].__name__ == "MiniMaxM3VLEagle3ForConditionalGeneration"
    adapter.uninstall()
    assert {arch: modeling_utils.MODEL_CLASS_MAPPING.get(arch) for arch in ARCHS} == builtin


def test_uninstall_unmaps_an_architecture_that_was_unmapped_before(current_host):
    from tensorrt_llm._torch.models import modeling_minimaxm3, modeling_utils  # noqa: F401 (registers)

    for arch in ARCHS:
        modeling_utils.MODEL_CLASS_MAPPING.pop(arch, None)
    adapter.install()
    assert all(arch in modeling_utils.MODEL_CLASS_MAPPING for arch in ARCHS)
    adapter.uninstall()
    assert not any(arch in modeling_utils.MODEL_CLASS_MAPPING for arch in ARCHS)


def test_a_registration_failing_halfway_is_undone(current_host, monkeypatch):
    """The registry refuses the second architecture: the first one's registration (mapping entry,
    lazy-zoo record, class mark) is undone too, and nothing else stays patched."""
    from tensorrt_llm._torch.models import modeling_utils
    from tensorrt_llm._torch.speculative import interface

    builtin = _builtin_mapping()
    predicate = interface.should_use_separate_draft_kv_cache
    register = modeling_utils.register_auto_model

    @functools.wraps(register)  # the host's function, in its own module (where its records live)
    def refuses_vl(name):
        if name == ARCHS[1]:
            raise RuntimeError("zoo refused the VL architecture")
        return register(name)

    monkeypatch.setattr(modeling_utils, "register_auto_model", refuses_vl)
    with pytest.raises(adapter.HostPatchError, match="zoo refused the VL architecture"):
        adapter.install()
    assert {arch: modeling_utils.MODEL_CLASS_MAPPING.get(arch) for arch in ARCHS} == builtin
    from m3_eagle_plugin.host.trtllm.model import MiniMaxM3Eagle3ForCausalLM

    assert not any(entry[2] is MiniMaxM3Eagle3ForCausalLM
                   for entries in modeling_utils._MODULE_REGISTRATIONS.values() for entry in entries)
    assert not MiniMaxM3Eagle3ForCausalLM.__dict__.get("_registered_architectures")
    assert interface.should_use_separate_draft_kv_cache is predicate


def test_uninstall_drops_the_lazy_zoo_records_under_a_wrapper_without_functools_wraps(current_host, monkeypatch):
    """Another plugin wrapping `register_auto_model` in its own module (no `functools.wraps`):
    the records still live in the host's module, and uninstall removes ours from there."""
    from tensorrt_llm._torch.models import modeling_utils

    register = modeling_utils.register_auto_model
    monkeypatch.setattr(modeling_utils, "register_auto_model", lambda name: register(name))
    adapter.install()
    from m3_eagle_plugin.host.trtllm.model import MiniMaxM3Eagle3ForCausalLM

    def ours_recorded() -> bool:
        return any(entry[2] is MiniMaxM3Eagle3ForCausalLM
                   for entries in modeling_utils._MODULE_REGISTRATIONS.values() for entry in entries)

    assert ours_recorded()
    adapter.uninstall()
    assert not ours_recorded()


@pytest.mark.parametrize("lazy_zoo", [True, False], ids=["lazy-zoo", "eager-zoo"])
def test_uninstall_keeps_a_class_registered_for_the_architecture_since(current_host, lazy_zoo):
    """A custom module registering its own class for an M3 architecture after the plugin (the host
    lets an external registration overwrite) keeps it through the plugin's uninstall, as a patch
    target someone else re-bound is left as is; the architecture the plugin still holds goes back
    to the built-in. The undo put the built-in back over the newcomer."""
    from tensorrt_llm._torch.models import modeling_utils

    modeling_utils.LAZY_ZOO = lazy_zoo
    builtin = _builtin_mapping()
    adapter.install()
    newcomer = type("CustomM3VL", (builtin[ARCHS[1]],), {"__module__": "custom_models.m3"})
    modeling_utils.register_auto_model(ARCHS[1])(newcomer)
    adapter.uninstall()
    assert modeling_utils.MODEL_CLASS_MAPPING[ARCHS[1]] is newcomer
    assert modeling_utils.MODEL_CLASS_MAPPING[ARCHS[0]] is builtin[ARCHS[0]]
    if lazy_zoo:
        assert modeling_utils.export_external_model_modules() == {ARCHS[1]: "custom_models.m3"}


def test_uninstall_leaves_no_empty_lazy_zoo_record_of_the_plugin_module(current_host):
    """`register_auto_model` created the plugin module's entry in `_MODULE_REGISTRATIONS`; once the
    plugin's records are dropped the entry itself goes too (the records are as before install)."""
    from tensorrt_llm._torch.models import modeling_utils

    from m3_eagle_plugin.host.trtllm.registration import builtin_model_classes

    adapter.install()
    modules = {cls.__module__ for cls in builtin_model_classes().values()}
    assert modules and all(m in modeling_utils._MODULE_REGISTRATIONS for m in modules)
    adapter.uninstall()
    assert not modules & set(modeling_utils._MODULE_REGISTRATIONS)
