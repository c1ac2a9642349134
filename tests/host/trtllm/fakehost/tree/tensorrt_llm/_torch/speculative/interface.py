from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import Optional

import torch


class SpeculativeDecodingMode(IntEnum):
    MTP = auto()
    EAGLE3 = auto()
    EAGLE3_ONE_MODEL = auto()
    NONE = auto()

    def use_one_engine(self):
        return self in (SpeculativeDecodingMode.EAGLE3_ONE_MODEL, SpeculativeDecodingMode.MTP)

    def is_eagle3_one_model(self):
        return self == SpeculativeDecodingMode.EAGLE3_ONE_MODEL


def should_use_separate_draft_kv_cache(spec_config) -> bool:
    if spec_config is None:
        return False
    if not spec_config.spec_dec_mode.use_one_engine():
        return False
    return spec_config._allow_separate_draft_kv_cache


@dataclass
class SpecMetadata:
    max_num_requests: int = 1
    max_draft_len: int = 0
    layers_to_capture: tuple = ()
    captured: dict = field(default_factory=dict)

    def prepare(self):
        self.captured.clear()

    def is_layer_capture(self, layer_id: int):
        return layer_id in self.layers_to_capture

    def maybe_capture_hidden_states(self, layer_id: int, hidden_states: torch.Tensor,
                                    residual: Optional[torch.Tensor] = None) -> None:
        value = hidden_states if residual is None else hidden_states + residual
        self.captured[layer_id] = value.detach().clone()
