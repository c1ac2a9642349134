"""Eagle3 draft config parsing and checkpoint loading (public `LlamaForCausalLMEagle3` layout).

Tensor names: one decoder layer under `midlayer.*` or `layers.0.*` (an optional leading `model.`
is accepted), `fc`, optional `fc_norm.{0,1,2}`, `norm`, optional `embed_tokens` / `lm_head`,
optional `d2t` (draft id d -> target id d + d2t[d]) and `t2d` (a mask, unused). Config keys:
`eagle_config.eagle_aux_hidden_state_layer_ids` (ids in the "input of layer i" convention,
default (2, L//2, L-3)), `draft_vocab_size`, `target_hidden_size`, `norm_output`,
`norm_before_residual`. A missing embedding or lm_head is taken from the target (the lm_head
restricted to the draft vocabulary through `d2t` when that is smaller). Names and shapes are
all validated before anything is assigned.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from m3_eagle_plugin.eagle3.head import Eagle3Config, Eagle3Head
from m3_eagle_plugin.models.config import ConfigError
from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
from m3_eagle_plugin.models.rope import RotaryEmbedding
from m3_eagle_plugin.models.safetensors_source import CheckpointError, SafetensorsSource, check_names, check_shape

_IGNORED = re.compile(r"(^|\.)rotary_emb\.|^t2d$")
_OPTIONAL = ("embed_tokens.weight", "lm_head.weight", "d2t")


def _get(raw: Mapping[str, Any], key: str, default: Any = None) -> Any:
    eagle = raw.get("eagle_config") or {}
    if key in raw and raw[key] is not None:
        return raw[key]
    return eagle.get(key, default)


def parse_draft_config(raw: Mapping[str, Any], source: str, *, target_hidden_size: int,
                       target_vocab_size: int, default_aux_layer_ids: tuple[int, ...],
                       has_fc_norm: bool) -> Eagle3Config:
    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ConfigError(f"{source}: required field '{key}' is missing")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    declared_target = int(raw.get("target_hidden_size") or hidden)
    if hidden != target_hidden_size or declared_target != target_hidden_size:
        raise ConfigError(f"{source}: draft hidden_size {hidden} (target_hidden_size {declared_target}) does not "
                          f"match the target model's hidden size {target_hidden_size}")
    vocab = int(raw.get("vocab_size") or target_vocab_size)
    if vocab != target_vocab_size:
        raise ConfigError(f"{source}: draft vocab_size {vocab} != target vocab_size {target_vocab_size}")
    rope_params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"{source}: unsupported draft rope type {rope_type!r} (only 'default')")
    theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    aux = _get(raw, "eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids
    return Eagle3Config(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads), intermediate_size=int(need("intermediate_size")),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, vocab_size=vocab,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab), target_hidden_size=target_hidden_size,
        aux_layer_ids=tuple(int(i) for i in aux), norm_output=bool(_get(raw, "norm_output", False)),
        norm_before_residual=bool(_get(raw, "norm_before_residual", False)), has_fc_norm=has_fc_norm,
    )


def canonical_name(name: str) -> str:
    """`model.midlayer.x` / `midlayer.x` / `model.layers.0.x` -> `layers.0.x`."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return name


def load_draft(path: str | Path, target: MiniMaxM3ForCausalLM, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Eagle3Head:
    """Build an `Eagle3Head` for `target` from an Eagle3 checkpoint directory."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"no config.json at {config_path}")
    raw = json.loads(config_path.read_text())
    source = SafetensorsSource(path)
    by_canon: dict[str, str] = {}
    for name in source.names():
        canon = canonical_name(name)
        if canon in by_canon:
            raise CheckpointError(f"{source.where}: tensors {by_canon[canon]!r} and {name!r} name the same weight")
        by_canon[canon] = name
    has_fc_norm = any(c.startswith("fc_norm.") for c in by_canon)
    tc = target.config
    config = parse_draft_config(raw, str(config_path), target_hidden_size=tc.hidden_size,
                                target_vocab_size=tc.vocab_size, default_aux_layer_ids=tc.default_aux_layer_ids,
                                has_fc_norm=has_fc_norm)
    bad = [i for i in config.aux_layer_ids if not 0 <= i < tc.num_layers]
    if bad:
        raise ConfigError(f"{config_path}: aux layer ids {bad} out of range for a {tc.num_layers}-layer target")
    with torch.device("meta"):
        head = Eagle3Head(config)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    expected["d2t"] = (config.draft_vocab_size,)
    required = {k for k in expected if k not in _OPTIONAL}
    present = set(by_canon)
    missing = sorted(required - present)
    unknown = sorted(by_canon[c] for c in present - set(expected) if not _IGNORED.search(c))
    check_names(source.where, missing, unknown)
    for canon in present & set(expected):
        check_shape(source.where, by_canon[canon], source.shape(by_canon[canon]), expected[canon])
    shrunk_vocab = config.draft_vocab_size != config.vocab_size
    if shrunk_vocab and "d2t" not in present:
        raise CheckpointError(f"{source.where}: draft_vocab_size {config.draft_vocab_size} < vocab_size "
                              f"{config.vocab_size} but the checkpoint has no 'd2t' mapping")

    tensors = source.get_many([by_canon[c] for c in present & set(expected)])
    state = {c: tensors[by_canon[c]] for c in present & set(expected)}
    d2t = state.pop("d2t", None)
    if d2t is not None:
        d2t = d2t.to(device=device, dtype=torch.long)
        target_ids = torch.arange(d2t.shape[0], device=device) + d2t
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= config.vocab_size:
            raise CheckpointError(f"{source.where}: d2t maps draft ids outside the target vocabulary")
    shared = {}
    if "embed_tokens.weight" not in state:
        shared["embed_tokens"] = target.embed_tokens
    if "lm_head.weight" not in state:
        if shrunk_vocab:
            state["lm_head.weight"] = target.lm_head.weight.detach()[target_ids].clone()
        else:
            shared["lm_head"] = target.lm_head
    for name in shared:
        delattr(head, name)
        setattr(head, name, nn.Identity())  # placeholder so load_state_dict skips it
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    head.load_state_dict(state, strict=True, assign=True)
    for name, module in shared.items():
        setattr(head, name, module)
    head.d2t = d2t
    head.rotary = RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
    return head.eval().requires_grad_(False)


__all__ = ["CheckpointError", "canonical_name", "load_draft", "parse_draft_config"]
