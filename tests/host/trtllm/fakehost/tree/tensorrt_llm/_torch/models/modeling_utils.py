"""Double of the model registry. `LAZY_ZOO` selects the registration rule: lazy-zoo hosts let
external modules overwrite and built-ins only fill empty slots; eager-zoo hosts keep the last."""
import importlib
from typing import Dict, Generic, Optional, Type, TypeVar

import torch
from torch import nn

from ._arch_index import MODEL_ARCH_TO_MODULE, _ZOO_PACKAGE, is_builtin_zoo_module

LAZY_ZOO = True
MODEL_CLASS_MAPPING: Dict[str, Type[nn.Module]] = {}

TModel = TypeVar("TModel")
TConfig = TypeVar("TConfig")


# Lazy zoo (#17281) as in the host: every registration is recorded per module, so a declaration of
# external providers (#18284, sent to MPI workers) can rebuild the mapping from the records.
_MODULE_REGISTRATIONS: Dict[str, list] = {}
_EXTERNAL_ARCH_TO_MODULE: Dict[str, str] = {}
_REGISTERED_ARCHS_ATTR = "_registered_architectures"


def _apply_arch_registration(arch: str, cls, module_name: str) -> None:
    existing = MODEL_CLASS_MAPPING.get(arch)
    if LAZY_ZOO and existing is not None and existing is not cls and is_builtin_zoo_module(module_name):
        return
    MODEL_CLASS_MAPPING[arch] = cls


def register_auto_model(name: str):
    def decorator(cls):
        if LAZY_ZOO:
            archs = cls.__dict__.get(_REGISTERED_ARCHS_ATTR)
            if archs is None:
                archs = set()
                setattr(cls, _REGISTERED_ARCHS_ATTR, archs)
            archs.add(name)
            _MODULE_REGISTRATIONS.setdefault(cls.__module__, []).append(("model class", name, cls))
        _apply_arch_registration(name, cls, cls.__module__)
        return cls

    return decorator


def export_external_model_modules() -> Dict[str, str]:
    external = {arch: cls.__module__ for arch, cls in MODEL_CLASS_MAPPING.items()
                if not is_builtin_zoo_module(cls.__module__)}
    for arch, module_name in _EXTERNAL_ARCH_TO_MODULE.items():
        external.setdefault(arch, module_name)
    return external


def _replay_provider(module_name: str, declared: Dict[str, str]) -> None:
    for _registry, arch, cls in _MODULE_REGISTRATIONS.get(module_name, ()):
        if declared.get(arch, module_name) == module_name:
            _apply_arch_registration(arch, cls, module_name)


def register_external_model_modules(arch_to_module: Dict[str, str]) -> None:
    declared = dict(arch_to_module)
    if declared == _EXTERNAL_ARCH_TO_MODULE:
        return
    _EXTERNAL_ARCH_TO_MODULE.clear()
    _EXTERNAL_ARCH_TO_MODULE.update(declared)
    MODEL_CLASS_MAPPING.clear()
    for module_name in list(_MODULE_REGISTRATIONS):
        if is_builtin_zoo_module(module_name):
            _replay_provider(module_name, declared)
    for module_name in dict.fromkeys(declared.values()):
        _replay_provider(module_name, declared)


def get_registered_model_class(model_arch: str) -> Optional[Type[nn.Module]]:
    if model_arch not in MODEL_CLASS_MAPPING:
        full_name = _EXTERNAL_ARCH_TO_MODULE.get(model_arch)
        if full_name is None and model_arch in MODEL_ARCH_TO_MODULE:
            full_name = f"{_ZOO_PACKAGE}.{MODEL_ARCH_TO_MODULE[model_arch]}"
        if full_name is not None:
            importlib.import_module(full_name)
    return MODEL_CLASS_MAPPING.get(model_arch)


class DecoderModel(nn.Module):
    def __init__(self, model_config):
        super().__init__()
        self.model_config = model_config


class DecoderModelForCausalLM(nn.Module, Generic[TModel, TConfig]):
    def __init__(self, model, *, config, hidden_size: int, vocab_size: int):
        super().__init__()
        self.model_config = config
        self.model = model
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.loaded = {}

    def setup_aliases(self) -> None:
        pass

    def forward(self, attn_metadata, input_ids=None, position_ids=None, inputs_embeds=None,
                return_context_logits=False, spec_metadata=None, lora_params=None, **kwargs):
        hidden = self.model(attn_metadata=attn_metadata, input_ids=input_ids,
                            position_ids=position_ids, inputs_embeds=inputs_embeds)
        return self.lm_head(hidden)

    def load_weights(self, weights, weight_mapper=None, skip_modules=[], params_map=None,
                     allow_partial_loading=False) -> None:
        self.skipped_modules = list(skip_modules)
        self.loaded.update({k: v for k, v in weights.items()
                            if not any(k.startswith(f"{m}.") for m in skip_modules)})
