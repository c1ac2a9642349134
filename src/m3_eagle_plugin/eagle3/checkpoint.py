"""Eagle3 draft config parsing and checkpoint loading (public `LlamaForCausalLMEagle3` layout).

Tensor names: one decoder layer under `midlayer.*` or `layers.0.*` (an optional leading `model.`
is accepted), `fc`, optional `fc_norm.{0,1,2}`, optional `input_norm` (with `norm_before_fc`),
`norm`, optional `embed_tokens` / `lm_head`, optional `d2t` (draft id d -> target id d + d2t[d])
and `t2d` (a mask, unused). Config keys: `eagle_config.eagle_aux_hidden_state_layer_ids` (ids in
the "input of layer i" convention as vLLM reads them, default (2, L//2, L-3); fed to `fc` in
ascending layer order), `num_aux_hidden_states` (checked against them), `draft_vocab_size`,
`target_hidden_size`, `norm_output` (or TensorRT-LLM's `eagle_config.return_hidden_post_norm`),
`norm_before_residual`, `fc_norm` (the per-chunk norms; when absent, their tensors decide) and
`norm_before_fc`; the aux ids and the four flags may sit at the top level or in `eagle_config`,
the three sizes at the top level only (as every exporter writes them). Refused by name, since vLLM
or TensorRT-LLM would run another head from them: `eagle_config.use_aux_hidden_state` false,
`eagle_config.eh_proj_before_attn` true, `num_hidden_layers` other than 1, and the speculators
format (`transformer_layer_config`).

The embedding and lm_head: with ``embeddings="target"`` (the default) the head uses the target's
embedding, and its lm_head wherever the head scores the full vocabulary in target-id order, even when
the checkpoint ships its own: MiniMax-M3's Eagle3 head ships copies [200064, 6144] each (about 4.9 GB
in bf16) that its model card says are replaced by the target's at serve time, as vLLM and SGLang do;
those tensors are checked but never read. A head with a smaller or reordered draft vocabulary keeps
the lm_head it ships, trained for its ids. ``embeddings="own"`` uses whatever the checkpoint ships.
What neither provides is taken from the target (the lm_head's rows gathered into draft-id order
through `d2t` whenever that is not all zeros). Names and shapes are all validated before anything is
assigned.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from m3_eagle_plugin.eagle3.head import Eagle3Config, Eagle3Head
from m3_eagle_plugin.models.config import ConfigError, ConfigFields, read_json_object, rope_section
from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
from m3_eagle_plugin.models.rope import RotaryEmbedding
from m3_eagle_plugin.models.safetensors_source import (CheckpointError, SafetensorsSource, check_compute_dtype,
                                                       check_names, check_shape, check_sizes_stored,
                                                       check_weight_dtype)
from m3_eagle_plugin.msa.blocks import is_integer_dtype

_IGNORED = re.compile(r"(^|\.)rotary_emb\.|^t2d$")
_OPTIONAL = ("embed_tokens.weight", "lm_head.weight", "d2t")
EMBEDDINGS = ("target", "own")


def parse_draft_config(raw: Mapping[str, Any], source: str, *, target_hidden_size: int,
                       target_vocab_size: int, default_aux_layer_ids: tuple[int, ...],
                       has_fc_norm: bool, target_num_layers: int | None = None,
                       stored_fc_width: int | None = None, stored_fc_where: str = "the checkpoint") -> Eagle3Config:
    """Validate a draft `config.json` against its target (and the input width of the checkpoint's `fc`,
    when given); every error is "<file>: <field>: <what>"."""
    top = ConfigFields(raw, source)
    eagle = top.get_section("eagle_config") or ConfigFields({}, source, "eagle_config")

    def flat_or_eagle(key: str) -> ConfigFields:  # a flat key wins over the same key in eagle_config
        return top if top.has(key) else eagle

    nested = next((key for key in ("transformer_layer_config", "speculators_config") if top.has(key)), None)
    if nested is not None:  # its Llama fields sit in that section, and its norm_before_residual defaults to true
        raise top.error(nested, "a vLLM speculators-format config is not supported (the draft must be in the "
                        "LlamaForCausalLMEagle3 layout, its Llama fields at the top level)")
    layers = top.get_int("num_hidden_layers", 1, minimum=1)
    if layers != 1:  # vLLM and SGLang stack num_hidden_layers decoder layers
        raise top.error("num_hidden_layers", f"{layers} draft decoder layers are not supported (only 1)")
    if not eagle.get_bool("use_aux_hidden_state", True):  # vLLM reads it here only
        raise eagle.error("use_aux_hidden_state", "false is not supported: vLLM then builds no fc and feeds the "
                          "target's last hidden state, where this head combines the aux hidden states through fc")
    if eagle.get_bool("eh_proj_before_attn", False):  # TensorRT-LLM's other head: eh_proj, attention H wide
        raise eagle.error("eh_proj_before_attn", "true is not supported: TensorRT-LLM then builds an eh_proj before "
                          "an attention over hidden_size inputs, where this head attends over the 2 x hidden_size "
                          "concat of the embedding and the hidden state")
    hidden = top.get_int("hidden_size", minimum=1)
    heads = top.get_int("num_attention_heads", minimum=1)
    kv_heads = top.get_int("num_key_value_heads", heads, minimum=1)
    if heads % kv_heads:
        raise top.error("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    head_dim = top.get_int("head_dim", 0, minimum=0) or hidden // heads
    if head_dim < 1:
        raise top.error("num_attention_heads", f"{heads} heads leave no room in hidden_size {hidden}")
    if head_dim % 2:  # the head's RoPE refused it later, naming neither the file nor a field
        given = top.get_int("head_dim", 0, minimum=0)
        raise top.error("head_dim" if given else "num_attention_heads",
                        f"head_dim {head_dim}" + ("" if given else f" (hidden_size {hidden} // {heads} heads)")
                        + " is odd; the draft's RoPE rotates the whole head in two halves and needs it even")
    declared_target = top.get_int("target_hidden_size", hidden, minimum=1)
    if hidden != target_hidden_size or declared_target != target_hidden_size:
        # the field that differs: a right hidden_size with a wrong target_hidden_size read "64 does not match 64"
        field = "hidden_size" if hidden != target_hidden_size else "target_hidden_size"
        raise ConfigError(f"{source}: {field}: draft hidden_size {hidden} (target_hidden_size {declared_target}) "
                          f"does not match the target model's hidden size {target_hidden_size}")
    vocab = top.get_int("vocab_size", target_vocab_size, minimum=1)
    if vocab != target_vocab_size:
        raise top.error("vocab_size", f"draft vocab_size {vocab} != target vocab_size {target_vocab_size}")
    draft_vocab = top.get_int("draft_vocab_size", vocab, minimum=1)
    if draft_vocab > vocab:
        raise top.error("draft_vocab_size", f"{draft_vocab} exceeds vocab_size {vocab}")
    rope = rope_section(top)  # as for the target, and as transformers reads it
    type_key = "rope_type" if rope.has("rope_type") else "type"
    rope_type = rope.need(type_key, "default")
    if rope_type != "default":
        raise rope.error(type_key, f"unsupported draft rope type {rope_type!r} (only 'default')")
    theta = (rope if rope.has("rope_theta") else top).get_float("rope_theta", 10000.0, positive=True)
    aux_key = "eagle_aux_hidden_state_layer_ids"
    aux_fields = flat_or_eagle(aux_key)
    listed = aux_fields.get_int_list(aux_key, ())
    aux = listed or tuple(default_aux_layer_ids)
    # ids the config does not list come from the target's size: the error must not blame the config's ids
    whose = "aux layer ids" if listed else "not given, and the target's default (2, L//2, L-3) aux layer ids"
    if len(set(aux)) != len(aux):
        raise aux_fields.error(aux_key, f"{whose} {list(aux)} repeat a layer")
    # vLLM and SGLang append the aux states while walking the target's layers and TensorRT-LLM sorts its
    # capture ids, so `fc` always sees them in ascending layer order, whatever order the config lists.
    aux = tuple(sorted(aux))
    num_aux = top.get_int("num_aux_hidden_states", len(aux), minimum=1)  # vLLM's fc width, when given
    if num_aux != len(aux):
        raise top.error("num_aux_hidden_states", f"{num_aux} does not match the {len(aux)} aux layer ids {list(aux)}")
    if target_num_layers is not None:
        bad = [i for i in aux if not 0 <= i < target_num_layers]
        if bad:
            raise aux_fields.error(aux_key, f"{whose} {bad} out of range for a {target_num_layers}-layer target")
    if len(aux) < 2:  # the head tells its first step (n x hidden wide input) from later ones by width
        raise aux_fields.error(aux_key, f"{len(aux)} aux layer id(s); Eagle3 needs at least 2")
    # another count read as a stray or missing fc_norm tensor, or an fc shape, naming no config field
    if stored_fc_width is not None and stored_fc_width != len(aux) * target_hidden_size \
            and stored_fc_width % target_hidden_size == 0:
        raise aux_fields.error(aux_key, f"{whose} {list(aux)} feed fc {len(aux)} hidden states, but fc.weight in "
                               f"{stored_fc_where} takes {stored_fc_width // target_hidden_size} ({stored_fc_width} = "
                               f"{stored_fc_width // target_hidden_size} x target hidden {target_hidden_size})")
    act = top.need("hidden_act", "silu")
    if act != "silu":
        raise top.error("hidden_act", f"{act!r} is not supported (the draft MLP is SiLU-gated)")
    return Eagle3Config(
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=top.get_int("intermediate_size", minimum=1),
        rms_norm_eps=top.get_float("rms_norm_eps", 1e-6, positive=True), rope_theta=theta, vocab_size=vocab,
        draft_vocab_size=draft_vocab, target_hidden_size=target_hidden_size, aux_layer_ids=aux,
        # TensorRT-LLM also reads `eagle_config.return_hidden_post_norm` for the post-norm next hidden.
        norm_output=(flat_or_eagle("norm_output").get_bool("norm_output", False)
                     or eagle.get_bool("return_hidden_post_norm", False)),
        norm_before_residual=flat_or_eagle("norm_before_residual").get_bool("norm_before_residual", False),
        # The `fc_norm` flag builds the per-chunk norms (vLLM, TensorRT-LLM); without it, the tensors decide.
        has_fc_norm=flat_or_eagle("fc_norm").get_bool("fc_norm", has_fc_norm),
        norm_before_fc=flat_or_eagle("norm_before_fc").get_bool("norm_before_fc", False),
    )


def canonical_name(name: str) -> str:
    """`model.midlayer.x` / `midlayer.x` / `model.layers.0.x` -> `layers.0.x`."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return name


@dataclass(frozen=True)
class DraftPlan:
    """What `inspect_draft` read without touching a weight: the validated config, the checkpoint's
    tensor names (canonical -> stored), the shapes the head expects, the sizes of the target it was
    checked against (`_target_sizes`), the ``embeddings`` choice, the shipped tensors that choice
    leaves unread (the target's are used), and whether the lm_head is gathered from the target's rows."""

    config: Eagle3Config
    source: SafetensorsSource
    by_canon: dict
    expected: dict
    target: tuple[int, int, int]
    embeddings: str = "target"
    unread: frozenset = frozenset()
    gathers_lm_head: bool = False

    @property
    def read(self) -> frozenset:
        """Canonical names of the tensors `load_draft` reads from the checkpoint."""
        return frozenset(self.by_canon).intersection(self.expected) - self.unread


def _target_sizes(target_config) -> tuple[int, int, int]:
    """What `inspect_draft` checks a draft against: the target's hidden size, vocabulary and layer count."""
    return target_config.hidden_size, target_config.vocab_size, target_config.num_layers


def _check_sizes_stored(source: SafetensorsSource, config: Eagle3Config, where: str) -> None:
    """The draft's sizes against the dimensions its checkpoint stores (`check_sizes_stored`), before
    the head is built."""
    sizes = {"intermediate_size": config.intermediate_size,
             "num_attention_heads x head_dim": config.num_heads * config.head_dim,
             "num_key_value_heads x head_dim": config.num_kv_heads * config.head_dim}
    if config.draft_vocab_size != config.vocab_size:  # then d2t holds one entry per draft id
        sizes["draft_vocab_size"] = config.draft_vocab_size
    check_sizes_stored(sizes, map(source.shape, source.names()), where, source.where, ConfigError)


def inspect_draft(path: str | Path, target_config, *, embeddings: str = "target") -> DraftPlan:
    """Check an Eagle3 checkpoint directory against its target's config (an `M3Config`): the draft
    `config.json`, its tensor names and shapes (safetensors headers) and its d2t id map, no weight read.
    ``embeddings``: "target" or "own" (the module docstring)."""
    check_embeddings(embeddings)
    path = Path(path)
    if path.is_file():  # config.json was looked for inside it: "no config.json at .../config.json/config.json"
        raise CheckpointError(f"{path}: the Eagle3 draft is read from its checkpoint directory (config.json and "
                              "the safetensors files), not from one of its files")
    config_path = path / "config.json"
    raw = read_json_object(config_path)  # refuses a missing config.json, or one that is not a file
    source = SafetensorsSource(path)
    by_canon: dict[str, str] = {}
    for name in source.names():
        canon = canonical_name(name)
        if canon in by_canon:
            raise CheckpointError(f"{source.where}: tensors {by_canon[canon]!r} and {name!r} name the same weight")
        by_canon[canon] = name
    has_fc_norm = any(c.startswith("fc_norm.") for c in by_canon)
    fc_shape = source.shape(by_canon["fc.weight"]) if "fc.weight" in by_canon else ()
    tc = target_config
    config = parse_draft_config(raw, str(config_path), target_hidden_size=tc.hidden_size,
                                target_vocab_size=tc.vocab_size, default_aux_layer_ids=tc.default_aux_layer_ids,
                                has_fc_norm=has_fc_norm, target_num_layers=tc.num_layers,
                                stored_fc_width=fc_shape[1] if len(fc_shape) == 2 else None,
                                stored_fc_where=source.where)
    _check_sizes_stored(source, config, str(config_path))
    with torch.device("meta"):
        head = Eagle3Head(config)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    expected["d2t"] = (config.draft_vocab_size,)
    required = {k for k in expected if k not in _OPTIONAL}
    present = set(by_canon)
    missing = sorted(required - present)
    unknown = sorted(by_canon[c] for c in present - set(expected) if not _IGNORED.search(c))
    for canon in sorted(present & set(expected)):  # first: a quantized head's scale tensors would read as unknown
        name, dtype = by_canon[canon], source.dtype(by_canon[canon])
        if canon != "d2t":
            check_weight_dtype(source.where, name, dtype)
        elif not dtype.startswith(("I", "U")):  # I8..I64, U8..U64; not F*, BOOL
            raise CheckpointError(f"{source.where}: tensor {name!r} is stored as {dtype}; d2t must hold integer id "
                                  "offsets")
    check_names(source.where, missing, unknown)
    for canon in present & set(expected):
        shape = source.shape(by_canon[canon])
        try:
            check_shape(source.where, by_canon[canon], shape, expected[canon])
        except CheckpointError as err:
            if canon not in ("d2t", "lm_head.weight") or not shape or shape[0] == config.draft_vocab_size:
                raise
            # a config without draft_vocab_size read as "the model expects (256,)", naming no field to set
            raise CheckpointError(f"{err}; the draft vocabulary size {config.draft_vocab_size} comes from "
                                  f"{config_path}'s draft_vocab_size (absent: the target's vocab_size)") from None
    if config.draft_vocab_size != config.vocab_size and "d2t" not in present:
        raise CheckpointError(f"{source.where}: draft_vocab_size {config.draft_vocab_size} < vocab_size "
                              f"{config.vocab_size} but the checkpoint has no 'd2t' mapping")
    remapped = False
    if "d2t" in present:  # one int per draft id, read now: a bad mapping must not wait for the target's weights
        d2t = source.get(by_canon["d2t"]).long()
        _target_ids(source.where, d2t, config.vocab_size)
        remapped = bool((d2t != 0).any())
    # The target's lm_head rows are in target-id order; a draft row d must score target id d + d2t[d], so
    # any non-zero d2t (a smaller draft vocabulary, or a full-size one in another order) needs them gathered.
    target_order = config.draft_vocab_size == config.vocab_size and not remapped
    unread = set()
    if embeddings == "target":
        unread = {"embed_tokens.weight"} | ({"lm_head.weight"} if target_order else set())
    unread &= present
    gathers = not target_order and "lm_head.weight" not in present
    return DraftPlan(config, source, by_canon, expected, _target_sizes(tc), embeddings, frozenset(unread), gathers)


def check_embeddings(embeddings) -> None:
    """``embeddings`` is one of `EMBEDDINGS`, else a ValueError naming them."""
    if not isinstance(embeddings, str) or embeddings not in EMBEDDINGS:
        raise ValueError(f"embeddings must be one of {', '.join(map(repr, EMBEDDINGS))}, got {embeddings!r}")


def load_draft(path: str | Path | DraftPlan, target: MiniMaxM3ForCausalLM, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None, *, embeddings: str | None = None) -> Eagle3Head:
    """Build an `Eagle3Head` for `target` from an Eagle3 checkpoint directory (or its `inspect_draft`
    plan, checked before the target's weights were read). ``dtype`` and ``device`` default to the
    target's; a head that shares the target's embedding or lm_head must be in them. ``embeddings``:
    "target" (default) or "own" (the module docstring); a plan carries its own."""
    if embeddings is not None:
        check_embeddings(embeddings)
    if isinstance(path, DraftPlan) and embeddings not in (None, path.embeddings):
        raise ValueError(f"embeddings={embeddings!r}, but the draft plan was inspected with "
                         f"embeddings={path.embeddings!r}: pass it to inspect_draft")
    embed = target.embed_tokens.weight
    dtype = embed.dtype if dtype is None else dtype
    check_compute_dtype(dtype)
    device = embed.device if device is None else torch.device(device)
    plan = path if isinstance(path, DraftPlan) else inspect_draft(path, target.config,
                                                                   embeddings=embeddings or "target")
    if plan.target != _target_sizes(target.config):  # its checks hold for that target only
        raise ValueError(f"{plan.source.where}: the draft plan was checked against a target of hidden size, "
                         f"vocabulary and layers {plan.target}, not this one's {_target_sizes(target.config)}")
    config, source, by_canon = plan.config, plan.source, plan.by_canon
    with torch.device("meta"):
        head = Eagle3Head(config)

    tensors = source.get_many([by_canon[c] for c in plan.read])
    state = {c: tensors[by_canon[c]] for c in plan.read}
    own = set(state)  # what the checkpoint ships, before the target fills in the rest
    d2t = state.pop("d2t", None)
    if d2t is not None:
        if not is_integer_dtype(d2t.dtype):
            raise CheckpointError(f"{source.where}: d2t must hold integer id offsets, got dtype {d2t.dtype}")
        d2t = d2t.to(device=device, dtype=torch.long)
        target_ids = _target_ids(source.where, d2t, config.vocab_size)
    shared = {}
    if "embed_tokens.weight" not in state:
        shared["embed_tokens"] = target.embed_tokens
    if "lm_head.weight" not in state:
        if plan.gathers_lm_head:
            # gathered on the target's device (indices elsewhere failed: "indices should be either on cpu or
            # on the same device as the indexed tensor"), then moved to the head's below, as a shipped one is
            rows = target.lm_head.weight.detach()
            state["lm_head.weight"] = rows[target_ids.to(rows.device)].clone()
        else:
            shared["lm_head"] = target.lm_head
    if shared and not (dtype == embed.dtype and _same_device(device, embed.device)):
        # the first forward failed mixing them ("expected m1 and m2 to have the same dtype")
        # a hint only where 'own' shares nothing: a module the checkpoint lacks is the target's under either choice
        own_shares_none = all(f"{name}.weight" in plan.unread for name in shared)
        ships = " (or load with embeddings='own' to use the ones the checkpoint ships)" if own_shares_none else ""
        raise ValueError(f"{source.where}: the head shares the target's {' and '.join(shared)} ({embed.dtype} on "
                         f"{embed.device}), so it must be loaded in that dtype and device, got {dtype} on "
                         f"{device}{ships}")
    for name in shared:
        delattr(head, name)
        setattr(head, name, nn.Identity())  # placeholder so load_state_dict skips it
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    head.load_state_dict(state, strict=True, assign=True)
    for name, module in shared.items():
        setattr(head, name, module)
    # What the loader built from the target (shared, or its lm_head rows gathered): training keeps it
    # as the target has it, since the next load rebuilds it from the target, not from this checkpoint.
    head.from_target = tuple(name for name in ("embed_tokens", "lm_head") if f"{name}.weight" not in own)
    head.d2t = d2t
    head.rotary = RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
    return head.eval().requires_grad_(False)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` name one device when 0 is the current one."""
    if a.type != b.type:
        return False
    current = torch.cuda.current_device() if a.type == "cuda" and None in (a.index, b.index) else None
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _target_ids(where: str, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft id d's target id, d + d2t[d]; each must be its own id of the target vocabulary."""
    target_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size:
        raise CheckpointError(f"{where}: d2t maps draft ids outside the target vocabulary")
    _check_one_to_one(where, target_ids)
    return target_ids


def _check_one_to_one(where: str, target_ids: torch.Tensor) -> None:
    """Two draft ids scoring one target id would leave that id with either row's logit, unspecified which."""
    values, counts = torch.unique(target_ids, return_counts=True)
    if bool((counts == 1).all()):
        return
    repeated = int(values[counts > 1][0])
    draft_ids = (target_ids == repeated).nonzero().flatten().tolist()
    raise CheckpointError(f"{where}: d2t maps draft ids {draft_ids} to the same target id {repeated}; "
                          "each draft id must name its own target id")


__all__ = ["EMBEDDINGS", "CheckpointError", "DraftPlan", "canonical_name", "check_embeddings", "inspect_draft",
           "load_draft", "parse_draft_config"]
