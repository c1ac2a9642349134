"""The patch engine on the host double: all-or-nothing, revertible, idempotent, thread-safe."""
from __future__ import annotations

import functools
import sys
import threading
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.host.trtllm.contract import CONTRACT, HostSymbol, import_first, resolve_owner, symbol
from m3_eagle_plugin.host.trtllm.patches import builtin_patches
from m3_eagle_plugin.host.trtllm.patching import PATCH_MARK, HostPatchError, Patch, PatchEngine
from tests._threads import race


def snapshot() -> dict:
    """Identity of every patchable contract name as the host currently binds it."""
    taken = {}
    for sym in CONTRACT:
        if sym.kind in ("function", "method", "binding") and sym.source_checkable:
            _, owner = resolve_owner(sym)
            taken[sym.key] = vars(owner).get(sym.name)
    return taken


def _tagging(original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return ("tagged", original(*args, **kwargs))

    return wrapper


def test_apply_and_revert_restore_every_binding(host):
    before = snapshot()
    engine = PatchEngine()
    report = engine.apply(builtin_patches())
    after = snapshot()
    patched = {k for k in before if after[k] is not before[k]}
    rebound = {r.key for p in builtin_patches() for r in p.rebinds}
    assert patched == {p.target.key for p in builtin_patches()} | rebound
    assert all(getattr(after[k], PATCH_MARK) for k in patched)
    assert len(report["bindings"]) == len(patched)
    engine.revert()
    assert all(snapshot()[k] is before[k] for k in before)
    assert engine.report()["applied"] is False


def test_missing_symbol_leaves_the_host_untouched(host):
    before = snapshot()
    ghost = HostSymbol("ghost", ("tensorrt_llm._torch.speculative.interface",), "no_such_function",
                       "function", used_by="test")
    engine = PatchEngine()
    with pytest.raises(HostPatchError, match="no_such_function"):
        engine.apply([*builtin_patches(), Patch("ghost", ghost, _tagging)])
    assert all(snapshot()[k] is before[k] for k in before)
    assert "no_such_function" in engine.report()["error"]


def test_failure_midway_reverts_everything(host):
    before = snapshot()
    undone = []

    def step_ok():
        return lambda: undone.append("ok")

    def step_fails():
        raise RuntimeError("registration exploded")

    engine = PatchEngine()
    with pytest.raises(HostPatchError, match="registration exploded"):
        engine.apply(builtin_patches(), steps=[step_ok, step_fails])
    assert undone == ["ok"]
    assert all(snapshot()[k] is before[k] for k in before)
    assert not engine.applied


def test_a_target_module_failing_to_import_is_named_and_recorded(current_host, tmp_path, monkeypatch):
    """Another plugin's patch whose module exists but raises on import (a shared library that will not
    load): the raw OSError escaped apply() naming neither the patch nor the module, and report() said
    `error: None`. It is a HostPatchError naming both, recorded, with nothing patched."""
    (tmp_path / "m3_test_unloadable_host_module.py").write_text(
        'raise OSError("libnvinfer_plugin.so.10: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    unloadable = HostSymbol("unloadable", ("m3_test_unloadable_host_module",), "f", "function", used_by="test")
    before = snapshot()
    engine = PatchEngine()
    with pytest.raises(HostPatchError) as caught:
        engine.apply([*builtin_patches(), Patch("another-plugins-patch", unloadable, _tagging)])
    message = str(caught.value)
    for needle in ("another-plugins-patch", "m3_test_unloadable_host_module", "OSError", "libnvinfer_plugin"):
        assert needle in message
    assert engine.report()["error"] == message and engine.report()["applied"] is False
    assert all(snapshot()[k] is before[k] for k in before)


def test_signature_mismatch_is_refused(host):
    sym = symbol("separate_draft_kv_predicate")
    wrong = HostSymbol(sym.key, sym.modules, sym.attribute, sym.kind, ("config",), "test")
    with pytest.raises(HostPatchError, match="expected leading parameters"):
        PatchEngine().apply([Patch("wrong", wrong, _tagging)])


def test_rebind_of_a_different_object_is_refused(host):
    from tensorrt_llm._torch.pyexecutor import _util

    _util.should_use_separate_draft_kv_cache = lambda spec_config: True
    before = snapshot()
    with pytest.raises(HostPatchError, match="_util.should_use_separate_draft_kv_cache"):
        PatchEngine().apply(builtin_patches())
    assert all(snapshot()[k] is before[k] for k in before)


_KV_REBINDS = ("sparse_pkg_kv_manager_binding", "attention_pkg_kv_manager_binding", "util_kv_manager_binding")


@pytest.mark.parametrize("first_rebinds,second_target", [
    (_KV_REBINDS, "sparse_kv_manager_dispatch"),  # the very same symbol
    (_KV_REBINDS, "util_kv_manager_binding"),     # a re-export the first patch rebinds
    ((), "util_kv_manager_binding"),              # a re-export the first patch leaves alone
], ids=["same-symbol", "rebound-re-export", "other-re-export"])
def test_two_patches_of_one_host_function_are_refused_before_anything_is_bound(host, first_rebinds, second_target):
    """Two plugins (m3_eagle_host_patches) wrapping one host function: the second wrapper would
    replace the first where it is bound while the other names keep the first."""
    first = Patch("plugin-a", symbol("sparse_kv_manager_dispatch"), _tagging,
                  tuple(symbol(key) for key in first_rebinds))
    second = Patch("plugin-b", symbol(second_target), _tagging)
    before = snapshot()
    engine = PatchEngine()
    with pytest.raises(HostPatchError) as err:
        engine.apply([first, second])
    message = str(err.value)
    assert "'plugin-a'" in message and "'plugin-b'" in message
    assert symbol(second_target).attribute in message and "nothing was patched" in message
    assert all(snapshot()[k] is before[k] for k in before)
    assert not engine.applied and engine.report()["error"] == message
    engine.apply([first])  # either one alone is fine
    engine.revert()


def test_apply_is_idempotent_and_refuses_a_second_engine(host):
    engine = PatchEngine()
    first = engine.apply(builtin_patches())
    interface = __import__("tensorrt_llm._torch.speculative.interface", fromlist=["x"])
    wrapped = interface.should_use_separate_draft_kv_cache
    assert engine.apply(builtin_patches()) == first
    assert interface.should_use_separate_draft_kv_cache is wrapped
    assert getattr(wrapped.__wrapped__, PATCH_MARK, None) is None  # wrapped exactly once
    with pytest.raises(HostPatchError, match="already wrapped"):
        PatchEngine().apply(builtin_patches())
    with pytest.raises(HostPatchError, match="different patch set"):
        engine.apply(builtin_patches()[:1])
    engine.revert()


def test_inherited_method_is_deleted_again_on_revert(host):
    from m3_eagle_plugin.host.trtllm.contract import import_first

    module = import_first(symbol("m3_kv_manager").modules)
    cls = module.MiniMaxM3KVCacheManagerV2
    sym = HostSymbol("inherited", symbol("m3_kv_manager").modules,
                     "MiniMaxM3KVCacheManagerV2.copy_batch_block_offsets", "method", ("self",), "test")
    assert "copy_batch_block_offsets" not in vars(cls)
    engine = PatchEngine()
    engine.apply([Patch("inherited", sym, _tagging)])
    assert "copy_batch_block_offsets" in vars(cls)
    engine.revert()
    assert "copy_batch_block_offsets" not in vars(cls)


def test_revert_leaves_a_later_rebinding_alone(host):
    engine = PatchEngine()
    engine.apply(builtin_patches())
    from tensorrt_llm._torch.speculative import interface

    def someone_else(spec_config):
        return True

    interface.should_use_separate_draft_kv_cache = someone_else
    notes = engine.revert()["revert_notes"]
    assert interface.should_use_separate_draft_kv_cache is someone_else
    assert any("should_use_separate_draft_kv_cache" in n for n in notes)


def test_revert_under_a_later_wrapper_says_the_patch_still_runs_and_finishes_once_it_is_gone(current_host):
    """Another library wrapping the patched definer after us (functools.wraps) keeps our wrapper running
    inside theirs: revert may not report the host clean (it did, and M3 still got the plugin's manager,
    and a later apply blamed a "double activation"); it keeps the binding and a later revert restores it."""
    from types import SimpleNamespace

    from tensorrt_llm._torch.attention.backends.sparse import registry

    before = snapshot()
    m3 = SimpleNamespace(algorithm="minimax_m3")
    host_answer = registry.get_sparse_attn_kv_cache_manager(m3)
    engine = PatchEngine()
    engine.apply(builtin_patches())
    ours = registry.get_sparse_attn_kv_cache_manager

    @functools.wraps(ours)
    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    registry.get_sparse_attn_kv_cache_manager = theirs
    assert theirs(m3) is not host_answer  # our wrapper still answers through theirs
    with pytest.raises(HostPatchError, match="get_sparse_attn_kv_cache_manager is still patched"):
        engine.revert()
    assert len(engine.report()["still_patched"]) == 1
    with pytest.raises(HostPatchError, match="incomplete rollback"):
        engine.apply(builtin_patches())
    registry.get_sparse_attn_kv_cache_manager = ours  # the other library unwraps
    assert engine.revert()["still_patched"] == []
    assert all(snapshot()[k] is before[k] for k in before)
    assert registry.get_sparse_attn_kv_cache_manager(m3) is host_answer


def test_concurrent_apply_patches_once(current_host):
    engine = PatchEngine()
    patches = builtin_patches()
    _, errors = race(lambda: engine.apply(patches), 8)
    assert errors == []
    from tensorrt_llm._torch.speculative import interface

    assert getattr(interface.should_use_separate_draft_kv_cache.__wrapped__, PATCH_MARK, None) is None
    engine.revert()
    assert getattr(interface.should_use_separate_draft_kv_cache, PATCH_MARK, None) is None


# ---- rollback that meets a failure keeps going, and says what is still patched ----

def _undo_step(name: str, log: list[str], fail: dict[str, bool]):
    """A step whose undo appends `name` to `log`, or raises while `fail[name]` is set."""
    def step():
        def undo():
            if fail.get(name):
                raise RuntimeError(f"undo of {name} exploded")
            log.append(name)
        return undo

    step.__name__ = name
    return step


def _failing_step():
    raise RuntimeError("registration exploded")


def test_raising_undo_during_apply_rollback_still_restores_the_rest(current_host):
    before = snapshot()
    log: list[str] = []
    fail = {"flaky": True}
    engine = PatchEngine()
    steps = [_undo_step("first", log, fail), _undo_step("flaky", log, fail), _failing_step]
    with pytest.raises(HostPatchError) as info:
        engine.apply(builtin_patches(), steps=steps)
    assert all(snapshot()[k] is before[k] for k in before), "a raising undo left bindings patched"
    assert log == ["first"], "the rollback stopped at the raising undo"
    report = engine.report()
    for needle in ("registration exploded", "undo of flaky exploded", "'flaky' is still in effect"):
        assert needle in str(info.value) and needle in report["error"]
    assert report["applied"] is False and report["bindings"] == []
    assert len(report["still_patched"]) == 1 and "flaky" in report["still_patched"][0]
    with pytest.raises(HostPatchError, match=r"call revert\(\) first"):
        engine.apply(builtin_patches())
    with pytest.raises(HostPatchError, match="undo of flaky exploded"):
        engine.revert()  # still failing: kept for the next try
    fail["flaky"] = False
    assert engine.revert()["still_patched"] == [] and log == ["first", "flaky"]
    assert engine.apply(builtin_patches())["applied"] is True
    engine.revert()


def _frozen_host(monkeypatch):
    """A module holding a class whose attributes cannot be reassigned while `lock[0]` is set."""
    lock = [False]

    class Frozen(type):
        def __setattr__(cls, name, value):
            if lock[0]:
                raise AttributeError(f"{cls.__name__} is read-only")
            super().__setattr__(name, value)

    class Gen(metaclass=Frozen):
        def supported(self, q, k):
            return ("host", q, k)

    module = types.ModuleType("m3_test_frozen_host")
    module.Gen = Gen
    monkeypatch.setitem(sys.modules, module.__name__, module)
    sym = HostSymbol("gen_supported", (module.__name__,), "Gen.supported", "method", ("self", "q", "k"), "test")
    return Gen, Patch("frozen", sym, _tagging), lock


def test_revert_restores_every_binding_it_can_and_names_the_rest(current_host, monkeypatch):
    before = snapshot()
    gen, frozen_patch, lock = _frozen_host(monkeypatch)
    original = vars(gen)["supported"]
    log: list[str] = []
    fail = {"flaky": True}
    engine = PatchEngine()
    engine.apply([*builtin_patches(), frozen_patch], steps=[_undo_step("flaky", log, fail)])
    lock[0] = True
    with pytest.raises(HostPatchError) as info:
        engine.revert()
    assert all(snapshot()[k] is before[k] for k in before), "one failed restore stopped the others"
    report = engine.report()
    for needle in ("Gen.supported is still patched", "read-only", "undo of flaky exploded"):
        assert needle in str(info.value) and needle in report["error"]
    assert report["applied"] is False and len(report["bindings"]) == 1
    assert report["bindings"][0].startswith("frozen: ") and report["bindings"][0].endswith("Gen.supported")
    assert len(report["still_patched"]) == 2
    assert getattr(vars(gen)["supported"], PATCH_MARK) == "frozen"
    lock[0], fail["flaky"] = False, False
    report = engine.revert()
    assert vars(gen)["supported"] is original and log == ["flaky"]
    assert report["still_patched"] == [] and report["bindings"] == [] and report["error"] is None


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(undo_fails=st.lists(st.booleans(), min_size=0, max_size=4), step_fails=st.booleans())
def test_rollback_property_every_undo_runs_and_failures_are_named(current_host, undo_fails, step_fails):
    """Whatever undos raise: every binding is restored, every other undo runs, each failure is named."""
    before = snapshot()
    log: list[str] = []
    names = [f"s{i}" for i in range(len(undo_fails))]
    fail = dict(zip(names, undo_fails))
    engine = PatchEngine()
    steps = [_undo_step(n, log, fail) for n in names] + ([_failing_step] if step_fails else [])
    try:
        engine.apply(builtin_patches(), steps=steps)
        engine.revert()
    except HostPatchError as exc:
        message = str(exc)
    else:
        message = ""
    assert all(snapshot()[k] is before[k] for k in before)
    assert log == [n for n in reversed(names) if not fail[n]]
    failed = [n for n in names if fail[n]]
    assert [n for n in failed if f"undo of {n} exploded" in message] == failed
    assert len(engine.report()["still_patched"]) == len(failed)
    assert bool(message) == (step_fails or bool(failed))
    for n in failed:
        fail[n] = False
    engine.revert()
    assert engine.report()["still_patched"] == []


# ---- two engines: binding is atomic across engines ----

def test_two_engines_racing_bind_exactly_once(current_host):
    before = snapshot()
    planning, other_done = threading.Event(), threading.Event()
    patches = builtin_patches()
    last = patches[-1]

    def blocking_factory(original, make=last.factory):
        planning.set()
        assert other_done.wait(10), "the other engine never applied"
        return make(original)

    slow = [*patches[:-1], Patch(last.id, last.target, blocking_factory, last.rebinds)]
    slow_engine, fast_engine = PatchEngine(), PatchEngine()
    errors: list[Exception] = []

    def apply_slowly():
        try:
            slow_engine.apply(slow)
        except HostPatchError as exc:
            errors.append(exc)

    thread = threading.Thread(target=apply_slowly)
    thread.start()
    assert planning.wait(10)
    fast_engine.apply(builtin_patches())  # while the slow engine is between planning and binding
    other_done.set()
    thread.join(10)
    assert len(errors) == 1 and "already wrapped" in str(errors[0]) and "another engine" in str(errors[0])
    assert fast_engine.report()["applied"] is True
    assert slow_engine.report()["applied"] is False and slow_engine.report()["bindings"] == []
    from tensorrt_llm._torch.speculative import interface

    wrapped = interface.should_use_separate_draft_kv_cache
    assert getattr(wrapped, PATCH_MARK) and getattr(wrapped.__wrapped__, PATCH_MARK, None) is None
    slow_engine.revert()
    assert getattr(interface.should_use_separate_draft_kv_cache, PATCH_MARK) == getattr(wrapped, PATCH_MARK)
    fast_engine.revert()
    assert all(snapshot()[k] is before[k] for k in before)


# ---- a PEP 562 package re-export reads through to the definer ----

def test_a_lazy_package_re_export_needs_no_rebind(host):
    """Some hosts' `sparse/__init__.py` binds no `get_sparse_attn_kv_cache_manager`: a module
    `__getattr__` forwards the name to the definer on each access (`from . import utils;
    return getattr(utils, name)`). Patching the definer already covers that name; the engine must
    not refuse the host for a binding that does not exist, nor leave one behind after revert."""
    sparse_pkg = import_first(symbol("sparse_pkg_kv_manager_binding").modules)
    definer = import_first(symbol("sparse_kv_manager_dispatch").modules)
    name = "get_sparse_attn_kv_cache_manager"
    original = vars(sparse_pkg).pop(name)
    assert original is vars(definer)[name]

    def __getattr__(attr):
        if attr == name:
            return getattr(definer, attr)
        raise AttributeError(attr)

    sparse_pkg.__getattr__ = __getattr__
    engine = PatchEngine()
    engine.apply(builtin_patches())
    assert getattr(sparse_pkg.get_sparse_attn_kv_cache_manager, PATCH_MARK) == "route-sparse-kv-cache-manager"
    assert name not in vars(sparse_pkg)
    engine.revert()
    assert sparse_pkg.get_sparse_attn_kv_cache_manager is original and name not in vars(sparse_pkg)


def _lazy_sparse_package(serve):
    """The host's sparse package with its eager `get_sparse_attn_kv_cache_manager` binding replaced by a
    module `__getattr__` that answers `serve(definer, original)`."""
    sparse_pkg = import_first(symbol("sparse_pkg_kv_manager_binding").modules)
    definer = import_first(symbol("sparse_kv_manager_dispatch").modules)
    name = "get_sparse_attn_kv_cache_manager"
    original = vars(sparse_pkg).pop(name)

    def __getattr__(attr):
        if attr == name:
            return serve(definer, original)
        raise AttributeError(attr)

    sparse_pkg.__getattr__ = __getattr__
    return sparse_pkg, original


def test_a_lazy_package_that_serves_another_object_is_refused(host):
    """A module `__getattr__` needs no rebind only when it serves the very function being wrapped:
    one serving another object (a stale copy) is a binding that differs, and the host is refused whole."""
    sparse_pkg, original = _lazy_sparse_package(lambda definer, original: lambda *args, **kwargs: None)
    before = snapshot()
    engine = PatchEngine()
    with pytest.raises(HostPatchError, match="get_sparse_attn_kv_cache_manager is not the original"):
        engine.apply(builtin_patches())
    assert engine.report()["applied"] is False
    assert all(snapshot()[k] is before[k] for k in before)


def test_a_package_binding_the_name_itself_is_rebound_even_with_a_module_getattr(host):
    """A package with a module `__getattr__` that also binds the name eagerly holds its own copy:
    that binding is rebound (and restored), not skipped as a read-through."""
    sparse_pkg, original = _lazy_sparse_package(lambda definer, original: original)
    name = "get_sparse_attn_kv_cache_manager"
    setattr(sparse_pkg, name, original)  # the eager binding, next to the __getattr__
    engine = PatchEngine()
    engine.apply(builtin_patches())
    assert getattr(vars(sparse_pkg)[name], PATCH_MARK) == "route-sparse-kv-cache-manager"
    engine.revert()
    assert vars(sparse_pkg)[name] is original


# ---- mutation-testing gaps: engine contracts not pinned above ----

def test_a_retried_revert_still_undoes_newest_first(current_host):
    """Undos that failed are kept for the next revert(); that retry runs them newest first too,
    the reverse of the order the steps were applied in."""
    log: list[str] = []
    fail = {"older": True, "newer": True}
    engine = PatchEngine()
    engine.apply(builtin_patches(), steps=[_undo_step("older", log, fail), _undo_step("newer", log, fail)])
    with pytest.raises(HostPatchError):
        engine.revert()
    assert log == [] and len(engine.report()["still_patched"]) == 2
    fail.update(older=False, newer=False)
    engine.revert()
    assert log == ["newer", "older"]


def test_a_name_defined_on_the_class_while_planning_is_refused(host):
    """The plan saw an inherited method (revert would delete the wrapper again); if the class binds
    the name itself before binding (the same function object), reverting would delete that binding:
    the engine refuses, with nothing patched and the class's own binding left as it is."""
    from m3_eagle_plugin.host.trtllm.contract import import_first

    module = import_first(symbol("m3_kv_manager").modules)
    cls = module.MiniMaxM3KVCacheManagerV2
    name = "copy_batch_block_offsets"
    sym = HostSymbol("inherited", symbol("m3_kv_manager").modules,
                     f"MiniMaxM3KVCacheManagerV2.{name}", "method", ("self",), "test")
    assert name not in vars(cls)

    def defining_meanwhile(original):
        setattr(cls, name, original)  # someone binds it on the class while this engine plans
        return _tagging(original)

    engine = PatchEngine()
    try:
        with pytest.raises(HostPatchError, match="re-bound.*nothing was patched"):
            engine.apply([Patch("inherited", sym, defining_meanwhile)])
        assert getattr(vars(cls)[name], PATCH_MARK, None) is None and not engine.applied
    finally:
        if name in vars(cls):
            delattr(cls, name)


def test_the_same_patches_with_other_steps_are_refused(current_host):
    """Re-applying is a no-op only for the very same patch set *and* steps; other steps on top of an
    applied set are refused (they would silently not run)."""
    ran: list[str] = []

    def first():
        ran.append("first")
        return lambda: None

    def second():
        ran.append("second")
        return lambda: None

    engine = PatchEngine()
    engine.apply(builtin_patches(), steps=[first])
    assert engine.apply(builtin_patches(), steps=[first])["applied"] and ran == ["first"]
    with pytest.raises(HostPatchError, match="different patch set"):
        engine.apply(builtin_patches(), steps=[second])
    assert ran == ["first"]
    engine.revert()


def test_record_error_never_drops_an_applied_patch_set(current_host):
    """A preflight error recorded while a set is applied must not forget that set: the engine still
    reports it applied and a revert still restores the host."""
    before = snapshot()
    engine = PatchEngine()
    engine.apply(builtin_patches())
    engine.record_error("a later preflight failed")
    assert engine.applied and engine.report()["bindings"]
    engine.revert()
    assert all(snapshot()[k] is before[k] for k in before)


def test_an_interrupt_midway_still_rolls_back(current_host):
    """A KeyboardInterrupt (not an Exception) raised by a step mid-apply still reverts every binding
    and the earlier steps: the host is never left half patched."""
    before = snapshot()
    undone: list[str] = []

    def step_ok():
        return lambda: undone.append("ok")

    def interrupted():
        raise KeyboardInterrupt

    engine = PatchEngine()
    with pytest.raises((HostPatchError, KeyboardInterrupt)):
        engine.apply(builtin_patches(), steps=[step_ok, interrupted])
    assert undone == ["ok"] and not engine.applied
    assert all(snapshot()[k] is before[k] for k in before)


def test_a_rebind_naming_the_target_itself_binds_once(host):
    """A host layout where a re-export namespace is the definer itself (the package defines the
    function): the name is bound once, and reverting leaves no spurious "re-bound by someone else"."""
    target = symbol("sparse_kv_manager_dispatch")
    engine = PatchEngine()
    report = engine.apply([Patch("self-rebind", target, _tagging, (target,))])
    assert len(report["bindings"]) == 1
    reverted = engine.revert()
    assert reverted["revert_notes"] == []
    _, owner = resolve_owner(target)
    assert getattr(vars(owner)[target.name], PATCH_MARK, None) is None


def test_a_wrapper_without_functools_wraps_still_points_at_the_original(current_host):
    """A plugin factory that returns a plain function: the engine sets `__wrapped__` itself, so the
    original stays reachable (doctor, the config key, a later unwrap)."""
    target = symbol("separate_draft_kv_predicate")

    def bare(original):
        def wrapper(spec_config, *args, **kwargs):
            return original(spec_config, *args, **kwargs)
        return wrapper

    _, owner = resolve_owner(target)
    original = vars(owner)[target.name]
    engine = PatchEngine()
    engine.apply([Patch("bare", target, bare)])
    try:
        wrapped = vars(owner)[target.name]
        assert wrapped.__wrapped__ is original and getattr(wrapped, PATCH_MARK) == "bare"
    finally:
        engine.revert()
