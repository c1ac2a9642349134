"""Registers the plugin's MiniMax-M3 Eagle3 classes in the host's model registry, revertibly.

Lazy-zoo hosts (NVIDIA/TensorRT-LLM#17281) let an external `register_auto_model` always win;
eager-zoo hosts keep the last registration, and the host M3 module is already imported here
(the plugin class derives from it), so the plugin registers last. Either way the mapping is
checked afterwards and set explicitly if the host kept another class. The undo restores the
previous mapping entries where the plugin's class still holds them (a class registered for the
architecture since, e.g. by a custom module, stays, as a patch target someone else re-bound) and,
on a lazy zoo, also removes what `register_auto_model` recorded besides the mapping (the
per-module `_MODULE_REGISTRATIONS` entries the host rebuilds its registries from when a #18284
declaration arrives, and the class's `_registered_architectures`).

Only the model-class slot is taken; the VL architecture's sibling slots are left alone, and
text-only serving with the plugin's VL class is unaffected by them:
- Vision encoder (`MODEL_CLASS_VISION_ENCODER_MAPPING`): the host's MiniMax-M3 VL class is not
  decorated with `register_vision_encoder`; it builds its `vision_tower` in its own `__init__`.
  So the slot stays empty (`get_registered_vision_encoder` returns None after importing the
  provider), and the plugin class, which does not derive from the host VL class, builds no tower.
  At the supported commits the host reads that mapping only in an `mm_encoder_only`
  (encoder-only, E/P-disaggregated) process, where it builds the encoder instead of any LLM class.
- Input processor: `register_input_processor` keys `INPUT_PROCESSOR_REGISTRY` by the host VL
  *class*, and `create_input_processor` looks it up with the class the registry resolves, i.e.
  the plugin's: no entry, so prompts get the `DefaultInputProcessor` (tokenization only, no
  image handling). The placeholder metadata it records under model type `minimax_m3_vl` only
  matters for requests that carry multimodal data, which the text-only class does not serve.
- KV profiling builds text-only dummy requests for the LLM (multimodal dummies only for a
  `MultimodalModelMixin` model), so no vision input reaches the plugin class.
"""
from __future__ import annotations

from typing import Callable, Mapping

from m3_eagle_plugin.host.trtllm.contract import resolve, resolve_owner, symbol

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
    # the records live beside the function in the module the contract names, whatever wraps it
    host_module, _ = resolve_owner(symbol("register_auto_model"))
    records = vars(host_module).get("_MODULE_REGISTRATIONS")
    chosen = dict(classes)
    ours = tuple(chosen.values())
    declared = {cls: set(cls.__dict__.get(_REGISTERED_ARCHS, ())) for cls in classes.values()}

    def undo() -> None:
        for arch, old in previous.items():
            if mapping.get(arch) is not chosen[arch]:
                continue  # re-registered by someone else since (as a re-bound patch target): left as is
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
        for arch, cls in chosen.items():
            register_auto_model(arch)(cls)
            if mapping.get(arch) is not cls:
                mapping[arch] = cls
    except BaseException:
        undo()
        raise
    return undo
