"""The MiniMax-M3 text-backbone configuration, read from either public checkpoint layout.

Two `config.json` shapes exist for the same model:
(a) production (`MiniMaxM3SparseForConditionalGeneration`, model_type `minimax_m3_vl`): the text
    fields sit under `text_config`, the sparse layers come from `sparse_attention_config`
    (`sparse_*` keys, `sparse_attention_freq`) and the MoE layers from `moe_layer_freq`; RoPE is
    given as flat `rope_theta` / `partial_rotary_factor` / `rotary_dim`;
(b) the text-only layout transformers writes (`MiniMaxM3VLForCausalLM`, model_type
    `minimax_m3_vl_text`): `layer_types`, `mlp_layer_types`, `index_*` and `rope_parameters`.
Both parse into one flat, validated `M3Config` so nothing downstream knows the layout.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SPARSE_LAYER = "minimax_m3_sparse"
DENSE_LAYER = "full_attention"


class ConfigError(ValueError):
    """A checkpoint config is missing a field or holds a value the model cannot run."""


@dataclass(frozen=True)
class M3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    sparse_layers: tuple[bool, ...]  # per layer: MSA block-sparse attention (else dense causal)
    moe_layers: tuple[bool, ...]  # per layer: MoE MLP (else dense MLP)
    dense_intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int  # total width of the shared expert(s); 0 = none
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    index_heads: int
    index_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int
    init_blocks: int
    tie_word_embeddings: bool = False
    layout: str = "text"  # "production" | "text"
    source: str = "<dict>"

    def __post_init__(self) -> None:
        where = self.source
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if len(self.sparse_layers) != self.num_layers or len(self.moe_layers) != self.num_layers:
            raise ConfigError(f"{where}: per-layer patterns have {len(self.sparse_layers)} / "
                              f"{len(self.moe_layers)} entries for {self.num_layers} layers")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"{where}: rotary dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if any(self.sparse_layers):
            if self.index_heads != self.num_kv_heads:
                raise ConfigError(f"{where}: index heads ({self.index_heads}) must equal num_key_value_heads "
                                  f"({self.num_kv_heads}): each index head drives one KV head's selection")
            if self.index_dim < self.rotary_dim:
                raise ConfigError(f"{where}: index head dim {self.index_dim} is smaller than the rotary dim "
                                  f"{self.rotary_dim}")
            if self.block_size <= 0 or self.block_size & (self.block_size - 1):
                raise ConfigError(f"{where}: sparse block size {self.block_size} must be a power of two")
            if self.topk_blocks < 1 or self.local_blocks < 0 or self.init_blocks < 0:
                raise ConfigError(f"{where}: bad selection sizes topk={self.topk_blocks} "
                                  f"local={self.local_blocks} init={self.init_blocks}")
        if any(self.moe_layers) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"{where}: num_experts_per_tok {self.num_experts_per_tok} not in [1, {self.num_experts}]")

    @property
    def sparse_layer_ids(self) -> list[int]:
        return [i for i, s in enumerate(self.sparse_layers) if s]

    @property
    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        """Eagle3 aux capture ids in the "input of layer i" convention: (2, L//2, L-3)."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "<dict>") -> "M3Config":
        text = raw.get("text_config", raw)
        if not isinstance(text, Mapping):
            raise ConfigError(f"{source}: 'text_config' must be an object")
        section = "text_config" if "text_config" in raw else ""
        # transformers re-saves the VL wrapper with a text-style text_config; the field style decides
        if "layer_types" in text or "mlp_layer_types" in text:
            return _parse_text(text, source, section)
        return _parse_production(text, source, section)

    @classmethod
    def from_file(cls, path: str | Path) -> "M3Config":
        """Read `config.json` (a directory holding one, or the file itself)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        with path.open() as f:
            return cls.from_dict(json.load(f), source=str(path))


def _need(raw: Mapping[str, Any], key: str, source: str, section: str = "") -> Any:
    if key not in raw or raw[key] is None:
        where = f"{section}.{key}" if section else key
        raise ConfigError(f"{source}: required field '{where}' is missing")
    return raw[key]


def _flags(values: Any, truthy: set[Any], key: str, source: str) -> tuple[bool, ...]:
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"{source}: '{key}' must be a list, got {type(values).__name__}")
    return tuple(v in truthy for v in values)


def _common(t: Mapping[str, Any], source: str, section: str) -> dict[str, Any]:
    hidden = int(_need(t, "hidden_size", source, section))
    heads = int(_need(t, "num_attention_heads", source, section))
    head_dim = t.get("head_dim") or hidden // heads
    return dict(
        vocab_size=int(_need(t, "vocab_size", source, section)),
        hidden_size=hidden,
        num_layers=int(_need(t, "num_hidden_layers", source, section)),
        num_heads=heads,
        num_kv_heads=int(_need(t, "num_key_value_heads", source, section)),
        head_dim=int(head_dim),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        dense_intermediate_size=int(t.get("dense_intermediate_size", 12288)),
        moe_intermediate_size=int(_need(t, "intermediate_size", source, section)),
        shared_intermediate_size=int(t.get("shared_intermediate_size", 3072))
        * int(t.get("n_shared_experts", t.get("num_shared_experts", 1)) or 0),
        num_experts=int(t.get("num_local_experts", t.get("num_experts", 128))),
        num_experts_per_tok=int(t.get("num_experts_per_tok", 4)),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 2.0)),
        swiglu_alpha=float(t.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(t.get("swiglu_limit", 7.0)),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        source=source,
    )


def _rope(t: Mapping[str, Any], head_dim: int, use_rotary_dim: bool) -> tuple[int, float]:
    params = t.get("rope_parameters") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ConfigError(f"unsupported rope_type {params['rope_type']!r} (only 'default')")
    theta = float(params.get("rope_theta", t.get("rope_theta", 5e6)))
    factor = params.get("partial_rotary_factor", t.get("partial_rotary_factor"))
    if factor is not None:  # what transformers reads; its text layout writes a stale rotary_dim
        return int(head_dim * float(factor)), theta
    if use_rotary_dim and t.get("rotary_dim"):
        return int(t["rotary_dim"]), theta
    return head_dim, theta


def _check_scoring(t: Mapping[str, Any], source: str) -> None:
    scoring = t.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{source}: scoring_func {scoring!r} is not supported (MiniMax-M3 routes with sigmoid)")


def _parse_production(t: Mapping[str, Any], source: str, section: str) -> M3Config:
    _check_scoring(t, source)
    common = _common(t, source, section)
    n = common["num_layers"]
    rotary_dim, theta = _rope(t, common["head_dim"], use_rotary_dim=True)
    sp = t.get("sparse_attention_config")
    if sp is None:
        sp = {}
        sparse = (False,) * n
    else:
        if sp.get("use_sparse_attention", True):
            sparse = _flags(_need(sp, "sparse_attention_freq", source, f"{section}.sparse_attention_config"),
                            {1, True}, "sparse_attention_freq", source)
        else:
            sparse = (False,) * n
        if sp.get("sparse_score_type", "max") != "max":
            raise ConfigError(f"{source}: sparse_score_type {sp['sparse_score_type']!r} is not supported (only 'max')")
        disable_iv = sp.get("sparse_disable_index_value")
        if disable_iv is not None and any(s and not d for s, d in zip(sparse, disable_iv)):
            raise ConfigError(f"{source}: sparse layers with an index-value branch are not supported")
    moe = _flags(_need(t, "moe_layer_freq", source, section), {1, True}, "moe_layer_freq", source)
    sect = f"{section}.sparse_attention_config"
    need_index = any(sparse)
    return M3Config(
        **common,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        sparse_layers=sparse,
        moe_layers=moe,
        index_heads=int(_need(sp, "sparse_num_index_heads", source, sect) if need_index else 0),
        index_dim=int(_need(sp, "sparse_index_dim", source, sect) if need_index else 0),
        block_size=int(_need(sp, "sparse_block_size", source, sect) if need_index else 128),
        topk_blocks=int(_need(sp, "sparse_topk_blocks", source, sect) if need_index else 16),
        local_blocks=int(sp.get("sparse_local_block", 1)),
        init_blocks=int(sp.get("sparse_init_block", 0)),
        layout="production",
    )


def _parse_text(raw: Mapping[str, Any], source: str, section: str) -> M3Config:
    _check_scoring(raw, source)
    common = _common(raw, source, section)
    rotary_dim, theta = _rope(raw, common["head_dim"], use_rotary_dim=False)
    layer_types = _need(raw, "layer_types", source, section)
    unknown = sorted({x for x in layer_types} - {SPARSE_LAYER, DENSE_LAYER})
    if unknown:
        raise ConfigError(f"{source}: unknown layer_types {unknown}")
    mlp_types = _need(raw, "mlp_layer_types", source, section)
    unknown = sorted({x for x in mlp_types} - {"sparse", "dense"})
    if unknown:
        raise ConfigError(f"{source}: unknown mlp_layer_types {unknown}")
    sparse = _flags(layer_types, {SPARSE_LAYER}, "layer_types", source)
    need_index = any(sparse)
    return M3Config(
        **common,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        sparse_layers=sparse,
        moe_layers=_flags(mlp_types, {"sparse"}, "mlp_layer_types", source),
        index_heads=int(_need(raw, "index_n_heads", source, section) if need_index else 0),
        index_dim=int(_need(raw, "index_head_dim", source, section) if need_index else 0),
        block_size=int(_need(raw, "index_block_size", source, section) if need_index else 128),
        topk_blocks=int(_need(raw, "index_topk_blocks", source, section) if need_index else 16),
        local_blocks=int(raw.get("index_local_blocks", 1)),
        init_blocks=0,
        layout="text",
    )
