"""The MiniMax-M3 text-backbone configuration, read from either public checkpoint layout.

Two `config.json` shapes exist for the same model:
(a) production (`MiniMaxM3SparseForConditionalGeneration`, model_type `minimax_m3_vl`): the text
    fields sit under `text_config`, the sparse layers come from `sparse_attention_config`
    (`sparse_*` keys, `sparse_attention_freq`) and the MoE layers from `moe_layer_freq`; RoPE is
    given as flat `rope_theta` / `partial_rotary_factor` / `rotary_dim`;
(b) the text-only layout transformers writes (`MiniMaxM3VLForCausalLM`, model_type
    `minimax_m3_vl_text`): `layer_types`, `mlp_layer_types`, `index_*` and `rope_parameters`.
Both parse into one flat, validated `M3Config` so nothing downstream knows the layout. Every
field is read through `ConfigFields`, so a wrong type or range fails as one `ConfigError`
"<file>: <field>: <what is wrong>" before any weight is touched.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from m3_eagle_plugin.models.config_fields import ConfigError, ConfigFields, read_json_object, show_value

SPARSE_LAYER = "minimax_m3_sparse"
DENSE_LAYER = "full_attention"

#: The step metadata and the kernels hold positions and KV lengths as int32: no context passes this
#: many tokens, and a whole block of the largest power-of-two size below it is a length they can hold.
MAX_CONTEXT_TOKENS = 2**31 - 1
MAX_BLOCK_SIZE = 2**30
#: transformers' `max_position_embeddings` where a MiniMax-M3 config leaves it out.
DEFAULT_MAX_POSITIONS = 524288


def max_context_blocks(block_size: int) -> int:
    """The most blocks of `block_size` tokens a context of int32 positions can see."""
    return -(-MAX_CONTEXT_TOKENS // block_size)


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
    shared_intermediate_size: int  # width of the one shared expert; 0 = none
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
    index_head_repeat: int = 1  # checkpoint loading: each stored index head serves this many KV heads
    tie_word_embeddings: bool = False
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS  # the positions the model was trained on
    layout: str = "text"  # "production" | "text"
    source: str = "<dict>"

    def __post_init__(self) -> None:
        where = self.source
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}: {name}: must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if len(self.sparse_layers) != self.num_layers or len(self.moe_layers) != self.num_layers:
            raise ConfigError(f"{where}: per-layer patterns have {len(self.sparse_layers)} / "
                              f"{len(self.moe_layers)} entries for {self.num_layers} layers")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(
                f"{where}: rotary dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if any(self.sparse_layers):
            if self.index_heads != self.num_kv_heads:
                raise ConfigError(f"{where}: index heads ({self.index_heads}) must equal num_key_value_heads "
                                  f"({self.num_kv_heads}): each index head drives one KV head's selection")
            if self.index_dim < self.rotary_dim:
                raise ConfigError(f"{where}: index head dim {self.index_dim} is smaller than the rotary dim "
                                  f"{self.rotary_dim}")
            if self.block_size <= 0 or self.block_size & (self.block_size - 1):
                raise ConfigError(f"{where}: sparse block size {self.block_size} must be a power of two")
            if self.block_size > MAX_BLOCK_SIZE:
                raise ConfigError(f"{where}: sparse block size {self.block_size} is past {MAX_BLOCK_SIZE} (a whole "
                                  "block's length must fit the int32 KV lengths)")
            if self.topk_blocks < 1 or self.local_blocks < 0 or self.init_blocks < 0:
                raise ConfigError(f"{where}: bad selection sizes topk={self.topk_blocks} "
                                  f"local={self.local_blocks} init={self.init_blocks}")
            if self.topk_blocks > max_context_blocks(self.block_size):
                raise ConfigError(f"{where}: top-{self.topk_blocks} selection is past the "
                                  f"{max_context_blocks(self.block_size)} blocks any context holds")
            if self.local_blocks + self.init_blocks > self.topk_blocks:
                raise ConfigError(f"{where}: {self.local_blocks} local + {self.init_blocks} init blocks exceed the "
                                  f"top-{self.topk_blocks} selection")
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
        top = ConfigFields(raw, source)
        text = top.get_section("text_config") or top
        try:
            config = _parse(text)
        except ConfigError as error:
            # the text config may be tagged minimax_m2 and transformers reads no model_type here, so it
            # is not checked up front; but a missing M3 field in another model's config names the cause
            kind = next((str(c.get("model_type")) for c in (raw, raw.get("text_config")) if isinstance(c, Mapping)
                         and c.get("model_type") is not None), None)
            if kind is None or "minimax" in kind.lower():
                raise
            raise ConfigError(f"{error} (model_type {kind!r}: is this a MiniMax-M3 checkpoint?)") from None
        # the VL wrapper ties lm_head to the embedding when its own flag or the text config's is true
        if text is not top and top.get_bool("tie_word_embeddings", False):
            config = replace(config, tie_word_embeddings=True)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "M3Config":
        """Read `config.json` (a directory holding one, or the file itself)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_json_object(path), source=str(path))


def _common(t: ConfigFields) -> dict[str, Any]:
    hidden = t.get_int("hidden_size", minimum=1)
    heads = t.get_int("num_attention_heads", minimum=1)
    head_dim = t.get_int("head_dim", 128, minimum=1)  # transformers' default, not hidden // heads
    # transformers maps `num_experts` onto `num_local_experts` (attribute_map) after setting the fields,
    # so with both keys present `num_experts` is the one its model is built with
    num_experts_key = "num_experts" if t.has("num_experts") else "num_local_experts"
    return dict(
        vocab_size=t.get_int("vocab_size", minimum=1),
        hidden_size=hidden,
        num_layers=t.get_int("num_hidden_layers", minimum=1),
        num_heads=heads,
        num_kv_heads=t.get_int("num_key_value_heads", minimum=1),
        head_dim=head_dim,
        rms_norm_eps=t.get_float("rms_norm_eps", 1e-6, positive=True),
        dense_intermediate_size=t.get_int("dense_intermediate_size", 12288, minimum=1),
        moe_intermediate_size=t.get_int("intermediate_size", minimum=1),
        # one shared expert of this width: transformers reads no n_shared_experts / num_shared_experts
        shared_intermediate_size=t.get_int("shared_intermediate_size", 3072, minimum=0),
        num_experts=t.get_int(num_experts_key, 128, minimum=1),
        num_experts_per_tok=t.get_int("num_experts_per_tok", 4, minimum=1),
        routed_scaling_factor=t.get_float("routed_scaling_factor", 2.0),
        swiglu_alpha=t.get_float("swiglu_alpha", 1.702),
        swiglu_limit=t.get_float("swiglu_limit", 7.0, positive=True),
        tie_word_embeddings=t.get_bool("tie_word_embeddings", False),
        max_position_embeddings=t.get_int("max_position_embeddings", DEFAULT_MAX_POSITIONS, minimum=1),
        source=t.source,
    )


def rope_section(t: ConfigFields) -> ConfigFields:
    """The RoPE dict transformers reads: a non-empty legacy `rope_scaling` replaces `rope_parameters`."""
    legacy = t.get_section("rope_scaling")
    if legacy is not None and legacy.raw:
        return legacy
    return t.get_section("rope_parameters") or ConfigFields({}, t.source, t.name("rope_parameters"))


def _rope(t: ConfigFields, head_dim: int, use_rotary_dim: bool) -> tuple[int, float]:
    params = rope_section(t)
    nested = [key for key, value in params.raw.items() if isinstance(value, Mapping)]
    if nested:  # transformers' per-layer-type form, which its M3 rotary embedding cannot read either
        raise params.error(nested[0], "per-layer-type RoPE parameters are not supported (give one flat dict "
                           "for every layer)")
    rope_type = params.need("rope_type", params.need("type", "default"))  # "type": the legacy key, same meaning
    if rope_type != "default":
        raise params.error("rope_type", f"{show_value(rope_type)} is not supported (only 'default')")
    where = params if params.has("rope_theta") else t
    theta = where.get_float("rope_theta", 5e6, positive=True)
    where = params if params.has("partial_rotary_factor") else t
    if where.has("partial_rotary_factor"):  # what transformers reads; its text layout writes a stale rotary_dim
        factor = where.get_float("partial_rotary_factor", positive=True)
        if factor > 1:
            raise where.error("partial_rotary_factor", f"must be in (0, 1], got {factor}")
        return int(head_dim * factor), theta
    if use_rotary_dim and t.get_int("rotary_dim", 0, minimum=0):
        return t.get_int("rotary_dim"), theta
    return head_dim, theta


def _check_fixed_semantics(t: ConfigFields) -> None:
    """Fields whose other values would change the model this code runs: refused, not ignored
    (transformers' configs leave them out; MiniMax-M3's own configs hold these values)."""
    scoring = t.need("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise t.error("scoring_func", f"{show_value(scoring)} is not supported (MiniMax-M3 routes with sigmoid)")
    # is_causal: transformers' create_causal_mask reads it off any config and, false, masks bidirectionally
    for key, supported in (("use_gemma_norm", True), ("attention_output_gate", False), ("use_qk_norm", True),
                           ("use_routing_bias", True), ("is_causal", True)):
        if t.has(key) and t.get_bool(key, supported) != supported:
            raise t.error(key, f"{str(not supported).lower()} is not supported (only {str(supported).lower()})")
    beta = t.get_float("swiglu_beta", 1.0)  # vLLM's (up + beta); transformers and this model add 1
    if beta != 1.0:
        raise t.error("swiglu_beta", f"{beta} is not supported (only 1.0)")
    for key, allowed in (("qk_norm_type", ("per_head",)), ("hidden_act", ("swigluoai", "silu"))):
        value = t.need(key, allowed[0])
        if value not in allowed:
            raise t.error(key, f"{show_value(value)} is not supported (only {', '.join(map(repr, allowed))})")
    groups = t.get_int("n_group", 1, minimum=1)
    if groups > 1 and t.get_int("topk_group", groups, minimum=1) < groups:
        raise t.error("topk_group", f"grouped expert routing ({groups} groups, topk_group "
                      f"{t.get_int('topk_group', groups)}) is not supported")


_ZERO_ONE = {0: False, 1: True}
_ATTENTION_TYPES = {SPARSE_LAYER: True, DENSE_LAYER: False}
_MLP_TYPES = {"sparse": True, "dense": False}

#: M3Config field -> (the flat key transformers keeps, the legacy `sparse_attention_config` key that overrides it)
_INDEX_KEYS = {
    "index_heads": ("index_n_heads", "sparse_num_index_heads"),
    "index_dim": ("index_head_dim", "sparse_index_dim"),
    "block_size": ("index_block_size", "sparse_block_size"),
    "topk_blocks": ("index_topk_blocks", "sparse_topk_blocks"),
    "local_blocks": ("index_local_blocks", "sparse_local_block"),
}


def _parse(t: ConfigFields) -> M3Config:
    """Either layout, each field resolved as transformers' `MiniMaxM3VLTextConfig.__post_init__` does,
    but one: a production-layout file with `rotary_dim` and no `partial_rotary_factor` rotates
    `rotary_dim` dims (as the published checkpoint means, and vLLM and TensorRT-LLM read it), where
    transformers rotates the whole head (`_rope`)."""
    # transformers re-saves the VL wrapper with a text-style text_config; the field style decides
    layout = "text" if t.has("layer_types") or t.has("mlp_layer_types") else "production"
    _check_fixed_semantics(t)
    common = _common(t)
    n = common["num_layers"]
    rotary_dim, theta = _rope(t, common["head_dim"], use_rotary_dim=layout == "production")
    legacy = t.get_section("sparse_attention_config")
    moe = _moe_pattern(t, n, layout)  # first: always a list in the file, so n is checked before (False,) * n
    sparse = _sparse_pattern(t, legacy, n, layout)
    if legacy is not None:
        _check_legacy_branch(legacy, sparse)
    index = _index_geometry(t, legacy, any(sparse))
    init_blocks = _init_blocks(legacy, any(sparse), layout)
    if any(sparse) and common["num_heads"] % common["num_kv_heads"] == 0:  # else M3Config refuses the GQA split
        index["index_head_repeat"] = _index_head_repeat(t, legacy, index["index_heads"], common["num_kv_heads"])
        index["index_heads"] *= index["index_head_repeat"]
    return M3Config(
        **common,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        sparse_layers=sparse,
        moe_layers=moe,
        **index,
        init_blocks=init_blocks,
        layout=layout,
    )


def _sparse_pattern(t: ConfigFields, legacy: ConfigFields | None, n: int, layout: str) -> tuple[bool, ...]:
    """`layer_types` wins over the legacy `sparse_attention_freq`; `use_sparse_attention` is read by
    neither transformers nor us. A text config needs one of them; a production one without the
    section has no sparse layer."""
    if t.has("layer_types") or (legacy is None and layout == "text"):
        return t.get_pattern("layer_types", _ATTENTION_TYPES, n)
    if legacy is not None:
        return legacy.get_pattern("sparse_attention_freq", _ZERO_ONE, n)
    return (False,) * n


def _moe_pattern(t: ConfigFields, n: int, layout: str) -> tuple[bool, ...]:
    """`mlp_layer_types` wins over the legacy `moe_layer_freq`; the layout's own key is the one required."""
    if t.has("mlp_layer_types") or (layout == "text" and not t.has("moe_layer_freq")):
        return t.get_pattern("mlp_layer_types", _MLP_TYPES, n)
    return t.get_pattern("moe_layer_freq", _ZERO_ONE, n)


def _check_legacy_branch(sp: ConfigFields, sparse: tuple[bool, ...]) -> None:
    """Legacy-section values that would change the index branch: refused (a model without sparse
    layers has no index branch, and scores no block)."""
    score_type = sp.need("sparse_score_type", "max")
    if score_type != "max" and any(sparse):
        raise sp.error("sparse_score_type", f"{show_value(score_type)} is not supported (only 'max')")
    if sp.has("sparse_disable_index_value"):
        disabled = sp.get_pattern("sparse_disable_index_value", _ZERO_ONE, len(sparse))
        with_iv = [i for i, (s, d) in enumerate(zip(sparse, disabled)) if s and not d]
        if with_iv:
            raise sp.error("sparse_disable_index_value", f"sparse layers {with_iv} keep the index-value "
                           "branch, which is not supported")


def _init_blocks(legacy: ConfigFields | None, need_index: bool, layout: str) -> int:
    """The legacy `sparse_init_block`: read in the production layout (vLLM / SGLang force those blocks).
    transformers reads it in neither layout and forces no init block, so a text config that asks for
    some would run another model than the transformers that writes that layout: refused by name."""
    if legacy is None:
        return 0
    init = legacy.get_int("sparse_init_block", 0, minimum=0)
    if init and need_index and layout == "text":
        raise legacy.error("sparse_init_block", f"{init} init blocks are not supported in a text-layout config "
                           "(layer_types / mlp_layer_types): transformers forces no init block there")
    return init


def _index_key(t: ConfigFields, legacy: ConfigFields | None, field: str) -> tuple[ConfigFields, str]:
    """Where transformers reads an index field: the legacy section's key when given, else the flat
    `index_*` key (a missing field is reported under the section when there is one)."""
    flat, old = _INDEX_KEYS[field]
    if legacy is not None and (legacy.has(old) or not t.has(flat)):
        return legacy, old
    return t, flat


def _index_geometry(t: ConfigFields, legacy: ConfigFields | None, need_index: bool) -> dict[str, int]:
    """Index-branch geometry; a model without sparse layers needs none of it (production defaults)."""
    def read(field: str, default: Any) -> int:
        fields, key = _index_key(t, legacy, field)
        return fields.get_int(key, minimum=1) if need_index else default

    fields, key = _index_key(t, legacy, "local_blocks")
    geometry = {
        "index_heads": read("index_heads", 0),
        "index_dim": read("index_dim", 0),
        "block_size": read("block_size", 128),
        "topk_blocks": read("topk_blocks", 16),
        "local_blocks": fields.get_int(key, 1, minimum=0),
    }
    if need_index:
        _check_index_bounds(t, legacy, geometry["block_size"], geometry["topk_blocks"])
    return geometry


def _check_index_bounds(t: ConfigFields, legacy: ConfigFields | None, block_size: int, topk: int) -> None:
    """A block size past what int32 lengths hold, and a top-k past the blocks any context of int32
    positions holds, are refused by their keys: transformers takes min(top-k, blocks) columns per
    context, but the selection here is top-k wide in every context (10**12 allocated [H, T, 10**12]),
    and a block that cannot fit was blamed on the cache's block count."""
    if block_size > MAX_BLOCK_SIZE:
        fields, key = _index_key(t, legacy, "block_size")
        raise fields.error(key, f"must be <= {MAX_BLOCK_SIZE} (2**30: a whole block's length must fit the int32 KV "
                           f"lengths), got {block_size}")
    most = max_context_blocks(block_size)
    if topk > most:
        fields, key = _index_key(t, legacy, "topk_blocks")
        raise fields.error(key, f"must be <= {most}, the most blocks of {block_size} tokens a context of int32 "
                           f"positions (at most {MAX_CONTEXT_TOKENS} tokens) holds, got {topk}")


def _index_head_repeat(t: ConfigFields, legacy: ConfigFields | None, index_heads: int, kv_heads: int) -> int:
    """How many KV heads each checkpoint index head selects blocks for. transformers gives index
    head h the query heads [h, h+1) * num_attention_heads / index_heads (its block mask
    repeat-interleaves the selections over the query heads); the MSA core selects per KV head, so
    index heads that divide the KV heads run with each head repeated, and any other count is refused."""
    if kv_heads % index_heads == 0:
        return kv_heads // index_heads
    fields, key = _index_key(t, legacy, "index_heads")
    raise fields.error(key, f"{index_heads} index heads do not divide num_key_value_heads ({kv_heads}): each "
                       "index head selects blocks for num_attention_heads / index heads query heads, and the "
                       "MSA core can only run one selection per KV head")


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The ids that end generation, as transformers' `generate` reads them for this checkpoint: a
    `generation_config.json` decides alone (no `eos_token_id` there: none); without one, config.json's
    top-level `eos_token_id`, else its `text_config`'s. An int or a list of ints; null: none."""
    model_dir = Path(model_dir)
    generation = model_dir / "generation_config.json"
    if generation.exists():
        sources = [(generation, read_json_object(generation))]
    else:
        config = read_json_object(model_dir / "config.json")
        text = config.get("text_config")
        sources = [(model_dir / "config.json", config)]
        if isinstance(text, Mapping):
            sources.append((model_dir / "config.json", {"eos_token_id": text.get("eos_token_id")}))
    for path, fields in sources:
        value = fields.get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(type(i) is int and i >= 0 for i in ids):
            raise ConfigError(f"{path}: eos_token_id: must be an id or a list of ids >= 0, got {show_value(value)}")
        return tuple(ids)
    return ()
