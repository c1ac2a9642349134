"""The patch engine on the host double: all-or-nothing, revertible, idempotent, thread-safe."""
from __future__ import annotations

import functools
import threading

import pytest

from m3_eagle_plugin.host.trtllm.contract import CONTRACT, HostSymbol, resolve_owner, symbol
from m3_eagle_plugin.host.trtllm.patches import builtin_patches
from m3_eagle_plugin.host.trtllm.patching import PATCH_MARK, HostPatchError, Patch, PatchEngine


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


def test_concurrent_apply_patches_once(current_host):
    engine = PatchEngine()
    patches = builtin_patches()
    errors = []

    def worker():
        try:
            engine.apply(patches)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    from tensorrt_llm._torch.speculative import interface

    assert getattr(interface.should_use_separate_draft_kv_cache.__wrapped__, PATCH_MARK, None) is None
    engine.revert()
    assert getattr(interface.should_use_separate_draft_kv_cache, PATCH_MARK, None) is None
