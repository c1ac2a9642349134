"""Registers the plugin's MiniMax-M3 Eagle3 classes in the host's model registry, revertibly.

Lazy-zoo hosts (NVIDIA/TensorRT-LLM#17281) let an external `register_auto_model` always win;
eager-zoo hosts keep the last registration, and the host M3 module is already imported here
(the plugin class derives from it), so the plugin registers last. Either way the mapping is
checked afterwards and set explicitly if the host kept another class. The undo restores the
previous mapping entries and, on a lazy zoo, also removes what `register_auto_model` recorded
besides the mapping (the per-module `_MODULE_REGISTRATIONS` entries the host rebuilds its
registries from when a #18284 declaration arrives, and the class's `_registered_architectures`).
"""
from __future__ import annotations

import sys
from typing import Callable, Mapping

from m3_eagle_plugin.host.trtllm.contract import resolve

TEXT_ARCHITECTURE = "MiniMaxM3SparseForCausalLM"
VL_ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"
_MISSING = object()
_REGISTERED_ARCHS = "_registered_architectures"  # set by the lazy zoo's register_auto_model


def builtin_model_classes() -> dict[str, type]:
    from m3_eagle_plugin.host.trtllm.model import (
        MiniMaxM3Eagle3ForCausalLM,
        MiniMaxM3VLEagle3ForConditionalGeneration,
    )

    return {TEXT_ARCHITECTURE: MiniMaxM3Eagle3ForCausalLM,
            VL_ARCHITECTURE: MiniMaxM3VLEagle3ForConditionalGeneration}


def register_model_classes(classes: Mapping[str, type]) -> Callable[[], None]:
    """Register `classes` (architecture -> class); returns the undo."""
    register_auto_model = resolve("register_auto_model")
    mapping = resolve("model_class_mapping")
    previous = {arch: mapping.get(arch, _MISSING) for arch in classes}
    records = vars(sys.modules[register_auto_model.__module__]).get("_MODULE_REGISTRATIONS")
    ours = tuple(classes.values())
    declared = {cls: set(cls.__dict__.get(_REGISTERED_ARCHS, ())) for cls in classes.values()}

    def undo() -> None:
        for arch, old in previous.items():
            if old is _MISSING:
                mapping.pop(arch, None)
            else:
                mapping[arch] = old
        if isinstance(records, dict):  # entries are (registry, arch, value); drop only ours
            for name, entries in list(records.items()):
                entries[:] = [e for e in entries if not (isinstance(e, tuple) and len(e) == 3
                                                         and any(e[2] is cls for cls in ours))]
                if not entries:
                    del records[name]
        for cls, archs in declared.items():
            if isinstance(cls.__dict__.get(_REGISTERED_ARCHS), set):
                cls.__dict__[_REGISTERED_ARCHS].intersection_update(archs)

    try:
        for arch, cls in classes.items():
            register_auto_model(arch)(cls)
            if mapping.get(arch) is not cls:
                mapping[arch] = cls
    except BaseException:
        undo()
        raise
    return undo
