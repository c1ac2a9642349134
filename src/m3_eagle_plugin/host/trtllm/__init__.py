"""TensorRT-LLM adapter: installs the MiniMax-M3 Eagle3 components into a running host.

`install()` applies the host patches (from the plugin registry: the built-in ones plus any other
plugin's) and registers the model classes, all or nothing; `uninstall()` reverts it; `report()`
says what is in place (for `m3-eagle doctor`). Activation calls `install()` in every process
that imports `tensorrt_llm`. This package imports neither torch nor tensorrt_llm at import time:
the components (`model`, `cache_manager`, `msa_backend`) import the host and are only loaded by
`install()` and by the patched host functions.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

from m3_eagle_plugin.host.trtllm.contract import CONTRACT, Finding, check_source_tree
from m3_eagle_plugin.host.trtllm.patching import HostPatchError, Patch, PatchEngine

HOST = "tensorrt_llm"

# "module:qualname" of each component, read by the plugin registry's built-in hooks.
COMPONENTS = {
    "model": "m3_eagle_plugin.host.trtllm.model:MiniMaxM3Eagle3ForCausalLM",
    "vl_model": "m3_eagle_plugin.host.trtllm.model:MiniMaxM3VLEagle3ForConditionalGeneration",
    "kv_cache_manager": "m3_eagle_plugin.host.trtllm.cache_manager:M3EagleKVCacheManagerV2",
    "attention_metadata": "m3_eagle_plugin.host.trtllm.msa_backend:M3EagleMsaMetadata",
}

__all__ = [
    "COMPONENTS", "CONTRACT", "Finding", "HostPatchError", "Patch", "check_source_tree",
    "install", "report", "uninstall",
]

_lock = threading.RLock()
_engine = PatchEngine()
_models: dict[str, str] = {}


def _host_patches() -> list[Patch]:
    try:
        from m3_eagle_plugin.registry import get_plugin_manager
    except ImportError:
        from m3_eagle_plugin.host.trtllm.patches import builtin_patches

        return builtin_patches()
    patches = get_plugin_manager().host_patches(HOST)
    for patch in patches:
        if not all(hasattr(patch, field) for field in ("id", "target", "factory", "rebinds")):
            raise HostPatchError(f"a plugin returned {patch!r} from m3_eagle_host_patches; "
                                 "expected m3_eagle_plugin.host.trtllm.Patch objects")
    return patches


def _model_classes() -> dict[str, type]:
    """Built-in classes per architecture plus those other plugins add (claiming a built-in one with
    another class is a conflict the registry raises)."""
    from m3_eagle_plugin.host.trtllm.registration import builtin_model_classes

    classes = builtin_model_classes()
    try:
        from m3_eagle_plugin.registry import get_plugin_manager, resolve
    except ImportError:
        return classes
    for arch, reference in get_plugin_manager().model_classes(HOST).items():
        builtin = classes.get(arch)
        if builtin is None or reference != f"{builtin.__module__}:{builtin.__qualname__}":
            classes[arch] = resolve(reference)
    return classes


def _register_models():
    from m3_eagle_plugin.host.trtllm.registration import register_model_classes

    classes = _model_classes()
    undo = register_model_classes(classes)
    _models.update({arch: f"{cls.__module__}:{cls.__qualname__}" for arch, cls in classes.items()})

    def undo_and_forget() -> None:
        undo()
        _models.clear()

    return undo_and_forget


def _preflight() -> None:
    """Resolve every contract symbol first, so a missing one is reported with all the others."""
    from m3_eagle_plugin.host.trtllm.contract import HostSymbolMissing, resolve_owner

    missing = []
    for sym in CONTRACT:
        try:
            resolve_owner(sym)
        except HostSymbolMissing as exc:
            missing.append(str(exc))
        except Exception as exc:  # a host module that exists but fails to import (a CUDA library, flashinfer)
            raise HostPatchError(f"importing the host failed while looking up {sym.attribute!r} ({sym.key}) in "
                                 f"{' | '.join(sym.modules)}: {type(exc).__name__}: {exc} (nothing was patched)"
                                 ) from exc
    if missing:
        raise HostPatchError("the installed host lacks symbols the adapter needs (nothing was patched): "
                             + "; ".join(missing))


def install(force: bool = False) -> dict:
    """Apply every host patch and register the model classes, all or nothing.

    Idempotent: a second call returns the current report. `force=True` reverts and re-applies.
    Raises `HostPatchError` naming the missing host symbol (or the failure) with nothing patched.
    """
    with _lock:
        if _engine.applied and not force:
            return report()
        if _engine.applied or (force and _engine.report().get("still_patched")):
            _engine.revert()
        try:
            _preflight()
            patches = _host_patches()
        except HostPatchError as exc:
            _engine.record_error(str(exc))
            raise
        except Exception as exc:
            error = HostPatchError(f"collecting host patches failed: {type(exc).__name__}: {exc}")
            _engine.record_error(str(error))
            raise error from exc
        from m3_eagle_plugin.host.trtllm.patches.forward_env_to_mpi_pool import forward_env_to_mpi_pool

        _engine.apply(patches, steps=[_register_models, forward_env_to_mpi_pool])
        return report()


def uninstall() -> dict:
    """Revert every patch and registration `install()` made (no-op when nothing is installed).

    The unified-draft-KV marks are the plugin's own state: they are cleared even when reverting fails
    (`HostPatchError` naming what stays patched, raised to the caller)."""
    from m3_eagle_plugin.host.trtllm.scope import clear_unified_marks

    with _lock:
        try:
            _engine.revert()
        finally:
            clear_unified_marks()
        return report()


def _layout() -> str | None:
    for name, layout in (("tensorrt_llm._torch.attention.backends", "attention/backends"),
                         ("tensorrt_llm._torch.attention_backend", "attention_backend")):
        if name in sys.modules:
            return layout
    return None


def report() -> dict[str, Any]:
    """What the adapter has in place in this process (plain data, JSON-serialisable)."""
    with _lock:
        engine = _engine.report()
        host = sys.modules.get(HOST)
        return {
            "host": HOST,
            "host_version": getattr(host, "__version__", None) if host else None,
            "layout": _layout(),
            "installed": engine["applied"],
            "patches": sorted(set(engine["patches"])),
            "steps": list(engine.get("steps", [])),  # model registration, MPI pool env forwarding
            "bindings": engine["bindings"],
            "models": dict(_models),
            "components": dict(COMPONENTS),
            "error": engine["error"],
            "revert_notes": engine["revert_notes"],
            "still_patched": engine.get("still_patched", []),
        }
