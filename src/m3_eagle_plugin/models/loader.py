"""Load a MiniMax-M3 target checkpoint (safetensors) into `MiniMaxM3ForCausalLM`.

Accepted tensor layouts (detected from the names):
- production (`language_model.model.layers.{i}...`): unfused MLPs (`mlp.{gate,up,down}_proj`),
  MoE as `block_sparse_moe.{gate, e_score_correction_bias, experts.{e}.w1/w2/w3,
  shared_experts.*}` (w1 = gate, w3 = up, w2 = down), `self_attn.index_{q,k}_{proj,norm}`;
- text (`model.layers.{i}...`, what transformers' `MiniMaxM3VLForCausalLM.save_pretrained`
  writes): fused `gate_up_proj`, stacked `mlp.experts.{gate_up,down}_proj`, `self_attn.indexer.*`;
- transformers' in-memory VL names (`model.language_model.layers.{i}...`), fused like "text".
`mtp.*`, vision tower and projector weights are ignored. Everything is validated (names and
shapes) before any weight is read into the model, so a bad checkpoint loads nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from m3_eagle_plugin.models.config import M3Config
from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
from m3_eagle_plugin.models.rope import RotaryEmbedding
from m3_eagle_plugin.models.safetensors_source import (CheckpointError, SafetensorsSource, check_compute_dtype,
                                                       check_names, check_shape, check_sizes_stored,
                                                       check_weight_dtype)

_IGNORED = re.compile(r"(^|\.)mtp\.|^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|rotary_emb\.")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
_FP32_PARAMS = ("e_score_correction_bias",)


@dataclass(frozen=True)
class _Recipe:
    """How one model tensor is assembled from checkpoint tensors."""
    sources: tuple[str, ...]
    combine: str = "copy"  # "copy" | "cat0" (gate then up rows) | "experts_gate_up" | "experts_down"
    # | "repeat_heads": each block of `head_rows` rows repeated `repeat` times
    repeat: int = 1
    head_rows: int = 0


def detect_layout(names: set[str]) -> str:
    if any(n.startswith("language_model.") for n in names):
        return "production"
    if any(n.startswith("model.language_model.") for n in names):
        return "vl_internal"
    return "text"


def _fused_recipes(keys: list[str], prefix: str) -> dict[str, _Recipe]:
    return {k: _Recipe((k if k == "lm_head.weight" else prefix + k,)) for k in keys}


_ATTN_RENAME = {
    "self_attn.indexer.q_proj": "self_attn.index_q_proj",
    "self_attn.indexer.k_proj": "self_attn.index_k_proj",
    "self_attn.indexer.q_norm": "self_attn.index_q_norm",
    "self_attn.indexer.k_norm": "self_attn.index_k_norm",
}


def _production_recipes(keys: list[str], config: M3Config) -> dict[str, _Recipe]:
    base = "language_model.model."
    out: dict[str, _Recipe] = {}
    for key in keys:
        if key == "lm_head.weight":
            out[key] = _Recipe(("language_model.lm_head.weight",))
            continue
        m = re.match(r"layers\.(\d+)\.(.*)$", key)
        if m is None:
            out[key] = _Recipe((base + key,))
            continue
        layer = f"{base}layers.{m.group(1)}."
        rest = m.group(2)
        moe = "block_sparse_moe."
        if rest.startswith("mlp.experts."):
            n = config.num_experts
            if rest == "mlp.experts.gate_up_proj":
                srcs = tuple(f"{layer}{moe}experts.{e}.{w}.weight" for e in range(n) for w in ("w1", "w3"))
                out[key] = _Recipe(srcs, "experts_gate_up")
            else:
                out[key] = _Recipe(tuple(f"{layer}{moe}experts.{e}.w2.weight" for e in range(n)), "experts_down")
        elif rest == "mlp.gate.e_score_correction_bias":
            out[key] = _Recipe((f"{layer}{moe}e_score_correction_bias",))
        elif rest == "mlp.gate.weight":
            out[key] = _Recipe((f"{layer}{moe}gate.weight",))
        elif rest.startswith("mlp.shared_experts."):
            out.update(_mlp_recipe(key, rest[len("mlp.shared_experts."):], f"{layer}{moe}shared_experts."))
        elif rest.startswith("mlp."):
            out.update(_mlp_recipe(key, rest[len("mlp."):], f"{layer}mlp."))
        else:
            for new, old in _ATTN_RENAME.items():
                if rest.startswith(new + "."):
                    rest = old + rest[len(new):]
            out[key] = _Recipe((layer + rest,))
    return out


def _mlp_recipe(key: str, leaf: str, prefix: str) -> dict[str, _Recipe]:
    if leaf == "gate_up_proj.weight":
        return {key: _Recipe((prefix + "gate_proj.weight", prefix + "up_proj.weight"), "cat0")}
    return {key: _Recipe((prefix + leaf,))}


def _repeat_index_heads(recipes: dict[str, _Recipe], config: M3Config) -> dict[str, _Recipe]:
    """Fewer index heads than KV heads: each stored index_q head is repeated, one copy per KV head
    it selects for (`M3Config.index_head_repeat`), so every KV head gets its index head's selection."""
    if config.index_head_repeat == 1:
        return recipes
    return {k: replace(r, combine="repeat_heads", repeat=config.index_head_repeat, head_rows=config.index_dim)
            if k.endswith(".indexer.q_proj.weight") else r for k, r in recipes.items()}


def _source_shapes(recipe: _Recipe, want: tuple[int, ...]) -> list[tuple[int, ...]]:
    if recipe.combine == "copy":
        return [want]
    if recipe.combine == "repeat_heads":
        return [(want[0] // recipe.repeat,) + want[1:]]
    if recipe.combine == "cat0":
        return [(want[0] // 2,) + want[1:]] * 2
    if recipe.combine == "experts_gate_up":  # want [E, 2I, H]; sources w1/w3 [I, H] per expert
        return [(want[1] // 2, want[2])] * len(recipe.sources)
    return [(want[1], want[2])] * len(recipe.sources)  # experts_down: want [E, H, I]; w2 [H, I]


def _assemble(recipe: _Recipe, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    parts = [tensors[s] for s in recipe.sources]
    if recipe.combine == "copy":
        return parts[0]
    if recipe.combine == "cat0":
        return torch.cat(parts, dim=0)
    if recipe.combine == "experts_gate_up":
        return torch.stack([torch.cat(parts[i:i + 2], dim=0) for i in range(0, len(parts), 2)])
    if recipe.combine == "repeat_heads":
        return parts[0].unflatten(0, (-1, recipe.head_rows)).repeat_interleave(recipe.repeat, dim=0).flatten(0, 1)
    return torch.stack(parts)


def _with_aliases(recipe: _Recipe, names: set[str]) -> _Recipe:
    """Accept `block_sparse_moe.{gate,up,down}_proj` for a dense MLP: transformers 5.17 re-saves it so."""
    sources = []
    for src in recipe.sources:
        alias = re.sub(r"\.mlp\.(gate|up|down)_proj\.", r".block_sparse_moe.\1_proj.", src)
        sources.append(alias if src not in names and alias in names else src)
    return _Recipe(tuple(sources), recipe.combine)


def _holds_nothing(shape: tuple[int, ...]) -> bool:
    """A zero-element tensor carries no weight: transformers writes `[0, H]` / `[H, 0]` shared-expert
    tensors for `shared_intermediate_size: 0`, a shared expert this model leaves out altogether."""
    return 0 in shape


def _tie_embeddings(recipes: dict[str, _Recipe], names: set[str]) -> None:
    """Tied embeddings: whichever of the pair the checkpoint holds serves both. safetensors'
    `save_model` keeps only the first name of a shared pair, `lm_head.weight`, and transformers
    ties either way round."""
    embed, head = "embed_tokens.weight", "lm_head.weight"
    if recipes[head].sources[0] not in names:
        recipes[head] = recipes[embed]
    elif recipes[embed].sources[0] not in names:
        recipes[embed] = recipes[head]


def _check_counts(source: SafetensorsSource, config: M3Config) -> None:
    """More layers, or (per-expert tensors) more experts, than the checkpoint stores are refused first:
    the model's modules, even on the meta device, and the tensor names it expects grow with those
    counts, so a config.json asking for 10**6 layers or 10**9 experts filled memory before any name
    was compared. So is a size past every dimension the checkpoint stores, which no tensor can match:
    hidden_size 2**62 overflowed the model's sizes even on the meta device (torch's bare TypeError or
    RuntimeError, naming no field)."""
    names = [n for n in source.names() if not _IGNORED.search(n)]
    layers = {int(m.group(1)) for m in map(_LAYER_INDEX.search, names) if m}
    if config.num_layers > len(layers):
        raise CheckpointError(f"{config.source}: num_hidden_layers: {config.num_layers} layers, but {source.where} "
                              f"stores {len(layers)}")
    if detect_layout(set(names)) == "production" and any(config.moe_layers):
        experts = {int(m.group(1)) for m in map(_EXPERT_INDEX.search, names) if m}
        if config.num_experts > len(experts):
            raise CheckpointError(f"{config.source}: num_local_experts: {config.num_experts} experts per MoE layer, "
                                  f"but {source.where} stores {len(experts)}")
    sizes = {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
             "num_attention_heads x head_dim": config.num_heads * config.head_dim,
             "num_key_value_heads x head_dim": config.num_kv_heads * config.head_dim}
    if not all(config.moe_layers):
        sizes["dense_intermediate_size"] = config.dense_intermediate_size
    if any(config.moe_layers):
        sizes.update(intermediate_size=config.moe_intermediate_size, num_local_experts=config.num_experts,
                     shared_intermediate_size=config.shared_intermediate_size)
    if any(config.sparse_layers):
        sizes["index head dim"] = config.index_dim
    shapes = (shape for shape in map(source.shape, names) if not _holds_nothing(shape))
    check_sizes_stored(sizes, shapes, config.source, source.where)


def plan_target_load(source: SafetensorsSource, model: MiniMaxM3ForCausalLM) -> dict[str, _Recipe]:
    """Map every model tensor to its checkpoint tensors; raise on any name or shape mismatch."""
    names = source.names()
    layout = detect_layout(names)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    keys = sorted(expected)
    if layout == "production":
        recipes = _production_recipes(keys, model.config)
    else:
        recipes = _fused_recipes(keys, "model." if layout == "text" else "model.language_model.")
    recipes = _repeat_index_heads({k: _with_aliases(r, names) for k, r in recipes.items()}, model.config)
    if model.config.tie_word_embeddings:
        _tie_embeddings(recipes, names)
    needed = {s for r in recipes.values() for s in r.sources}
    missing = sorted(needed - names)
    unknown = sorted(n for n in names - needed if not _IGNORED.search(n) and not _holds_nothing(source.shape(n)))
    for src in sorted(needed & names):  # first: a quantized checkpoint's scale tensors would read as unknown
        check_weight_dtype(source.where, src, source.dtype(src))
    check_names(source.where, missing, unknown)
    for key, recipe in recipes.items():
        for src, want in zip(recipe.sources, _source_shapes(recipe, expected[key])):
            check_shape(source.where, src, source.shape(src), want)
    return recipes


def load_target(path: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> MiniMaxM3ForCausalLM:
    """Build `MiniMaxM3ForCausalLM` from a checkpoint directory (config.json + safetensors)."""
    if Path(path).is_file():  # each reader would take it as its own file: weights read as JSON, or the reverse
        raise CheckpointError(f"{path}: load_target takes the checkpoint directory (config.json and the "
                              "safetensors files), not one of its files")
    check_compute_dtype(dtype)
    config = M3Config.from_file(path)
    source = SafetensorsSource(path)
    _check_counts(source, config)
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(config)
    recipes = plan_target_load(source, model)
    tensors = source.get_many(sorted({s for r in recipes.values() for s in r.sources}))
    state = {}
    built: dict[tuple[_Recipe, torch.dtype], torch.Tensor] = {}  # tied embeddings share one recipe: one tensor
    for key, recipe in recipes.items():
        target_dtype = torch.float32 if key.endswith(_FP32_PARAMS) else dtype
        if (recipe, target_dtype) not in built:
            built[recipe, target_dtype] = _assemble(recipe, tensors).to(device=device, dtype=target_dtype)
        state[key] = built[recipe, target_dtype]
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta).to(device)
    return model.eval().requires_grad_(False)


__all__ = ["CheckpointError", "detect_layout", "load_target", "plan_target_load"]
