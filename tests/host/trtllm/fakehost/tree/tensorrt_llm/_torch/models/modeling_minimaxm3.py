"""Double of the pre-#18872 MiniMax-M3 model: no spec_metadata in the layers, DecoderModelForCausalLM base.

As the host at 016beb63: the constructor turns a VL config into its text config first, and
`load_weights` has no `skip_modules` (and no `**kwargs`) and calls its base with keywords.
Layer boundaries as there too: `setup_aliases` wires each layer's `next_layer_layernorm` (the next
layer's `input_layernorm`, the final `norm` for the last layer), and a wired layer returns
`next_layer_layernorm(ffn_out, residual)`, i.e. `(rmsnorm(ffn_out + residual), ffn_out + residual)`
(the host's RMSNorm with a residual); only layer 0 applies its own input norm."""
import copy
from types import SimpleNamespace
from typing import Dict, Optional

import torch
from torch import nn

from .modeling_utils import DecoderModel, DecoderModelForCausalLM, register_auto_model


def is_minimax_m3_vl_config(pretrained_config) -> bool:
    model_type = getattr(pretrained_config, "model_type", None)
    if model_type in ("minimax_m3_vl", "minimax_m3"):
        return model_type == "minimax_m3_vl"
    return any("ForConditionalGeneration" in a for a in getattr(pretrained_config, "architectures", None) or [])


def get_text_model_config(model_config):  # a deep copy, as the host's: its spec_config is a new object
    cfg = copy.deepcopy(model_config)
    text = cfg.pretrained_config.text_config
    cfg.pretrained_config = SimpleNamespace(**text) if isinstance(text, dict) else text
    return cfg


class RMSNorm(nn.Module):
    """As the host's `modules/rms_norm.py`: with a residual, returns (norm(h + r), h + r)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, residual=...):
        if isinstance(residual, torch.Tensor):
            hidden_states = hidden_states + residual
            residual = hidden_states
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        normed = self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
        return normed if residual is ... else (normed, residual)


class MiniMaxM3DecoderLayer(nn.Module):
    def __init__(self, model_config, layer_idx: int, aux_stream_dict=None):
        super().__init__()
        self.layer_idx = layer_idx
        hidden_size = model_config.pretrained_config.hidden_size
        self.input_layernorm = RMSNorm(hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)  # stands in for attention + FFN
        self.next_layer_layernorm = None  # wired by MiniMaxM3ForCausalLM.setup_aliases

    def forward(self, position_ids, hidden_states, attn_metadata, residual, **kwargs):
        if residual is None:  # layer-0 prologue; later layers got their input norm from the previous one
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        hidden_states = torch.tanh(self.proj(hidden_states))
        if self.next_layer_layernorm is None:
            return hidden_states, residual
        return self.next_layer_layernorm(hidden_states, residual)


class MiniMaxM3Model(DecoderModel):
    def __init__(self, model_config):
        super().__init__(model_config)
        cfg = model_config.pretrained_config
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MiniMaxM3DecoderLayer(model_config, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size)

    def forward(self, attn_metadata, input_ids=None, position_ids=None, inputs_embeds=None, **kwargs):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(position_ids, hidden, attn_metadata, residual)
        if self.layers[-1].next_layer_layernorm is None:  # the last layer applied it otherwise
            hidden, _ = self.norm(hidden, residual)
        return hidden


@register_auto_model("MiniMaxM3SparseForCausalLM")
class MiniMaxM3ForCausalLM(DecoderModelForCausalLM):
    def __init__(self, model_config):
        if is_minimax_m3_vl_config(model_config.pretrained_config):
            model_config = get_text_model_config(model_config)
        cfg = model_config.pretrained_config
        super().__init__(MiniMaxM3Model(model_config), config=model_config,
                         hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)

    def load_weights(self, weights: Dict, weight_mapper=None, params_map: Optional[Dict[str, str]] = None,
                     allow_partial_loading: bool = False) -> None:
        fused = dict(weights)
        for name in [n for n in fused if n.endswith("index_q_proj.weight")]:
            k_name = name.replace("index_q_proj", "index_k_proj")
            fused[name.replace("index_q_proj", "index_qk_proj")] = torch.cat(
                [fused.pop(name), fused.pop(k_name)])
        super().load_weights(weights=fused, weight_mapper=weight_mapper, params_map=params_map,
                             allow_partial_loading=allow_partial_loading)

    def setup_aliases(self) -> None:  # does not chain to super(), as in the real host
        layers = self.model.layers
        for i, layer in enumerate(layers):
            layer.next_layer_layernorm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
        self.m3_aliases_set_up = True


@register_auto_model("MiniMaxM3SparseForConditionalGeneration")
class MiniMaxM3VLForConditionalGeneration(MiniMaxM3ForCausalLM):
    pass
