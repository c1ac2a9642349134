"""Plugin manager: hermetic registration, safe entry points, conflicts, tracing, resolve()."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pluggy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin import builtin, registry
from m3_eagle_plugin.hooks import DraftContext, hookimpl
from m3_eagle_plugin.registry import (
    PluginConflictError,
    PluginError,
    ResolveError,
    make_plugin_manager,
    resolve,
)

from ._fake_host import write_plugin_distribution


class Drafter:
    @hookimpl
    def m3_eagle_propose_drafts(self, context):
        return [[seq[-1]] * context.draft_len for seq in context.tokens]


class OtherModel:
    @hookimpl
    def m3_eagle_model_classes(self, host):
        return {"MiniMaxM3SparseForCausalLM": "other.pkg:M3"}


class ReadyRecorder:
    def __init__(self):
        self.seen = []

    @hookimpl
    def m3_eagle_host_ready(self, host, report):
        self.seen.append((host, report))


@pytest.fixture
def manager():
    pm = make_plugin_manager()  # hermetic: built-in only, no entry points
    yield pm
    for name, plugin in list(pm.list_name_plugin()):
        if name != registry.BUILTIN_NAME:
            pm.unregister(plugin)


def test_hermetic_factory_has_only_builtin(manager):
    assert [name for name, _ in manager.list_name_plugin()] == [registry.BUILTIN_NAME]
    assert manager.load_errors == []


def test_builtin_reference_components(manager):
    classes = manager.model_classes("reference")
    assert classes["MiniMaxM3SparseForCausalLM"] == "m3_eagle_plugin.models:MiniMaxM3ForCausalLM"
    assert manager.kv_cache_manager("reference", {"algorithm": "minimax_m3"}) == "m3_eagle_plugin.kv:PagedKVCache"
    assert manager.kv_cache_manager("reference", {"algorithm": "dsa"}) is None
    assert manager.kv_cache_manager("reference", None) is None
    assert manager.attention_metadata("reference") == "m3_eagle_plugin.msa:MsaDecodeMetadata"
    assert manager.model_classes("some-other-host") == {}


def test_builtin_reference_components_resolve(manager):
    """Every reference the builtin plugin registers names a class that exists: a dangling
    reference (a renamed or removed export) fails here rather than at activation."""
    references = [*manager.model_classes("reference").values(),
                  manager.kv_cache_manager("reference", {"algorithm": "minimax_m3"}),
                  manager.attention_metadata("reference")]
    for reference in references:
        obj = resolve(reference)
        module_name, _, attr = reference.partition(":")
        assert isinstance(obj, type) and obj is getattr(importlib.import_module(module_name), attr), reference


def test_builtin_trtllm_patches_come_from_the_adapter(manager):
    importlib.import_module("m3_eagle_plugin.host.trtllm.patches")  # must exist: a failure, not a skip
    ids = {p.id for p in manager.host_patches("tensorrt_llm")}
    assert {"route-sparse-kv-cache-manager", "route-msa-backend"} <= ids
    assert manager.host_patches("reference") == []


def test_drafter_plugin_overrides_the_eagle3_head(manager):
    ctx = DraftContext.build([7, 9], [[1, 2, 3], [4, 5]], 3)
    assert manager.propose_drafts(ctx) is None  # default: the Eagle3 head drafts
    manager.register(Drafter(), name="last-token")
    assert manager.propose_drafts(ctx) == [[3, 3, 3], [5, 5, 5]]


def test_drafter_with_wrong_shape_is_rejected(manager):
    class Bad:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            return [[1]]

    manager.register(Bad(), name="bad")
    with pytest.raises(PluginError, match=r"returned \[1\] tokens for 2 requests; expected a list of 2 token ids each"):
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))


@pytest.mark.parametrize("answer", [5, [None, None], [[1, 1], 7], "ab", ["ab", "cd"]])
def test_drafter_answer_that_is_not_a_list_of_id_lists_is_refused_naming_it(manager, answer):
    class Odd:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            return answer

    manager.register(Odd(), name="odd")
    with pytest.raises(PluginError, match="m3_eagle_propose_drafts returned .* expected a list of 2 token ids each"):
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))


def test_draft_context_validates():
    with pytest.raises(ValueError, match="request_ids"):
        DraftContext((1, 2), ((1,),), 1)
    with pytest.raises(ValueError, match="draft_len"):
        DraftContext((1,), ((1,),), -1)


@pytest.mark.parametrize("draft_len", ["3", 2.0, True, None])
def test_draft_context_refuses_a_non_integer_draft_len_by_name(draft_len):
    """Built directly (not through `build`), "3" failed comparing with 0: "'<' not supported between ..."."""
    with pytest.raises(TypeError, match="DraftContext: draft_len must be an int, got "):
        DraftContext((1,), ((1,),), draft_len)


@pytest.mark.parametrize("args,name", [
    (([1.0], [[1]], 2), "request id"), (([1], [[1, 2.5]], 2), "token id"), (([1], [[True]], 2), "token id"),
    (([1], [[1]], 1.5), "draft_len"), (([1], [["3"]], 2), "token id"),
])
def test_draft_context_build_refuses_non_integers_instead_of_truncating(args, name):
    """`build` took int(2.5) == 2: a host passing a float token id drafted from the wrong token."""
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        DraftContext.build(*args)
    assert DraftContext.build([torch.tensor(1)], [[torch.tensor(5)]], torch.tensor(2)) == DraftContext((1,), ((5,),), 2)


def test_model_class_conflict_is_detected(manager):
    class SameAsBuiltin:
        @hookimpl
        def m3_eagle_model_classes(self, host):
            return {"MiniMaxM3SparseForCausalLM": "m3_eagle_plugin.models:MiniMaxM3ForCausalLM"}

    manager.register(SameAsBuiltin(), name="same")
    manager.model_classes("reference")  # agreeing claims are fine
    manager.register(OtherModel(), name="other")
    with pytest.raises(PluginConflictError, match="MiniMaxM3SparseForCausalLM.*other"):
        manager.model_classes("reference")


def test_a_hookimpl_taking_a_subset_of_the_spec_arguments_is_called_as_pluggy_calls_it(manager):
    """pluggy accepts hookimpls that declare only some of the spec's arguments."""
    class NoHostArgument:
        @hookimpl
        def m3_eagle_model_classes(self):
            return {"MyArch": "pkg.mod:MyModel"}

    manager.register(NoHostArgument(), name="no-host")
    expected = {}
    for claims in manager.hook.m3_eagle_model_classes(host="reference"):  # pluggy's own call
        expected.update(claims)
    assert manager.model_classes("reference") == expected and "MyArch" in expected


def test_historic_host_ready_reaches_late_plugins(manager):
    early = ReadyRecorder()
    manager.register(early, name="early")
    manager.hook.m3_eagle_host_ready.call_historic(kwargs={"host": "tensorrt_llm", "report": {"ok": True}})
    late = ReadyRecorder()
    manager.register(late, name="late")
    assert early.seen == late.seen == [("tensorrt_llm", {"ok": True})]


def test_misspelled_hook_fails_check_pending(manager):
    class Typo:
        @hookimpl
        def m3_eagle_model_clases(self, host):
            return {}

    manager.register(Typo(), name="typo")
    with pytest.raises(pluggy.PluginValidationError):
        manager.check_pending()


class _FakeDist:
    def __init__(self, name, version="1.0"):
        self.name, self.version = name, version


class _FakeEntryPoint:
    def __init__(self, name, value, loader, dist=None):
        self.name, self.value, self._loader, self.dist = name, value, loader, dist

    def load(self):
        return self._loader()


def _raise():
    raise ImportError("No module named 'missing_dependency'")


def test_broken_entry_point_is_reported_not_fatal(manager, monkeypatch):
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    eps = [_FakeEntryPoint("broken", "broken_pkg:plugin", _raise), _FakeEntryPoint("drafter", "ok:Drafter", Drafter)]
    loaded = manager.load_entrypoints(entry_points=eps)
    assert loaded == ["drafter"]
    assert [e.name for e in manager.load_errors] == ["broken"]
    assert "missing_dependency" in str(manager.load_errors[0])


def test_an_entry_point_with_an_unknown_hook_is_a_load_error_not_a_broken_manager(manager, monkeypatch):
    """The README: a plugin that fails to load is reported, fatal only under `require`; the others
    (the built-in one included) keep working."""
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)

    class FromTheFuture:
        @hookimpl
        def m3_eagle_no_such_hook(self, host):
            return None

    future = FromTheFuture()
    eps = [_FakeEntryPoint("future", "future_pkg:plugin", lambda: future),
           _FakeEntryPoint("drafter", "ok:Drafter", Drafter)]
    assert manager.load_entrypoints(entry_points=eps) == ["drafter"]
    assert [e.name for e in manager.load_errors] == ["future"]
    assert "m3_eagle_no_such_hook" in str(manager.load_errors[0])
    assert not manager.is_registered(future)
    manager.check_pending()  # nothing unknown left behind
    with pytest.raises(PluginError, match="future"):
        manager.load_entrypoints(entry_points=eps[:1], strict=True)


def _hijacking_plugin():
    class Hijack:
        @hookimpl
        def m3_eagle_kv_cache_manager(self, host, sparse_config):
            return "hijack:Manager"

    return Hijack()


@pytest.mark.parametrize("how", ["invalid-hookimpl", "half-registered"])
def test_a_plugin_failing_validation_answers_no_hook(manager, monkeypatch, how):
    """A plugin with one valid and one invalid hookimpl: pluggy < 1.7 (the project allows >= 1.3)
    raises PluginValidationError with the hookimpls before the invalid one registered; the
    "half-registered" case makes today's pluggy do the same."""
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    probe = {"algorithm": "minimax_m3"}
    expected = make_plugin_manager().hook.m3_eagle_kv_cache_manager(host="tensorrt_llm", sparse_config=probe)
    plugin = _hijacking_plugin()
    if how == "invalid-hookimpl":
        def m3_eagle_model_classes(host, not_in_spec):
            return {}

        plugin.m3_eagle_model_classes = hookimpl(m3_eagle_model_classes)
    else:
        register = manager.register

        def half_register(plugin, name=None):
            register(plugin, name)
            raise pluggy.PluginValidationError(plugin, "hookimpl m3_eagle_model_classes(host, not_in_spec)")

        monkeypatch.setattr(manager, "register", half_register)
    assert manager.load_entrypoints(entry_points=[_FakeEntryPoint("hijack", "hijack:plugin", lambda: plugin)]) == []
    assert [e.name for e in manager.load_errors] == ["hijack"]
    assert manager.get_plugin("hijack") is None and not manager.is_registered(plugin)
    assert manager.hook.m3_eagle_kv_cache_manager(host="tensorrt_llm", sparse_config=probe) == expected


def test_broken_entry_point_is_fatal_when_strict(manager):
    with pytest.raises(PluginError, match="broken"):
        manager.load_entrypoints(entry_points=[_FakeEntryPoint("broken", "x:y", _raise)], strict=True)


def test_allow_list_env(manager, monkeypatch):
    monkeypatch.setenv(registry.LOAD_ENV, "")
    assert manager.load_entrypoints(entry_points=[_FakeEntryPoint("drafter", "ok:Drafter", Drafter)]) == []


def test_real_entry_point_group_from_a_fake_distribution(tmp_path, monkeypatch):
    """A dist-info on sys.path with a broken entry point: loaded through importlib.metadata."""
    site = tmp_path / "site"
    write_plugin_distribution(site, "good-m3-plugin", "good = good_m3_plugin\nbroken = no_such_module_xyz:plugin",
                              {"good_m3_plugin/__init__.py": """
        from m3_eagle_plugin.hooks import hookimpl

        @hookimpl
        def m3_eagle_attention_metadata(host):
            return "good_m3_plugin:Meta"
    """})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    pm = make_plugin_manager(autoload=True)
    assert pm.get_plugin("good") is not None
    assert pm.attention_metadata("reference") == "good_m3_plugin:Meta"  # registered last, called first
    assert any(e.name == "broken" and e.distribution == "good-m3-plugin" for e in pm.load_errors)
    assert pm.get_plugin("builtin") is builtin  # the built-in entry point is not registered twice
    rows = {row["name"]: row for row in pm.plugin_summary()}
    assert rows["good"]["distribution"] == "good-m3-plugin 1.0"
    assert rows["good"]["hooks"] == ["m3_eagle_attention_metadata"]


def test_singleton_and_reset(clean_state):
    first = registry.get_plugin_manager(autoload=False)
    assert registry.get_plugin_manager() is first
    registry.reset_plugin_manager()
    assert registry.get_plugin_manager(autoload=False) is not first


def test_trace_logs_hook_calls(monkeypatch):
    lines = []
    monkeypatch.setenv(registry.TRACE_ENV, "1")
    pm = make_plugin_manager()
    assert pm._undo_trace is not None  # M3_EAGLE_PLUGIN_TRACE=1 turned tracing on
    pm.disable_trace()
    pm.enable_trace(writer=lines.append)
    pm.attention_metadata("reference")
    assert any("m3_eagle_attention_metadata" in line and "builtin" in line for line in lines)
    assert any("MsaDecodeMetadata" in line for line in lines)
    pm.disable_trace()
    lines.clear()
    pm.attention_metadata("reference")
    assert lines == []


@pytest.mark.parametrize("value", ["2", "verbose"])
def test_a_bad_trace_value_warns_naming_it_and_leaves_tracing_off(monkeypatch, caplog, value):
    """README: `M3_EAGLE_PLUGIN_TRACE=1` traces; any other value meant "no trace" without a word."""
    import logging

    from m3_eagle_plugin.log import LOGGER_NAME, get_logger

    get_logger()  # configured (its own handler) before caplog's is added beside it
    monkeypatch.setenv(registry.TRACE_ENV, value)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        logger = logging.getLogger(LOGGER_NAME)
        logger.addHandler(caplog.handler)
        try:
            pm = make_plugin_manager()
        finally:
            logger.removeHandler(caplog.handler)
    assert pm._undo_trace is None
    assert [r.getMessage() for r in caplog.records if f"M3_EAGLE_PLUGIN_TRACE={value!r}" in r.getMessage()
            and "allowed values: 1 or 0" in r.getMessage()]
    monkeypatch.setenv(registry.TRACE_ENV, "off")  # a switch's "no": quiet, as before
    assert registry.trace_from_env() == (False, None)


def test_resolve():
    assert resolve("importlib.metadata:version") is importlib.metadata.version
    assert resolve("m3_eagle_plugin.registry:M3PluginManager.model_classes") is registry.M3PluginManager.model_classes
    with pytest.raises(ValueError, match="module:qualname"):
        resolve("no.colon")
    with pytest.raises(TypeError):
        resolve(42)
    with pytest.raises(ResolveError, match="cannot import module"):
        resolve("no_such_module_abc:x")
    with pytest.raises(ResolveError, match="no attribute path"):
        resolve("importlib.metadata:nope")


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=6), min_size=1, max_size=4),
       st.integers(0, 5))
def test_propose_drafts_property(tokens, draft_len):
    pm = make_plugin_manager()
    pm.register(Drafter(), name="last-token")
    ctx = DraftContext.build(range(len(tokens)), tokens, draft_len)
    drafts = pm.propose_drafts(ctx)
    assert drafts == [[seq[-1]] * draft_len for seq in tokens]


def test_every_hookspec_documents_an_example():
    from m3_eagle_plugin.hooks import M3EagleSpecs

    names = [n for n in vars(M3EagleSpecs) if n.startswith("m3_eagle_")]
    assert set(names) == {"m3_eagle_model_classes", "m3_eagle_kv_cache_manager", "m3_eagle_attention_metadata",
                          "m3_eagle_host_patches", "m3_eagle_propose_drafts", "m3_eagle_host_ready"}
    pm = make_plugin_manager()
    for name in names:
        assert "Example" in getattr(M3EagleSpecs, name).__doc__, name
    opts = {name: getattr(pm.hook, name).spec.opts for name in names}
    assert opts["m3_eagle_kv_cache_manager"]["firstresult"] and opts["m3_eagle_propose_drafts"]["firstresult"]
    assert opts["m3_eagle_attention_metadata"]["firstresult"] and opts["m3_eagle_host_ready"]["historic"]
    assert not opts["m3_eagle_model_classes"]["firstresult"] and not opts["m3_eagle_host_patches"]["firstresult"]


def test_allow_list_names_are_comma_separated_with_spaces_ignored(manager, monkeypatch):
    monkeypatch.setenv(registry.LOAD_ENV, " other , drafter ")
    eps = [_FakeEntryPoint("drafter", "ok:Drafter", Drafter), _FakeEntryPoint("model", "ok:OtherModel", OtherModel)]
    assert manager.load_entrypoints(entry_points=eps) == ["drafter"]


def test_drafter_answer_of_the_wrong_length_for_one_request_is_rejected(manager):
    class Short:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            return [[1, 2], [3]]

    manager.register(Short(), name="short")
    with pytest.raises(PluginError, match=r"returned \[2, 1\] tokens for 2 requests"):
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))


def test_a_drafter_answering_with_generators_gets_its_drafts_through(manager):
    """Rows read from a generator: they were counted, then zipped from the exhausted generator, so the
    host got no drafts at all and refused "drafts for 0 requests" though the drafter gave both."""

    class Lazy:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            return (iter(tokens[-2:]) for tokens in context.tokens)

    manager.register(Lazy(), name="lazy")
    assert manager.propose_drafts(DraftContext.build([1, 2], [[1, 2, 3], [4, 5, 6]], 2)) == [[2, 3], [5, 6]]


def _never_loaded():
    raise AssertionError("an entry point that is not loaded must not be imported")


def test_a_third_party_entry_point_named_builtin_is_a_load_error_naming_both(manager, monkeypatch, capsys):
    """A distribution declaring an entry point `builtin` (or any name already registered) was skipped
    without a word, under `require` too: it is a load error naming both plugins, logged, fatal when strict."""
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    ep = _FakeEntryPoint("builtin", "evil_pkg:plugin", _never_loaded, _FakeDist("evil-pkg", "2.0"))
    assert manager.load_entrypoints(entry_points=[ep]) == []
    assert manager.get_plugin("builtin") is builtin
    [error] = manager.load_errors
    assert error.name == "builtin" and error.distribution == "evil-pkg"
    text = str(error)
    assert "evil_pkg:plugin" in text and "evil-pkg" in text and "m3_eagle_plugin.builtin" in text, text
    assert text in capsys.readouterr().err  # one warning line naming both
    with pytest.raises(PluginError, match="evil-pkg"):
        manager.load_entrypoints(entry_points=[ep], strict=True)


def test_two_distributions_declaring_one_entry_point_name_are_named_both(manager, monkeypatch):
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    eps = [_FakeEntryPoint("drafter", "ok:Drafter", Drafter, _FakeDist("dist-a")),
           _FakeEntryPoint("drafter", "other:Drafter", _never_loaded, _FakeDist("dist-b"))]
    assert manager.load_entrypoints(entry_points=eps) == ["drafter"]
    [error] = manager.load_errors
    assert "other:Drafter" in str(error) and "dist-b" in str(error)
    assert "ok:Drafter" in str(error) and "dist-a" in str(error), str(error)


def test_the_projects_own_builtin_entry_point_and_a_second_load_are_quiet(manager, monkeypatch, capsys):
    """The package declares `builtin` itself (the manager registered it already): not a clash; loading
    the same entry points twice is not one either."""
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    eps = [_FakeEntryPoint("builtin", "m3_eagle_plugin.builtin", _never_loaded, _FakeDist("m3-eagle-plugin")),
           _FakeEntryPoint("drafter", "ok:Drafter", Drafter, _FakeDist("dist-a"))]
    assert manager.load_entrypoints(entry_points=eps) == ["drafter"]
    assert manager.load_entrypoints(entry_points=eps) == []
    assert manager.load_errors == [] and manager.skipped == []
    assert "builtin" not in capsys.readouterr().err


def test_an_allow_listed_plugin_that_is_not_installed_is_a_load_error_naming_it(manager, monkeypatch):
    """`M3_EAGLE_PLUGIN_LOAD=drafter,ghost` without a `ghost` entry point was ignored without a word;
    under `require` (which fails on load errors) a plugin asked for by name must be there."""
    monkeypatch.setenv(registry.LOAD_ENV, "drafter,ghost")
    eps = [_FakeEntryPoint("drafter", "ok:Drafter", Drafter)]
    assert manager.load_entrypoints(entry_points=eps) == ["drafter"]
    [error] = manager.load_errors
    assert error.name == "ghost" and "M3_EAGLE_PLUGIN_LOAD" in str(error) and "not installed" in str(error)
    with pytest.raises(PluginError, match="ghost"):
        make_plugin_manager().load_entrypoints(entry_points=eps, strict=True)


def test_entry_points_left_out_by_the_allow_list_are_logged_and_listed(manager, monkeypatch, capsys):
    monkeypatch.setenv(registry.LOAD_ENV, "")
    ep = _FakeEntryPoint("drafter", "ok:Drafter", _never_loaded, _FakeDist("dist-a"))
    assert manager.load_entrypoints(entry_points=[ep]) == []
    assert manager.load_errors == []
    [skip] = manager.skipped
    assert skip.name == "drafter" and skip.distribution == "dist-a" and "M3_EAGLE_PLUGIN_LOAD" in skip.reason
    line = str(skip)
    assert "'drafter'" in line and "ok:Drafter" in line and "dist-a" in line
    assert line in capsys.readouterr().err


def test_one_plugin_object_under_two_entry_points_is_registered_once_and_the_skip_logged(manager, monkeypatch,
                                                                                          capsys):
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    drafter = Drafter()
    eps = [_FakeEntryPoint("drafter", "ok:drafter", lambda: drafter, _FakeDist("dist-a")),
           _FakeEntryPoint("alias", "ok:drafter", lambda: drafter, _FakeDist("dist-a"))]
    assert manager.load_entrypoints(entry_points=eps) == ["drafter"]
    [skip] = manager.skipped
    assert skip.name == "alias" and "'drafter'" in skip.reason
    assert str(skip) in capsys.readouterr().err


def test_a_blocked_name_is_skipped_with_a_line_not_loaded(manager, monkeypatch, capsys):
    """`set_blocked` keeps a name out: its entry point is not imported, and the skip names it."""
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    manager.set_blocked("drafter")
    ep = _FakeEntryPoint("drafter", "ok:Drafter", _never_loaded, _FakeDist("dist-a"))
    try:
        assert manager.load_entrypoints(entry_points=[ep]) == []
    finally:  # the fixture unregisters every name it lists; a blocked one holds no plugin
        manager._name2plugin.pop("drafter", None)
    assert manager.load_errors == [] and manager.get_plugin("drafter") is None
    [skip] = manager.skipped
    assert skip.name == "drafter" and "blocked" in skip.reason
    assert str(skip) in capsys.readouterr().err


def test_an_entry_point_loaded_again_written_with_spaces_is_the_same_one(manager, monkeypatch):
    """"ok:Drafter" and "ok : Drafter" name one object: a second load of it is quiet, not a clash."""
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    assert manager.load_entrypoints(entry_points=[_FakeEntryPoint("drafter", "ok:Drafter", Drafter)]) == ["drafter"]
    again = _FakeEntryPoint("drafter", "ok : Drafter", _never_loaded)
    assert manager.load_entrypoints(entry_points=[again]) == []
    assert manager.load_errors == [] and manager.skipped == []


def test_an_allow_listed_name_registered_without_an_entry_point_is_not_missing(manager, monkeypatch):
    """The built-in plugin holds its name without any entry point being passed: asking for it by name
    is satisfied, not a 'not installed' load error."""
    monkeypatch.setenv(registry.LOAD_ENV, f"{registry.BUILTIN_NAME},drafter")
    eps = [_FakeEntryPoint("drafter", "ok:Drafter", Drafter)]
    assert manager.load_entrypoints(entry_points=eps) == ["drafter"]
    assert manager.load_errors == []


def test_a_not_installed_plugin_error_reads_without_an_empty_source(manager, monkeypatch):
    """No entry point, so no value or distribution to name: the line is "plugin 'ghost' failed to load: ..."."""
    monkeypatch.setenv(registry.LOAD_ENV, "ghost")
    manager.load_entrypoints(entry_points=[])
    [error] = manager.load_errors
    assert str(error).startswith("plugin 'ghost' failed to load: M3_EAGLE_PLUGIN_LOAD names it"), str(error)


def test_a_third_party_builtin_left_out_by_the_allow_list_is_a_skip_not_a_clash(manager, monkeypatch):
    """`M3_EAGLE_PLUGIN_LOAD=""` turns third-party plugins off: one named like the built-in is not loaded,
    so it clashes with nothing; it is listed as skipped."""
    monkeypatch.setenv(registry.LOAD_ENV, "")
    ep = _FakeEntryPoint("builtin", "evil_pkg:plugin", _never_loaded, _FakeDist("evil-pkg"))
    assert manager.load_entrypoints(entry_points=[ep]) == []
    assert manager.load_errors == []
    [skip] = manager.skipped
    assert skip.name == "builtin" and "M3_EAGLE_PLUGIN_LOAD" in skip.reason


def test_a_name_held_by_a_directly_registered_object_is_described_by_its_class(manager, monkeypatch):
    """A plugin registered in code (no entry point) is known by "module:Class": an entry point naming
    that class is the same plugin (quiet); another one is a clash naming it."""
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    manager.register(Drafter(), name="drafter")
    source = f"{Drafter.__module__}:Drafter"
    same = _FakeEntryPoint("drafter", source, _never_loaded)
    assert manager.load_entrypoints(entry_points=[same]) == []
    assert manager.load_errors == []
    other = _FakeEntryPoint("drafter", "other:Drafter", _never_loaded, _FakeDist("dist-b"))
    assert manager.load_entrypoints(entry_points=[other]) == []
    [error] = manager.load_errors
    assert f"plugin 'drafter' ({source})" in str(error) and "other:Drafter" in str(error), str(error)


@pytest.mark.parametrize("reference", ["importlib.metadata:", ":version", ""])
def test_resolve_refuses_an_empty_module_or_qualname(reference):
    with pytest.raises(ValueError, match="module:qualname"):
        resolve(reference)


def test_an_unknown_hook_marked_optional_loads_without_a_load_error(manager, monkeypatch):
    """pluggy's own check_pending() accepts `optionalhook=True` implementations of hooks no spec declares."""
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)

    class Optional:
        @hookimpl(optionalhook=True)
        def m3_eagle_no_such_hook(self, host):
            return None

    eps = [_FakeEntryPoint("optional", "opt_pkg:plugin", Optional)]
    assert manager.load_entrypoints(entry_points=eps) == ["optional"]
    assert manager.load_errors == []


def test_enabling_the_trace_twice_still_logs_each_hook_call_once(manager):
    lines = []
    manager.enable_trace(writer=lines.append)
    manager.enable_trace(writer=lines.append)
    manager.attention_metadata("reference")
    assert len(lines) == 2  # one line before the call, one with its result
    manager.disable_trace()
    manager.attention_metadata("reference")
    assert len(lines) == 2


def test_the_trace_names_a_hook_that_raised_and_the_caller_still_sees_it(manager):
    class Raises:
        @hookimpl
        def m3_eagle_attention_metadata(self, host):
            raise RuntimeError("boom")

    lines = []
    manager.register(Raises(), name="raises")
    manager.enable_trace(writer=lines.append)
    with pytest.raises(RuntimeError, match="boom"):
        manager.attention_metadata("reference")
    manager.disable_trace()
    assert lines[-1] == "hook m3_eagle_attention_metadata raised RuntimeError: boom"


def test_model_classes_are_merged_in_the_order_pluggy_calls_the_plugins(manager):
    class Extra:
        @hookimpl
        def m3_eagle_model_classes(self, host):
            return {"MyArch": "pkg.mod:MyModel"}

    manager.register(Extra(), name="extra")
    expected = {}
    for claims in manager.hook.m3_eagle_model_classes(host="reference"):  # pluggy's own call order
        expected.update(claims)
    assert list(manager.model_classes("reference").items()) == list(expected.items())
    assert next(iter(expected)) == "MyArch"  # the plugin registered last is called first


def test_the_trace_logs_the_model_classes_hook_as_it_logs_any_other(manager):
    """README: M3_EAGLE_PLUGIN_TRACE=1 logs every hook call with its result; m3_eagle_model_classes, the
    hook that picks the host's model class, was called past pluggy and never appeared in the trace."""
    lines = []
    manager.enable_trace(writer=lines.append)
    manager.hook.m3_eagle_model_classes(host="reference")  # pluggy's own call: what the trace shows of it
    expected, lines[:] = list(lines), []
    merged = manager.model_classes("reference")
    manager.disable_trace()
    assert expected and lines == expected, lines
    assert repr(merged) in lines[-1]  # the built-in plugin's one answer is the merge


def test_a_wrapper_of_the_model_classes_hook_runs_as_a_wrapper(manager):
    """A pluggy wrapper (an observer here) claims nothing; it was called as a plain implementation and
    its generator refused as "must return a dict", which failed the activation."""
    seen = []

    class Observer:
        @hookimpl(wrapper=True)
        def m3_eagle_model_classes(self, host):
            results = yield
            seen.append(host)
            return results

    expected = manager.model_classes("reference")
    manager.register(Observer(), name="observer")
    assert manager.model_classes("reference") == expected
    assert seen == ["reference"]


def test_a_plugin_implementing_the_patches_hook_twice_gives_each_answer_once(manager):
    """pluggy's `specname` lets one plugin implement a hook twice; the per-plugin walk called the plugin
    once per implementation, each call running both, so every patch was listed twice."""
    class Twice:
        @hookimpl
        def m3_eagle_host_patches(self, host):
            return ["patch-a"]

        @hookimpl(specname="m3_eagle_host_patches")
        def more_patches(self, host):
            return ["patch-b"]

    manager.register(Twice(), name="twice")
    expected = [patch for answer in manager.hook.m3_eagle_host_patches(host="reference") for patch in answer]
    assert sorted(expected) == ["patch-a", "patch-b"]  # pluggy's own call: each implementation once
    assert manager.host_patches("reference") == expected


@pytest.mark.parametrize("answer", ["route-msa-backend", SimpleNamespace(id="route-msa-backend")])
def test_host_patches_answered_by_other_than_a_list_are_refused_naming_the_plugin(manager, answer):
    """The hookspec asks for a list of patches: a string was split into one 'patch' a letter (the adapter then
    named the letter 'r'), a lone patch raised a TypeError naming neither the hook nor the plugin."""
    class Lone:
        @hookimpl
        def m3_eagle_host_patches(self, host):
            return answer

    manager.register(Lone(), name="lone")
    with pytest.raises(PluginError, match=r"^plugin 'lone': m3_eagle_host_patches must return a list of patches, "
                                          rf"got {type(answer).__name__} "):
        manager.host_patches("tensorrt_llm")


def test_a_model_classes_hook_answering_none_claims_nothing(manager):
    class Silent:
        @hookimpl
        def m3_eagle_model_classes(self, host):
            return None

    manager.register(Silent(), name="silent")
    model = "m3_eagle_plugin.models:MiniMaxM3ForCausalLM"  # the built-in reference model only
    assert manager.model_classes("reference") == {arch: model for arch in builtin.ARCHITECTURES}


def test_a_model_classes_hook_answering_no_dict_is_a_plugin_error_naming_it(manager):
    class Listy:
        @hookimpl
        def m3_eagle_model_classes(self, host):
            return ["MiniMaxM3SparseForCausalLM"]

    manager.register(Listy(), name="listy")
    with pytest.raises(PluginError, match="plugin 'listy': m3_eagle_model_classes must return a dict, got list"):
        manager.model_classes("reference")


@pytest.mark.parametrize("hook", ["m3_eagle_model_classes", "m3_eagle_host_patches"])
def test_a_collecting_hook_that_raises_is_a_plugin_error_naming_the_plugin(manager, hook):
    """A third-party hook raising reached the activation line as a bare "not activated (auto): RuntimeError:
    boom" (and the doctor's reason alike), naming neither the plugin nor the hook."""
    class Raises:
        @hookimpl(specname=hook)
        def answer(self, host):
            raise RuntimeError("boom")

    manager.register(Raises(), name="raiser")
    collect = manager.model_classes if hook == "m3_eagle_model_classes" else manager.host_patches
    with pytest.raises(PluginError, match=rf"^plugin 'raiser': {hook} raised RuntimeError: boom$") as raised:
        collect("tensorrt_llm")
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_drafts_for_fewer_requests_than_asked_are_rejected(manager):
    class OneRow:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            return [[1, 1]]  # the right length, but one request's drafts only

    manager.register(OneRow(), name="one-row")
    with pytest.raises(PluginError, match=r"returned \[2\] tokens for 2 requests"):
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))


def test_a_blocked_name_is_not_listed_as_a_plugin(manager):
    manager.set_blocked("drafter")
    try:
        assert [row["name"] for row in manager.plugin_summary()] == [registry.BUILTIN_NAME]
    finally:  # the fixture unregisters every name it lists; a blocked one holds no plugin
        manager._name2plugin.pop("drafter", None)


def _broken_distribution(site) -> None:
    """A dist-info on sys.path declaring one entry point whose module does not exist."""
    write_plugin_distribution(site, "broken-m3-plugin", "broken = no_such_module_xyz:plugin")


def test_a_strict_autoloading_factory_raises_on_a_broken_entry_point(tmp_path, monkeypatch):
    _broken_distribution(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv(registry.LOAD_ENV, raising=False)
    with pytest.raises(PluginError, match="broken"):
        make_plugin_manager(autoload=True, strict=True)


def test_the_singleton_without_autoload_loads_no_entry_point(clean_state, tmp_path, monkeypatch):
    _broken_distribution(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert registry.get_plugin_manager(autoload=False).load_errors == []
    registry.reset_plugin_manager()
    assert [e.name for e in registry.get_plugin_manager().load_errors] == ["broken"]


def test_builtin_claims_every_architecture_the_manifest_provides(manager):
    from m3_eagle_plugin.manifest import load_manifest

    provided = set(load_manifest().provides["architectures"])
    assert set(manager.model_classes("reference")) == provided


def test_builtin_reads_the_sparse_algorithm_case_insensitively(manager):
    from types import SimpleNamespace

    assert manager.kv_cache_manager("reference", {"algorithm": "MiniMax_M3"}) == "m3_eagle_plugin.kv:PagedKVCache"
    assert manager.kv_cache_manager("reference", SimpleNamespace(algorithm="MINIMAX_M3")) == \
        "m3_eagle_plugin.kv:PagedKVCache"


_HOST_IMPORTING_PLUGIN = textwrap.dedent("""
    import os
    import sys

    sys.path[:0] = sys.argv[1:3]  # the fake host, the plugin's site
    os.environ["M3_EAGLE_PLUGIN"] = "auto"
    from m3_eagle_plugin import _bootstrap, activation, registry

    _bootstrap.main()  # what the .pth line does at interpreter start
    report = activation.status()  # as `m3-eagle doctor` does: the manager is built here, before any host import
    assert report is activation.status() and registry.get_plugin_manager().get_plugin("extra") is not None
    print(report.activated, report.components["attention_metadata"], report.patches)
    print(report.plugin_errors)
""")


def test_a_plugin_whose_import_imports_the_host_is_loaded_and_the_host_activated(tmp_path):
    """A third-party plugin module that imports `tensorrt_llm` (to subclass a host class, say), in a process
    that asks for the manager before the host is imported: the host import activates, and activating asks
    for the manager still loading that plugin. That call waited forever on the manager's lock (a hang of
    `m3-eagle doctor`); activation now runs once the manager is built, with the plugin in it. A subprocess:
    the hang, and the bootstrap's hook, stay out of this interpreter."""
    import m3_eagle_plugin

    from ._fake_host import write_fake_host

    host = write_fake_host(tmp_path / "host", "1.3.0rc24", install_double=True)
    site = tmp_path / "site"
    write_plugin_distribution(site, "host-importing-m3-plugin",
                              "extra = host_importing_m3_plugin\nasks = manager_asking_m3_plugin", {
        "host_importing_m3_plugin/__init__.py": """
            import tensorrt_llm  # noqa: F401
            from m3_eagle_plugin.hooks import hookimpl

            @hookimpl
            def m3_eagle_attention_metadata(host):
                return "host_importing_m3_plugin:Meta"
        """,
        "manager_asking_m3_plugin.py": """
            from m3_eagle_plugin.registry import get_plugin_manager

            get_plugin_manager()
        """,
    })
    script = tmp_path / "run.py"
    script.write_text(_HOST_IMPORTING_PLUGIN)
    env = {**os.environ, "M3_EAGLE_PLUGIN": "off", "PYTHONPATH": str(Path(m3_eagle_plugin.__file__).parents[1])}
    env.pop("M3_EAGLE_PLUGIN_LOAD", None)
    try:
        out = subprocess.run([sys.executable, str(script), str(host), str(site)], env=env, capture_output=True,
                             text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("get_plugin_manager() deadlocked: the host import activated while the manager loaded plugins")
    assert out.returncode == 0, out.stderr[-3000:]
    activated, errors = out.stdout.splitlines()[:2]
    assert activated == "True host_importing_m3_plugin:Meta ['fake-patch']", out.stdout + out.stderr
    # a plugin that asks for the manager from its import (it waited forever too) fails to load, named
    assert "plugin 'asks'" in errors and "while it is loading its plugins" in errors, errors


def _failing_ids(message: str):
    yield 1
    raise TypeError(message)


def _failing_rows(message: str):
    yield [1, 1]
    raise TypeError(message)


@pytest.mark.parametrize("level", ["row", "answer"])
def test_a_drafter_answer_that_raises_while_read_is_a_plugin_error_naming_the_plugin(manager, level):
    """A TypeError raised inside a row's generator was read as "not rows of ids" and replaced by a shape
    error showing the outer generator's repr, the drafter's own error lost; one raised by the answer's
    generator itself escaped bare. Both levels: a PluginError naming the plugin and the drafter's error."""
    class Lazy:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            if level == "row":
                return (_failing_ids("row boom") if rid == 2 else iter([1, 1]) for rid in context.request_ids)
            return _failing_rows("answer boom")

    manager.register(Lazy(), name="lazy")
    with pytest.raises(PluginError, match=rf"^plugin 'lazy': m3_eagle_propose_drafts: reading its answer raised "
                                          rf"TypeError: {level} boom$") as raised:
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))
    assert isinstance(raised.value.__cause__, TypeError)


@pytest.mark.parametrize("answer", [[[1, 2], 7], [[1, 2], [3, 4.5]], [[1, 2]]])
def test_a_malformed_drafter_answer_names_the_plugin(manager, answer):
    """A non-iterable row, a non-int id, a missing row: each reported as the drafter plugin's answer."""
    class Odd:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            return answer

    manager.register(Odd(), name="odd")
    with pytest.raises(PluginError, match=r"^plugin 'odd': m3_eagle_propose_drafts returned "):
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))


def test_the_first_drafter_that_answers_is_named_and_the_rest_are_not_asked(manager):
    asked = []

    class Abstains:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            asked.append("abstains")

    class Bad:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            asked.append("bad")
            return [[1]]

    class Good:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            asked.append("good")
            return [[1, 1], [2, 2]]

    manager.register(Good(), name="good")
    manager.register(Bad(), name="bad")
    manager.register(Abstains(), name="abstains")  # registered last: asked first (pluggy's LIFO order)
    with pytest.raises(PluginError, match=r"^plugin 'bad': m3_eagle_propose_drafts returned \[1\] tokens"):
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))
    assert asked == ["abstains", "bad"]


class ClampingWrapper:
    """A new-style wrapper around the drafters: caps every draft id at 3."""

    @hookimpl(wrapper=True)
    def m3_eagle_propose_drafts(self, context):
        drafts = yield
        return None if drafts is None else [[min(t, 3) for t in row] for row in drafts]


class ReplacingHookwrapper:
    """An old-style hookwrapper around the drafters: replaces an answer with ones."""

    @hookimpl(hookwrapper=True)
    def m3_eagle_propose_drafts(self, context):
        outcome = yield
        if outcome.get_result() is not None:
            outcome.force_result([[1] * context.draft_len for _ in context.request_ids])


@pytest.mark.parametrize("wrapper, expected", [(ClampingWrapper, [[3, 3], [2, 2]]),
                                               (ReplacingHookwrapper, [[1, 1], [1, 1]])])
def test_a_wrapper_plugin_wraps_the_drafters_answer(manager, wrapper, expected):
    """Called plugin by plugin, the wrapper ran alone (seeing no answer) and the drafter's [[5, 5], [2, 2]]
    went out unwrapped; the hook's own call runs the wrapper around it."""
    manager.register(Drafter(), name="drafter")
    manager.register(wrapper(), name="wrapper")
    assert manager.propose_drafts(DraftContext.build([1, 2], [[4, 5], [2]], 2)) == expected


def test_a_wrapped_drafters_malformed_answer_or_error_names_the_plugins(manager):
    class Short:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            return [[1]]

    class Raises:
        @hookimpl
        def m3_eagle_propose_drafts(self, context):
            raise RuntimeError("boom")

    manager.register(ClampingWrapper(), name="wrapper")
    manager.register(Short(), name="short")
    with pytest.raises(PluginError, match=r"^plugins 'wrapper', 'short'.*: m3_eagle_propose_drafts returned \[1\] "):
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))
    manager.register(Raises(), name="raises")  # registered last: asked first
    with pytest.raises(PluginError, match=r"^plugins .*'raises'.*: m3_eagle_propose_drafts raised RuntimeError: boom$"):
        manager.propose_drafts(DraftContext.build([1, 2], [[1], [2]], 2))
