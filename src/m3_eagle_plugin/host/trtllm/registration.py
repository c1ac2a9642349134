"""Registers the plugin's MiniMax-M3 Eagle3 classes in the host's model registry, revertibly.

Lazy-zoo hosts (NVIDIA/TensorRT-LLM#17281) let an external `register_auto_model` always win;
eager-zoo hosts keep the last registration, and the host M3 module is already imported here
(the plugin class derives from it), so the plugin registers last. Either way the mapping is
checked afterwards and set explicitly if the host kept another class. The undo restores the
previous mapping entries.
"""
from __future__ import annotations

from typing import Callable, Mapping

from m3_eagle_plugin.host.trtllm.contract import resolve

TEXT_ARCHITECTURE = "MiniMaxM3SparseForCausalLM"
VL_ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"
_MISSING = object()


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

    def undo() -> None:
        for arch, old in previous.items():
            if old is _MISSING:
                mapping.pop(arch, None)
            else:
                mapping[arch] = old

    try:
        for arch, cls in classes.items():
            register_auto_model(arch)(cls)
            if mapping.get(arch) is not cls:
                mapping[arch] = cls
    except BaseException:
        undo()
        raise
    return undo
