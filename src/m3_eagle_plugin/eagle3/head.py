"""The Eagle3 draft head for MiniMax-M3 (a one-layer Llama drafter fed by target hidden states).

One step (reference §4.3): on the first draft step the incoming hidden is the target's aux
capture `[T, n*H]` (chunks in ascending layer order); with `norm_before_fc` one plain RMSNorm
(`input_norm`) normalises the whole row, then each chunk gets its own plain RMSNorm
(`fc_norm.{i}`, only when the checkpoint has them), the chunks are concatenated and `fc` maps
them to H. Later steps feed the head's own `[T, H]` output and skip `fc`. Then
    e = input_layernorm(embed(ids)); h = hidden_norm(g); x = concat(e, h)   # [T, 2H]
    y = residual + o_proj(attn(q(x), k(x), v(x)))   residual = g (or h if norm_before_residual)
    z = y + mlp(post_attention_layernorm(y)); logits = lm_head(norm(z))
Attention is dense causal with Llama RoPE over the full head and no q/k norm; GQA or MHA from
`num_key_value_heads`. Its K/V live in the target cache's first draft layer
(`cache.draft_layer_ids[0]`). The next-step hidden is `norm(z)` when `norm_output`, else `z`.

Vocabulary: the head scores `Vd` draft tokens; draft id d means target id `d + d2t[d]`.
`forward` returns logits already placed in the target vocabulary (`[T, V]`, fp32, `-inf` for
target ids outside the draft vocabulary), so argmax / softmax give target ids directly;
`draft_logits` + `draft_to_target` expose the compact form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from m3_eagle_plugin.msa import kernels
from m3_eagle_plugin.models import fused_ops
from m3_eagle_plugin.models.norms import LlamaRMSNorm
from m3_eagle_plugin.models.rope import RopeAt, RotaryEmbedding
from m3_eagle_plugin.msa.blocks import check_page_size, is_integer_dtype


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # target vocabulary (embedding rows, logits width after d2t)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    norm_output: bool = False
    norm_before_residual: bool = False
    has_fc_norm: bool = False
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`) over the whole aux row before fc_norm / fc

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1:  # the multiple check below divided by zero
            raise ValueError(f"draft num_key_value_heads must be >= 1, got {self.num_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"draft num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        aux_width = len(self.aux_layer_ids) * self.target_hidden_size
        if aux_width in (0, self.hidden_size):  # forward tells the first step (aux rows, through fc) by width
            raise ValueError(f"{len(self.aux_layer_ids)} aux layer id(s) of target width {self.target_hidden_size} "
                             f"make an aux capture {aux_width} wide, which the head cannot tell from its own "
                             f"hidden ({self.hidden_size}): fc would never run")


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: RopeAt, meta: Any, cache: Any) -> torch.Tensor:
        t = x.shape[0]
        q, k = rope.qk(self.q_proj(x).view(t, self.num_heads, self.head_dim),
                       self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        layer = cache.draft_layer_ids[0]
        k_cache, v_cache = cache.k(layer), cache.v(layer)
        kernels.write_step_kv(k_cache, v_cache, meta.cache_slots, k.to(k_cache.dtype), v.to(v_cache.dtype))
        out = kernels.dense_attention(q, k_cache, v_cache, meta, scale=self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim).to(x.dtype))  # t may be 0: no -1


class SiluGluMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(h, eps)
        self.hidden_norm = LlamaRMSNorm(h, eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = SiluGluMLP(h, config.intermediate_size)

    def forward(self, embeds: torch.Tensor, g: torch.Tensor, rope: RopeAt, meta: Any, cache: Any) -> torch.Tensor:
        y, mlp_out = self.residual_parts(embeds, g, rope, meta, cache)
        return y + mlp_out

    def residual_parts(self, embeds: torch.Tensor, g: torch.Tensor, rope: RopeAt, meta: Any, cache: Any
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(y, mlp(post_attention_layernorm(y)))` whose sum is the layer output, so that the caller
        can fuse that last residual add with the norm that follows it."""
        h = self.hidden_norm(g)
        residual = h if self.norm_before_residual else g
        x = torch.cat((self.input_layernorm(embeds), h), dim=-1)
        y, normed = self.post_attention_layernorm.add_then_norm(residual, self.self_attn(x, rope, meta, cache))
        return y, self.mlp(normed)


def _reindex_vocabulary_after_load(head: "Eagle3Head", _incompatible_keys: Any) -> None:
    head._index_vocabulary()


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        n, ht, h = len(config.aux_layer_ids), config.target_hidden_size, config.hidden_size
        self.fc = nn.Linear(n * ht, h, bias=False)
        self.input_norm = LlamaRMSNorm(n * ht, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(LlamaRMSNorm(ht, config.rms_norm_eps) for _ in range(n))
                        if config.has_fc_norm else None)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config)])
        self.norm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        # Taken from the target, so frozen in training (`load_draft` says which; built here, both).
        self.from_target: tuple[str, ...] = ("embed_tokens", "lm_head")
        self.register_buffer("d2t", None)
        # Derived from d2t whenever it is assigned (see __setattr__), so no step recomputes them:
        # draft id -> target id `[Vd]`, and target id -> draft id or -1 `[V]` (int32; None unless
        # d2t is one-to-one into the target vocabulary).
        self.register_buffer("target_ids", None, persistent=False)
        self.register_buffer("draft_index", None, persistent=False)
        self._targets_in_vocab = True  # every d + d2t[d] in [0, vocab_size): read where logits are placed
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # `load_state_dict` copies into an existing d2t in place, past `__setattr__`.
        self.register_load_state_dict_post_hook(_reindex_vocabulary_after_load)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "d2t" and value is not None and not (
                isinstance(value, torch.Tensor) and value.dim() == 1 and is_integer_dtype(value.dtype)):
            # refused before it is stored: a float d2t failed only inside the index build, half assigned
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"d2t must be a 1-D integer tensor of id offsets, got {got}")
        super().__setattr__(name, value)
        if name == "d2t":
            self._index_vocabulary()

    def _index_vocabulary(self) -> None:
        d2t = self.d2t
        if d2t is None:
            self.target_ids = self.draft_index = None
            self._targets_in_vocab = True
            return
        draft_ids = torch.arange(d2t.shape[0], device=d2t.device)
        target_ids = draft_ids + d2t
        self.target_ids = target_ids
        self.draft_index = None
        vocab = self.config.vocab_size
        in_range = bool(((target_ids >= 0) & (target_ids < vocab)).all())  # a host sync, once per assignment
        self._targets_in_vocab = in_range
        if in_range and torch.unique(target_ids).numel() == d2t.shape[0]:
            index = torch.full((vocab,), -1, dtype=torch.int32, device=d2t.device)
            index[target_ids] = draft_ids.to(torch.int32)
            self.draft_index = index

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose input residual stream feeds `fc` (build `AuxCapture` from these)."""
        return self.config.aux_layer_ids

    def combine_aux(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[T, n*H_target]` aux capture -> `[T, H]` (input_norm over the row, fc_norm per chunk, then fc)."""
        if self.input_norm is not None:
            hidden = self.input_norm(hidden)
        if self.fc_norm is not None:
            chunks = hidden.chunk(len(self.fc_norm), dim=-1)
            hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(hidden)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity without `d2t`)."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 `[T, Vd]` logits over the draft vocabulary from the post-norm hidden."""
        return self.lm_head(hidden).float()

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`[T, Vd]` draft logits -> `[T, V]` (same dtype), `-inf` at target ids outside the draft vocabulary."""
        if self.d2t is None:
            width, vocab = logits.shape[-1], self.config.vocab_size
            if width > vocab:  # no draft vocabulary is wider than the target's
                raise ValueError(f"logits score {width} ids, more than the target's vocab_size {vocab}")
            if width < vocab:  # the draft ids would be read as target ids
                raise ValueError(f"draft_vocab_size {width} < vocab_size {vocab} needs a d2t mapping draft ids to "
                                 f"target ids; this head has none")
            return logits
        self._check_draft_width(logits)
        if not self._targets_in_vocab:
            # the scatter below read a target id of -1 as V - 1 (draft d's logit scored the last target id,
            # where draft_to_target says -1) and failed on V with a bare IndexError
            ids = self.target_ids
            bad = ((ids < 0) | (ids >= self.config.vocab_size)).nonzero().flatten()[:4].tolist()
            raise ValueError(f"d2t maps draft ids {bad} to target ids {ids[bad].tolist()} outside the target "
                             f"vocabulary [0, {self.config.vocab_size}): draft id d means target id d + d2t[d]")
        if logits.dtype == torch.float32 and self.draft_index is not None:
            fused = fused_ops.gather_logits(logits, self.draft_index)
            if fused is not None:
                return fused
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        out[:, self.target_ids] = logits
        return out

    def _check_draft_width(self, logits: torch.Tensor) -> None:
        # the fused gather reads each row at the draft ids d2t maps: a row of another width is read
        # past its end (or in part), where the torch scatter fails with a bare shape mismatch; one
        # unbatched [Vd] row was broadcast into Vd rows of [V]
        if logits.dim() != 2:
            raise ValueError(f"draft logits must be [T, Vd], got shape {tuple(logits.shape)}")
        if logits.shape[-1] != self.d2t.shape[0]:
            raise ValueError(f"logits score {logits.shape[-1]} draft ids but d2t maps {self.d2t.shape[0]}")

    def _target_logits(self, lm_head_out: torch.Tensor) -> torch.Tensor:
        """fp32 `[T, V]` logits from the raw `lm_head` output; cast and placement in one launch on GPU."""
        if self.d2t is not None and self.draft_index is not None:
            self._check_draft_width(lm_head_out)
            fused = fused_ops.gather_logits(lm_head_out, self.draft_index)
            if fused is not None:
                return fused
        return self.to_target_logits(lm_head_out.float())

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: Any, cache: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (fp32 logits `[T, V]` in target ids, next-step hidden `[T, H]`); `hidden` (floating
        point) is taken in the head's dtype."""
        if input_ids.dim() != 1 or hidden.dim() != 2 or hidden.shape[0] != input_ids.shape[0]:
            raise ValueError(f"expected input_ids [T] and hidden [T, width], got {tuple(input_ids.shape)} "
                             f"and {tuple(hidden.shape)}")
        if not hidden.is_floating_point():
            raise TypeError(f"hidden must be a floating-point tensor of hidden states, got {hidden.dtype}")
        # taken in the head's dtype, as `train.dense_head_step` takes it: fp32 aux (collected data, an fp32
        # target) into a bf16 head failed in fc with "expected m1 and m2 to have the same dtype"
        hidden = hidden.to(self.fc.weight.dtype)
        if hidden.shape[-1] == self.fc.in_features and self.fc.in_features != self.config.hidden_size:
            g = self.combine_aux(hidden)
        elif hidden.shape[-1] == self.config.hidden_size:
            g = hidden
        else:
            raise ValueError(f"hidden width {hidden.shape[-1]} is neither the aux width {self.fc.in_features} "
                             f"nor the draft hidden size {self.config.hidden_size}")
        if meta.positions.shape[0] != input_ids.shape[0]:  # as the target model refuses it (a reshape error)
            raise ValueError(f"input_ids has {input_ids.shape[0]} tokens, the step metadata "
                             f"{meta.positions.shape[0]}: prepare the metadata for this step's tokens")
        if not cache.draft_layer_ids:  # a target-only cache: [0] below was a bare IndexError
            raise ValueError(f"the cache hosts no draft layer for the Eagle3 head's K/V: build it with "
                             f"num_draft_layers=1, draft_num_kv_heads={self.config.num_kv_heads}")
        check_page_size(cache.k(cache.draft_layer_ids[0]), meta)  # before the draft layer writes its K/V
        rope = self.rotary.at(meta.positions)
        y, mlp_out = self.layers[0].residual_parts(self.embed_tokens(input_ids), g, rope, meta, cache)
        z, normed = self.norm.add_then_norm(y, mlp_out)
        logits = self._target_logits(self.lm_head(normed))
        return logits, (normed if self.config.norm_output else z)
