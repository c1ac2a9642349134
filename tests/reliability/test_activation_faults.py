"""`activate()` on a TensorRT-LLM double under faults: a missing host symbol (auto and require),
activation twice, activation racing in threads, and child processes started with spawn.

After each, every host symbol the adapter touches is either its original object (untouched) or
wrapped exactly once (fully patched), and the activation report says which and why. The double is
the adapter area's `tests/host/trtllm/fakehost`, loaded by path.
"""
from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests._threads import race

from ._counts import bump

_FAKEHOST = Path(__file__).resolve().parents[1] / "host" / "trtllm" / "fakehost" / "__init__.py"
PATCH_MARK = "__m3_eagle_patch__"


def _load_fakehost():
    assert _FAKEHOST.is_file(), f"the TensorRT-LLM double {_FAKEHOST} is missing"
    spec = importlib.util.spec_from_file_location("m3rel_trtllm_double", _FAKEHOST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _snapshot(contract) -> dict[str, object]:
    """The object bound at every patchable contract symbol (functions, methods, re-bindings)."""
    out = {}
    for sym in contract.CONTRACT:
        if sym.kind not in ("function", "method", "binding") or not sym.source_checkable:
            continue
        try:
            _, owner = contract.resolve_owner(sym)
        except contract.HostSymbolMissing:
            continue
        out[sym.key] = vars(owner).get(sym.name, getattr(owner, sym.name, None))
    return out


def _patched_keys(contract, before: dict[str, object]) -> tuple[set[str], set[str]]:
    """(keys wrapped exactly once around the original, keys changed in any other way)."""
    now = _snapshot(contract)
    wrapped, odd = set(), set()
    for key, original in before.items():
        current = now.get(key)
        if current is original:
            continue
        if getattr(current, PATCH_MARK, None) and getattr(current, "__wrapped__", None) is original:
            wrapped.add(key)
        else:
            odd.add(key)
    return wrapped, odd


def _patch_targets(contract) -> set[str]:
    return {s.key for s in contract.CONTRACT if s.used_by in contract.PATCH_IDS and s.kind != "attribute"}


@pytest.fixture
def trtllm(tmp_path, monkeypatch):
    fakehost = _load_fakehost()
    # imported here, not at module level: the double purges the adapter's modules between tests.
    # A missing module or install() is an ImportError/AttributeError: a failure, never a skip.
    activation = importlib.import_module("m3_eagle_plugin.activation")
    adapter = importlib.import_module("m3_eagle_plugin.host.trtllm")
    contract = importlib.import_module("m3_eagle_plugin.host.trtllm.contract")
    assert callable(adapter.install), "the adapter has no install()"
    root = fakehost.build_fake_host(tmp_path / "host", fakehost.CURRENT)
    monkeypatch.setenv("M3_EAGLE_PLUGIN", "off")  # activate(mode=...) exports the mode; restored at teardown
    monkeypatch.delenv("M3_EAGLE_PLUGIN_FORCE", raising=False)
    adapter.uninstall()
    fakehost.purge_host_modules()
    activation._reset_for_tests()
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    import tensorrt_llm

    before = _snapshot(contract)
    yield SimpleNamespace(root=root, activation=activation, adapter=adapter, contract=contract,
                          host=tensorrt_llm, before=before)
    adapter.uninstall()
    activation._reset_for_tests()
    fakehost.purge_host_modules()
    sys.path.remove(str(root))


def _assert_fully_patched(env) -> None:
    wrapped, odd = _patched_keys(env.contract, env.before)
    assert not odd, f"symbols changed without a single clean wrapper: {sorted(odd)}"
    missing = _patch_targets(env.contract) - wrapped
    assert not missing, f"activated, yet these patch targets are not wrapped: {sorted(missing)}"


def _assert_untouched(env) -> None:
    wrapped, odd = _patched_keys(env.contract, env.before)
    assert not wrapped and not odd, f"host left partly patched: {sorted(wrapped | odd)}"


def test_require_activates_fully_and_twice_is_the_same(trtllm):
    first = trtllm.activation.activate("require")
    assert first["activated"] and first["ok"]
    _assert_fully_patched(trtllm)
    again = trtllm.activation.activate("require")
    assert again is first or dict(again) == dict(first)
    _assert_fully_patched(trtllm)  # never a wrapper of a wrapper
    assert trtllm.activation.status()["activated"]


def _drop_symbol(contract) -> str:
    sym = contract.symbol("m3_backend_resolver")
    module = contract.import_first(sym.modules)
    delattr(module, sym.name)
    return sym.name


def test_auto_with_a_missing_symbol_leaves_the_host_untouched_and_says_why(trtllm):
    name = _drop_symbol(trtllm.contract)
    trtllm.before = _snapshot(trtllm.contract)
    bump("faults.injected")
    report = trtllm.activation.activate("auto")
    assert report["activated"] is False and report["ok"] is False
    assert name in report["reason"], report["reason"]
    _assert_untouched(trtllm)
    assert trtllm.adapter.report()["installed"] is False


def test_require_with_a_missing_symbol_raises_naming_it(trtllm):
    name = _drop_symbol(trtllm.contract)
    trtllm.before = _snapshot(trtllm.contract)
    bump("faults.injected")
    with pytest.raises(trtllm.activation.ActivationError, match=name):
        trtllm.activation.activate("require")
    _assert_untouched(trtllm)


def test_model_registration_failing_after_the_patches_reverts_them(trtllm, monkeypatch):
    """The last install step (model registration) raises: the patches applied before it are undone."""
    registration = importlib.import_module("m3_eagle_plugin.host.trtllm.registration")

    def explode(classes):
        raise RuntimeError("registry is read-only")

    monkeypatch.setattr(registration, "register_model_classes", explode)
    bump("faults.injected")
    report = trtllm.activation.activate("auto")
    assert report["activated"] is False and "registry is read-only" in report["reason"], report["reason"]
    _assert_untouched(trtllm)


def test_activation_racing_in_threads_patches_once(trtllm):
    reports, errors = race(lambda: trtllm.activation.activate("require"), 6)
    bump("faults.injected", 6)
    assert not errors, errors
    assert all(r is reports[0] for r in reports), "racing activations produced different reports"
    _assert_fully_patched(trtllm)


# ---- child processes started with spawn decide for themselves, from the environment ----

def _child(root: str, queue) -> None:
    """A fresh interpreter: first the host lacks a symbol (auto must leave it untouched), then the
    symbol is back and activation is retried (it must patch everything)."""
    import os

    sys.path.insert(0, root)
    os.environ["M3_EAGLE_PLUGIN"] = "auto"
    from m3_eagle_plugin import activation
    from m3_eagle_plugin.host.trtllm import contract

    import tensorrt_llm  # noqa: F401 - the host import that triggers activation in a real process

    # Where the package is installed, its .pth bootstrap already ran in this fresh interpreter and
    # activated on the host import above (the mode came from the parent's environment): that must
    # be all or nothing. Undo it so the faults below start from a pristine host.
    at_import = {k for k, v in _snapshot(contract).items() if getattr(v, PATCH_MARK, None)}
    if at_import:
        from m3_eagle_plugin.host import trtllm as adapter

        adapter.uninstall()
        activation._reset_for_tests()
    pristine = _snapshot(contract)
    states = []
    sym = contract.symbol("m3_backend_resolver")
    module = contract.import_first(sym.modules)
    resolver = getattr(module, sym.name)
    for drop in (True, False):
        if drop:
            delattr(module, sym.name)
        else:
            setattr(module, sym.name, resolver)
            activation._reset_for_tests()
        before = _snapshot(contract)
        report = dict(activation.activate())
        wrapped, odd = _patched_keys(contract, before)
        states.append({"report": {k: report.get(k) for k in ("activated", "ok", "reason", "mode")},
                       "wrapped": sorted(wrapped), "odd": sorted(odd)})
    queue.put({"pristine_is_unwrapped": not any(getattr(v, PATCH_MARK, None) for v in pristine.values()),
               "wrapped_at_import": sorted(at_import),
               "states": states, "targets": sorted(_patch_targets(contract))})


def test_spawned_child_decides_for_itself(trtllm):
    trtllm.activation.activate("require")  # the parent is patched; the child must not inherit that
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(str(trtllm.root), queue))
    child.start()
    state = queue.get(timeout=120)
    child.join(timeout=60)
    bump("faults.injected")
    assert child.exitcode == 0
    assert state["pristine_is_unwrapped"], "the child's host could not be brought back to pristine"
    at_import = set(state["wrapped_at_import"])
    assert not at_import or at_import >= set(state["targets"]), f"half-patched at the host import: {at_import}"
    missing, restored = state["states"]
    assert not missing["odd"] and not restored["odd"], state
    assert missing["report"]["activated"] is False and missing["wrapped"] == []
    assert "_resolve_minimax_m3_backend_cls" in missing["report"]["reason"], missing["report"]
    assert restored["report"]["activated"] is True and set(restored["wrapped"]) >= set(state["targets"]), restored
    _assert_fully_patched(trtllm)
