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


def register_auto_model(name: str):
    def decorator(cls):
        if not LAZY_ZOO or not is_builtin_zoo_module(cls.__module__) or name not in MODEL_CLASS_MAPPING:
            MODEL_CLASS_MAPPING[name] = cls
        return cls

    return decorator


def get_registered_model_class(model_arch: str) -> Optional[Type[nn.Module]]:
    if model_arch not in MODEL_CLASS_MAPPING and model_arch in MODEL_ARCH_TO_MODULE:
        importlib.import_module(f"{_ZOO_PACKAGE}.{MODEL_ARCH_TO_MODULE[model_arch]}")
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
