"""Eagle3 heads written exactly as public exporters write them, checked against a naive forward.

The checkpoints here are built by hand from the public definitions, not from `models.tiny`:
- "classic" EAGLE-3 (SafeAILab `traineagle3` / SpecForge export): `midlayer.*`, `fc`, `norm`, a
  draft-vocabulary `lm_head`, `d2t` (int64, target = draft + d2t[draft]) and `t2d` (bool mask),
  no `embed_tokens`, no `eagle_config` (so the default aux layers), no `head_dim` key, bf16 tensors;
- "3.1" (TorchSpec / vLLM `fc_norm` + `norm_output`, e.g. Inferact/MiniMax-M3-EAGLE3): `layers.0.*`,
  `fc_norm.{0,1,2}` switched on by the config flag `fc_norm`, no `lm_head` / `embed_tokens` / `d2t`;
- `norm_before_fc` (vLLM / TensorRT-LLM / SGLang): one `input_norm` RMSNorm over the whole
  `n * target_hidden` aux row before `fc`.

The reference below is written from those definitions alone (float64, whole history, no cache):
  g  = fc(fc_norm_i(aux chunk i) ...)       (first step; later steps feed the head's own hidden)
  x  = cat(input_layernorm(embed(ids)), hidden_norm(g))           q/k/v: 2H -> heads
  y  = r + o_proj(causal GQA attention with NeoX RoPE over the full head)
       r  = hidden_norm(g) with `norm_before_residual` (vLLM's `_residual_norm`), else g
  z  = y + down(silu(gate(m)) * up(m)),  m = post_attention_layernorm(y)
  logits[d + d2t[d]] = lm_head(norm(z))[d], -inf elsewhere; next hidden = norm(z) if norm_output else z
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from m3_eagle_plugin.eagle3.checkpoint import CheckpointError, load_draft
from m3_eagle_plugin.models.loader import load_target
from m3_eagle_plugin.models.tiny import HIDDEN, LAYERS, VOCAB, make_tiny
from tests.models._oracle import PagedRunner

H, I, HEADS, KV_HEADS, VD = HIDDEN, 96, 4, 2, 96
D = H // HEADS


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    target_dir, _ = make_tiny(tmp_path_factory.mktemp("tiny"), seed=5)
    return load_target(target_dir)


def _rand(gen, *shape, scale=0.1):
    return torch.randn(*shape, generator=gen) * scale


def write_public_head(path, *, prefix, fc_norm=False, input_norm=False, lm_head=False, d2t=None,
                      config_extra=None, dtype=torch.bfloat16, seed=0):
    """A one-layer `LlamaForCausalLMEagle3` head in the public tensor layout; returns (tensors, config)."""
    gen = torch.Generator().manual_seed(seed)
    p = prefix
    t = {
        "fc.weight": _rand(gen, H, 3 * H),
        p + "input_layernorm.weight": 1 + _rand(gen, H), p + "hidden_norm.weight": 1 + _rand(gen, H),
        p + "post_attention_layernorm.weight": 1 + _rand(gen, H),
        p + "self_attn.q_proj.weight": _rand(gen, HEADS * D, 2 * H),
        p + "self_attn.k_proj.weight": _rand(gen, KV_HEADS * D, 2 * H),
        p + "self_attn.v_proj.weight": _rand(gen, KV_HEADS * D, 2 * H),
        p + "self_attn.o_proj.weight": _rand(gen, H, HEADS * D),
        p + "mlp.gate_proj.weight": _rand(gen, I, H), p + "mlp.up_proj.weight": _rand(gen, I, H),
        p + "mlp.down_proj.weight": _rand(gen, H, I),
        "norm.weight": 1 + _rand(gen, H),
    }
    if fc_norm:
        t.update({f"fc_norm.{i}.weight": 1 + _rand(gen, H) for i in range(3)})
    if input_norm:
        t["input_norm.weight"] = 1 + _rand(gen, 3 * H)
    if lm_head:
        t["lm_head.weight"] = _rand(gen, VD if d2t is not None else VOCAB, H, scale=0.3)
    t = {k: v.to(dtype) for k, v in t.items()}
    if d2t is not None:
        t["d2t"] = d2t.to(torch.int64)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t] = True
        t["t2d"] = t2d
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bos_token_id": 0, "eos_token_id": 1,
        "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I,
        "max_position_embeddings": 2048, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-5, "rope_scaling": None,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": VOCAB, "draft_vocab_size": VD if d2t is not None else VOCAB, "target_hidden_size": H,
    }
    config.update(config_extra or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return {k: v for k, v in t.items()}, config


# ---------------------------------------------------------------- reference from the public formulas

def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)[:, None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * ang.cos() + rot * ang.sin()


def public_reference(t, config, target, ids, rows):
    """Logits `[T, V]` in target ids and next-step hidden `[T, H]` for a whole history."""
    t = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    eagle = config.get("eagle_config") or {}
    norm_output = config.get("norm_output", False) or eagle.get("return_hidden_post_norm", False)
    # vLLM's `_residual_norm`: with norm_before_residual the residual is hidden_norm(g), else g itself
    norm_before_residual = config.get("norm_before_residual", eagle.get("norm_before_residual", False))
    p = "midlayer." if any(k.startswith("midlayer.") for k in t) else "layers.0."
    g = []
    for r in rows:
        r = r.double()
        if r.shape[-1] == 3 * H:
            if "input_norm.weight" in t:
                r = _rms(r, t["input_norm.weight"], eps)
            if config.get("fc_norm", False):
                r = torch.cat([_rms(c, t[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(r.chunk(3))])
            r = r @ t["fc.weight"].T
        g.append(r)
    g = torch.stack(g)
    emb = target.embed_tokens.weight.double()[ids]
    hn = _rms(g, t[p + "hidden_norm.weight"], eps)
    x = torch.cat([_rms(emb, t[p + "input_layernorm.weight"], eps), hn], -1)
    T, pos = len(ids), torch.arange(len(ids))
    q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).view(T, HEADS, D), pos, theta)
    k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).view(T, KV_HEADS, D), pos, theta)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(T, KV_HEADS, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.stack([torch.softmax(((q[:, h] @ k[:, h // (HEADS // KV_HEADS)].T) / D ** 0.5)
                                     .masked_fill(~causal, float("-inf")), -1) @ v[:, h // (HEADS // KV_HEADS)]
                       for h in range(HEADS)], 1)
    y = (hn if norm_before_residual else g) + out.reshape(T, -1) @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(y, t[p + "post_attention_layernorm.weight"], eps)
    z = y + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
        @ t[p + "mlp.down_proj.weight"].T
    n = _rms(z, t["norm.weight"], eps)
    lm = t["lm_head.weight"] if "lm_head.weight" in t else target.lm_head.weight.double()
    d2t = t.get("d2t")
    if d2t is None:
        logits = n @ lm.T
    else:
        target_ids = torch.arange(len(d2t)) + d2t
        if "lm_head.weight" not in t:
            lm = lm[target_ids]
        logits = torch.full((T, VOCAB), float("-inf"), dtype=torch.float64)
        logits[:, target_ids] = n @ lm.T
    return logits, (n if norm_output else z)


def run_two_steps(head, target, t, config, n_aux=6, n_own=3, seed=1):
    """Step 1 feeds aux rows for `n_aux` tokens; step 2 feeds the head's own last hidden for `n_own`
    tokens. Compares both steps' logits and next hidden with the reference over the whole history."""
    gen = torch.Generator().manual_seed(seed)
    runner = PagedRunner(target.config, num_blocks=32, draft_num_kv_heads=head.config.num_kv_heads)
    ids = torch.randint(0, VOCAB, (n_aux + n_own,), generator=gen)
    aux = torch.randn(n_aux, 3 * H, generator=gen) * 3
    with torch.no_grad():
        runner.prepare([("r", n_aux)])
        logits1, nxt1 = head(ids[:n_aux], aux, runner.meta, runner.cache)
        own = nxt1[-1:].expand(n_own, H).clone()
        runner.prepare([("r", n_own)])
        logits2, nxt2 = head(ids[n_aux:], own, runner.meta, runner.cache)
    want_logits, want_next = public_reference(t, config, target, ids, list(aux) + list(own))
    got_logits = torch.cat([logits1, logits2]).double()
    finite = torch.isfinite(want_logits)
    assert torch.equal(torch.isfinite(got_logits), finite)
    torch.testing.assert_close(got_logits[finite], want_logits[finite], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([nxt1, nxt2]).double(), want_next, atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------- the layouts

def test_classic_eagle3_export_with_reduced_vocab(target, tmp_path):
    d2t = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:VD]).values - torch.arange(VD)
    t, config = write_public_head(tmp_path / "d", prefix="midlayer.", lm_head=True, d2t=d2t)
    head = load_draft(tmp_path / "d", target)
    assert head.aux_layer_ids == (2, LAYERS // 2, LAYERS - 3)  # no eagle_config: the EAGLE/vLLM default
    assert head.config.head_dim == H // HEADS and head.config.rope_theta == 500000.0
    assert not head.config.norm_output and head.fc_norm is None
    run_two_steps(head, target, t, config)


def test_eagle3_1_fc_norm_and_norm_output_sharing_the_target_vocabulary(target, tmp_path):
    extra = {"fc_norm": True, "norm_output": True, "num_aux_hidden_states": 3,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}}
    t, config = write_public_head(tmp_path / "d", prefix="layers.0.", fc_norm=True, config_extra=extra)
    head = load_draft(tmp_path / "d", target)
    assert head.lm_head is target.lm_head and head.embed_tokens is target.embed_tokens
    run_two_steps(head, target, t, config)


def test_fc_norm_flag_without_its_tensors_is_an_error(target, tmp_path):
    """`fc_norm: true` builds the per-chunk norms (vLLM, TensorRT-LLM); a checkpoint that lacks them
    must not load as a head without them."""
    write_public_head(tmp_path / "d", prefix="layers.0.", config_extra={"fc_norm": True})
    with pytest.raises(CheckpointError, match=r"fc_norm\.0\.weight"):
        load_draft(tmp_path / "d", target)


def test_norm_before_fc_applies_one_norm_over_the_whole_aux_row(target, tmp_path):
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "norm_before_fc": True}}
    t, config = write_public_head(tmp_path / "d", prefix="midlayer.", input_norm=True, config_extra=extra)
    head = load_draft(tmp_path / "d", target)
    run_two_steps(head, target, t, config)


def test_trtllm_return_hidden_post_norm_means_norm_output(target, tmp_path):
    extra = {"eagle_config": {"return_hidden_post_norm": True}}
    t, config = write_public_head(tmp_path / "d", prefix="midlayer.", config_extra=extra)
    head = load_draft(tmp_path / "d", target)
    assert head.config.norm_output
    run_two_steps(head, target, t, config)


def test_aux_ids_are_concatenated_in_layer_order(target, tmp_path):
    """vLLM and SGLang append aux states while walking the layers, TensorRT-LLM sorts its capture
    ids: the `fc` input is always in ascending layer order, whatever order the config lists."""
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 2, 4]}}
    write_public_head(tmp_path / "d", prefix="midlayer.", config_extra=extra)
    assert load_draft(tmp_path / "d", target).aux_layer_ids == (2, 4, 5)


def test_fc_norm_tensors_that_the_config_switches_off_are_refused(target, tmp_path):
    write_public_head(tmp_path / "d", prefix="midlayer.", fc_norm=True, config_extra={"fc_norm": False})
    with pytest.raises(CheckpointError, match=r"unknown tensor\(s\): fc_norm\.0\.weight"):
        load_draft(tmp_path / "d", target)


def test_norm_before_residual_adds_the_attention_to_the_normed_hidden(target, tmp_path):
    """`norm_before_residual` (vLLM / SpecForge): the residual around attention is hidden_norm(g),
    not g. The flag may sit in eagle_config; a flat one is read too."""
    for where, extra in (("eagle", {"eagle_config": {"norm_before_residual": True}}),
                         ("flat", {"norm_before_residual": True, "norm_output": True})):
        t, config = write_public_head(tmp_path / where, prefix="midlayer.", config_extra=extra)
        head = load_draft(tmp_path / where, target)
        assert head.config.norm_before_residual
        run_two_steps(head, target, t, config)


def test_a_large_rms_norm_eps_reaches_every_norm(target, tmp_path):
    """Every RMSNorm of the head (input_norm, fc_norm.i, input_layernorm, hidden_norm,
    post_attention_layernorm, norm) must use the config's `rms_norm_eps`. With eps = 1.0 (inputs
    of mean square ~0.1 to 20) a norm falling back to a default 1e-6 / 1e-5 moves the outputs far past
    the tolerance."""
    extra = {"rms_norm_eps": 1.0, "fc_norm": True, "norm_output": True,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "norm_before_fc": True}}
    t, config = write_public_head(tmp_path / "d", prefix="midlayer.", fc_norm=True, input_norm=True,
                                  config_extra=extra)
    head = load_draft(tmp_path / "d", target)
    assert head.config.rms_norm_eps == 1.0
    run_two_steps(head, target, t, config)


def test_fc_norm_tensors_switch_the_norms_on_when_the_config_says_nothing(target, tmp_path):
    """Without an `fc_norm` key the tensors decide: a checkpoint holding fc_norm.{0,1,2} runs them
    (the reference is told so explicitly)."""
    t, config = write_public_head(tmp_path / "d", prefix="layers.0.", fc_norm=True, config_extra={"norm_output": True})
    assert "fc_norm" not in config
    head = load_draft(tmp_path / "d", target)
    assert head.fc_norm is not None
    run_two_steps(head, target, t, dict(config, fc_norm=True))
