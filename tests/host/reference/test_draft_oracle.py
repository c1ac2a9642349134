"""Every Eagle3 proposal the engine makes (not only the first) equals a naive head written here in
plain torch from the draft checkpoint's tensors, fed transformers' hidden states of the committed
tokens: position p reads (token p + 1, aux features of p) over a fresh dense cache, then K - 1
single steps on the head's own hidden. Later proposals follow verify steps: the random head's drafts
are all rejected (the rejected draft KV must be rewritten), and under forced acceptance some or all of
them are accepted (the loop must restart at the last accepted token, at its position)."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from m3_eagle_plugin.host.reference.build import blocks_for_prompts, build_engine
from m3_eagle_plugin.host.reference.cuda_graphs import GenerationGraphs
from m3_eagle_plugin.host.reference.engine import EngineConfig

NEW, K = 8, 3


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):  # x [T, H, D]: rotate-half over the whole head
    d = x.shape[-1]
    angles = positions.float()[:, None] / theta ** (torch.arange(0, d, 2).float() / d)
    angles = torch.cat([angles, angles], -1)[:, None]
    return x * angles.cos() + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * angles.sin()


class NaiveHead:
    def __init__(self, draft_dir, hf):
        self.c = json.loads((draft_dir / "config.json").read_text())
        self.w = {k.replace("midlayer.", ""): v.float() for k, v in load_file(draft_dir / "model.safetensors").items()}
        self.embed, self.lm_head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
        self.aux = sorted(self.c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(self, ids, g, positions):
        c, w, eps = self.c, self.w, self.c["rms_norm_eps"]
        hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        h = _rms(g, w["hidden_norm.weight"], eps)
        x = torch.cat([_rms(self.embed[ids], w["input_layernorm.weight"], eps), h], -1)
        q = _rope((x @ w["self_attn.q_proj.weight"].T).view(len(ids), nh, hd), positions, c["rope_theta"])
        k = _rope((x @ w["self_attn.k_proj.weight"].T).view(len(ids), nkv, hd), positions, c["rope_theta"])
        v = (x @ w["self_attn.v_proj.weight"].T).view(len(ids), nkv, hd)
        self.kv.update({p: (kp, vp) for p, kp, vp in zip(positions.tolist(), k, v)})
        rows = []
        for qp, p in zip(q, positions.tolist()):
            keys = torch.stack([self.kv[j][0] for j in range(p + 1)]).repeat_interleave(nh // nkv, 1)
            values = torch.stack([self.kv[j][1] for j in range(p + 1)]).repeat_interleave(nh // nkv, 1)
            weights = (torch.einsum("hd,shd->hs", qp, keys) / math.sqrt(hd)).softmax(-1)
            rows.append(torch.einsum("hs,shd->hd", weights, values).reshape(-1))
        y = g + torch.stack(rows) @ w["self_attn.o_proj.weight"].T  # residual = g (norm_before_residual off)
        n = _rms(y, w["post_attention_layernorm.weight"], eps)
        z = y + (F.silu(n @ w["mlp.gate_proj.weight"].T) * (n @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        z = _rms(z, w["norm.weight"], eps)  # norm_output: the next step reads the post-norm hidden
        return z @ self.lm_head.T, z

    def drafts(self, tokens, hidden_states):
        n = len(tokens)
        aux = [_rms(hidden_states[i][0, :n - 1], self.w[f"fc_norm.{j}.weight"], self.c["rms_norm_eps"])
               for j, i in enumerate(self.aux)]
        self.kv = {}
        logits, hidden = self.step(torch.tensor(tokens[1:]), torch.cat(aux, -1) @ self.w["fc.weight"].T,
                                   torch.arange(n - 1))
        logits, hidden = logits[-1:], hidden[-1:]
        out = []
        for step in range(K):
            out.append(int(logits[0].argmax()))
            if step + 1 < K:
                logits, hidden = self.step(torch.tensor(out[-1:]), hidden, torch.tensor([n - 1 + step]))
        return out


# None: the random head's own verdict (every draft rejected); 1.5 and 2.5: 1, 2, 1, ... and 2, 3, 2, ...
# drafts taken per verify step, so later proposals also start after partly and fully accepted rows.
# `graphs`: decode steps through the fixed-shape step CUDA graphs capture (run eagerly here).
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-step"])
@pytest.mark.parametrize("force_accepted", [None, 1.5, 2.5])
def test_every_proposal_matches_a_naive_eagle3_head_on_transformers_features(tiny_pair, force_accepted, graphs):
    from transformers import MiniMaxM3SparseForConditionalGeneration

    target_dir, draft_dir = tiny_pair
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 14, 23)]
    config = EngineConfig(draft_len=K, max_batch_size=2, max_tokens_per_step=9, force_accepted=force_accepted)
    engine = build_engine(target_dir, draft_dir, config, num_blocks=blocks_for_prompts(prompts, NEW, K, 4))
    if graphs:
        engine.runner.graphs = GenerationGraphs(engine.runner, capture=False)
    seen, commit = [], engine.commit

    def spy(out, requests, progress):  # the drafts each request holds once its step is committed
        commit(out, requests, progress)
        for j, row_index in enumerate(out.drafting_rows):
            request = out.rows[row_index].request
            if not request.done:
                seen.append((request.prompt + request.output, out.next_inputs[j, 1:].tolist()))

    engine.commit = spy
    stats = engine.generate(prompts, NEW).stats
    assert stats.accepted_tokens < stats.draft_tokens  # rejections: their draft KV must be rewritten
    if force_accepted is not None:
        assert stats.accepted_tokens > 0
    if graphs:
        assert engine.runner.graphs.buckets  # some decode steps ran the fixed-shape step
    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation="eager").eval()
    naive = NaiveHead(draft_dir, hf)
    assert len(seen) > len(prompts)  # later proposals too, not only the first one per request
    with torch.no_grad():
        for tokens, drafts in seen:
            states = hf(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
            assert drafts == naive.drafts(tokens, states), f"after {len(tokens)} tokens"
