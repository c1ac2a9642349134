"""Self-distillation of the Eagle3 head: data against transformers, the dense path against the paged head.

References: transformers' MiniMax-M3 (labels and aux features of the collected data), the paged
`Eagle3Head.forward` on the shared cache (itself checked against a naive dense reference in
test_head.py) for both the plain step and the TTT pass, and the draft loop's positions/KV rule.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from m3_eagle_plugin.eagle3.checkpoint import load_draft
from m3_eagle_plugin.eagle3.train import (
    DistillData, DistillPlan, collect_distill_data, concat_data, dense_head_step, distill_checkpoint, distill_loss,
    train_head,
)
from m3_eagle_plugin.kv import PagedKVCache
from m3_eagle_plugin.models.loader import load_target
from m3_eagle_plugin.models.tiny import HIDDEN, VOCAB, make_tiny
from m3_eagle_plugin.msa.metadata import MsaDecodeMetadata

TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = make_tiny(tmp_path_factory.mktemp("train_tiny"), seed=4)
    target = load_target(target_dir)
    return target_dir, draft_dir, target, load_draft(draft_dir, target)


@pytest.fixture(scope="module")
def data(pair):
    # 3 sequences, 20 tokens, prompts of 3..6 tokens, 4 Jacobi rounds -> 12 rows
    return collect_distill_data(pair[2], pair[3].aux_layer_ids, num_sequences=3, seq_len=20, prompt_lens=(3, 6),
                                iterations=4, seed=1)


def _paged(target, head, num_blocks=32, dtype=torch.float32):
    tc, dc = target.config, head.config
    cache = PagedKVCache.for_minimax_m3(
        tc.num_layers, tc.sparse_layer_ids, tc.num_kv_heads, tc.head_dim, tc.index_dim, tc.block_size, num_blocks,
        num_draft_layers=1, draft_num_kv_heads=dc.num_kv_heads, dtype=dtype)
    meta = MsaDecodeMetadata(1, 64, num_blocks, tc.block_size, "cpu", num_index_heads=tc.index_heads)
    cache.add_request("r")
    return cache, meta


def test_collected_data_matches_transformers(pair, data):
    from transformers import MiniMaxM3SparseForConditionalGeneration

    target_dir, _, _, head = pair
    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(target_dir, dtype=torch.float32).eval()
    assert data.tokens.shape == (12, 20) and data.aux.shape == (12, 20, 3 * 64)
    with torch.no_grad():
        out = hf(input_ids=data.tokens, output_hidden_states=True)
    want_aux = torch.cat([out.hidden_states[i] for i in head.aux_layer_ids], dim=-1)
    torch.testing.assert_close(data.aux, want_aux, atol=TOL, rtol=0)
    torch.testing.assert_close(data.target_logprobs, out.logits.float().log_softmax(-1), atol=TOL, rtol=0)
    assert torch.equal(data.target_next, data.target_logprobs.argmax(-1))


def test_jacobi_rounds_converge_to_the_greedy_continuation(data):
    rounds = data.tokens.view(4, 3, 20)  # [round, sequence, position]
    for r in range(3):
        changed = (rounds[:, r] != rounds[0, r]).any(0).nonzero()
        prompt_len = int(changed[0])  # prompts never change; 3..6 tokens
        assert 3 <= prompt_len <= 6 and torch.equal(rounds[:, r, :prompt_len], rounds[:1, r, :prompt_len].expand(4, -1))
        last = 9 + r  # after 4 rounds the first 3 continuation tokens are the target's greedy choices
        for t in range(prompt_len, prompt_len + 3):
            assert data.tokens[last, t] == data.target_next[last, t - 1]


def _assert_dense_step_equals_paged_head(target, head, data) -> None:
    """The training step's dense head on the last sequence against the paged head the engine runs."""
    tokens, aux = data.tokens[-1], data.aux[-1]
    cache, meta = _paged(target, head)
    s = tokens.shape[0] - 1
    cache.reserve("r", s)
    meta.prepare([s], [s], cache.block_table(["r"]), num_context_requests=1)
    with torch.no_grad():
        want_logits, want_hidden = head(tokens[1:], aux[:s], meta, cache)
        logits, hidden, _ = dense_head_step(head, tokens[None, 1:], aux[None, :s])
    torch.testing.assert_close(logits[0], want_logits, atol=TOL, rtol=0)
    torch.testing.assert_close(hidden[0], want_hidden, atol=TOL, rtol=0)


def test_dense_step_equals_the_paged_head(pair, data):
    _, _, target, head = pair
    _assert_dense_step_equals_paged_head(target, head, data)


@pytest.mark.parametrize("chain_start", [0, 5, 11])
def test_ttt_passes_equal_the_draft_loop_steps(pair, data, chain_start):
    """Pass s at q is draft step s of the chain from p = q - s: step 0 over 0..p, then one token per step."""
    _, _, target, head = pair
    tokens, aux = data.tokens[-2], data.aux[-2]
    s = tokens.shape[0] - 1
    with torch.no_grad():
        dense, prior, hidden = [], [], aux[None, :s]
        for _ in range(3):
            logits, out, kv = dense_head_step(head, tokens[None, 1:], hidden, prior)
            dense.append(logits[0])
            prior.append(kv)
            hidden = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)
        cache, meta = _paged(target, head)
        p = chain_start
        cache.reserve("r", p + 3)
        meta.prepare([p + 1], [p + 1], cache.block_table(["r"]), num_context_requests=1)
        logits, out = head(tokens[1:p + 2], aux[:p + 1], meta, cache)
        torch.testing.assert_close(logits[-1], dense[0][p], atol=TOL, rtol=0)
        hidden = out[-1:]
        for step in (1, 2):
            meta.prepare([1], [p + 1 + step], cache.block_table(["r"]))
            logits, hidden = head(tokens[p + 1 + step:p + 2 + step], hidden, meta, cache)
            torch.testing.assert_close(logits[0], dense[step][p + step], atol=TOL, rtol=0)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(cut=st.integers(1, 18), passes=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_dense_step_is_causal(pair, cut, passes, seed):
    """Outputs at q < cut never depend on tokens, features or earlier-pass keys at positions >= cut."""
    head = pair[3]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1, 19), generator=gen)
    feats = torch.randn(1, 19, 3 * 64, generator=gen)
    prior = [(torch.randn(1, 2, 19, 16, generator=gen), torch.randn(1, 2, 19, 16, generator=gen))
             for _ in range(passes)]
    ids2, feats2 = ids.clone(), feats.clone()
    ids2[:, cut:] = torch.randint(0, 256, (1, 19 - cut), generator=gen)
    feats2[:, cut:] += torch.randn(1, 19 - cut, 3 * 64, generator=gen)
    prior2 = [(k.clone(), v.clone()) for k, v in prior]
    for k, v in prior2:
        k[:, :, cut:] += 1.0
        v[:, :, cut:] -= 1.0
    with torch.no_grad():
        a, ha, _ = dense_head_step(head, ids, feats, prior)
        b, hb, _ = dense_head_step(head, ids2, feats2, prior2)
    torch.testing.assert_close(a[:, :cut], b[:, :cut], atol=1e-5, rtol=0)
    torch.testing.assert_close(ha[:, :cut], hb[:, :cut], atol=1e-5, rtol=0)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(rows=st.lists(st.integers(0, 11), min_size=1, max_size=4), passes=st.integers(1, 2))
def test_loss_is_zero_exactly_when_the_head_matches_the_target(pair, data, rows, passes):
    """KL(target || head) >= 0, and with the head's own distribution as the soft label it vanishes."""
    head = pair[3]
    batch = data.select(torch.tensor(rows))
    with torch.no_grad():
        loss = distill_loss(head, batch, passes)
        logits, _, _ = dense_head_step(head, batch.tokens[:, 1:], batch.aux[:, :-1])
    assert float(loss) > 0
    own = torch.cat((logits.log_softmax(-1), torch.zeros_like(logits[:, :1])), dim=1)
    agreeing = DistillData(batch.tokens, batch.aux, batch.target_next, batch.lengths, torch.roll(own, 1, dims=1))
    with torch.no_grad():
        assert abs(float(distill_loss(head, agreeing, 1))) < 1e-5


def test_training_lowers_the_loss_and_keeps_the_shared_weights(pair, data, tmp_path):
    target_dir, draft_dir, target, _ = pair
    head = load_draft(draft_dir, target)
    embed, lm_head = target.embed_tokens.weight.clone(), target.lm_head.weight.clone()
    fc_before = head.fc.weight.clone()
    with torch.no_grad():
        before = float(distill_loss(head, data, 2))
    history = train_head(head, data, steps=30, batch_size=6, lr=1e-2, ttt_steps=2, seed=0)
    with torch.no_grad():
        after = float(distill_loss(head, data, 2))
    assert len(history) == 30 and after < 0.8 * before
    assert torch.equal(target.embed_tokens.weight, embed) and torch.equal(target.lm_head.weight, lm_head)
    assert target.embed_tokens.weight.grad is None and target.lm_head.weight.grad is None  # no gradient taken
    assert not torch.equal(head.fc.weight, fc_before)
    assert not head.training and not any(p.requires_grad for p in head.parameters())


def test_distill_checkpoint_is_deterministic_and_keeps_the_layout(tmp_path):
    plan = DistillPlan(steps=4, num_sequences=4, seq_len=16, iterations=2, batch_size=4)
    results = []
    for name in ("a", "b"):
        target_dir, draft_dir = make_tiny(tmp_path / name, seed=2)
        before = load_file(str(draft_dir / "model.safetensors"))
        history = distill_checkpoint(target_dir, draft_dir, plan=plan, seed=3)
        after = load_file(str(draft_dir / "model.safetensors"))
        assert len(history) == 4 and all(h == h for h in history)
        assert after.keys() == before.keys() and all(after[k].shape == before[k].shape for k in after)
        assert any(not torch.equal(after[k], before[k]) for k in after)
        load_draft(draft_dir, load_target(target_dir))  # still a valid public-layout checkpoint
        results.append(after)
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_bad_inputs_fail_with_the_cause(pair, data, tmp_path):
    target, head = pair[2], pair[3]
    with pytest.raises(ValueError, match="prompt_lens"):
        collect_distill_data(target, head.aux_layer_ids, num_sequences=2, seq_len=8, prompt_lens=(4, 9))
    with pytest.raises(ValueError, match="num_sequences"):
        collect_distill_data(target, head.aux_layer_ids, num_sequences=0, seq_len=8)
    with pytest.raises(ValueError, match="steps"):
        train_head(head, data, steps=0)
    with pytest.raises(ValueError, match="inconsistent"):
        DistillData(data.tokens, data.aux[:, :3], data.target_next, data.lengths, data.target_logprobs)
    short = collect_distill_data(target, head.aux_layer_ids, num_sequences=1, seq_len=8, prompt_lens=(2, 2),
                                 iterations=1)
    with pytest.raises(ValueError, match="different lengths"):
        concat_data([data, short])
    with pytest.raises(FileNotFoundError, match="no draft weights"):
        distill_checkpoint(pair[0], tmp_path, plan=DistillPlan(steps=1))


def test_passes_past_the_rows_end_leave_the_loss_finite(pair):
    """With 6-token rows only TTT passes 0..4 have a position to predict (pass s needs s + 2 tokens):
    asking for more passes must neither turn the loss into NaN nor change it."""
    target, head = pair[2], pair[3]
    short = collect_distill_data(target, head.aux_layer_ids, num_sequences=2, seq_len=6, prompt_lens=(2, 3),
                                 iterations=1, seed=1)
    with torch.no_grad():
        reachable = float(distill_loss(head, short, 5))
        asked = float(distill_loss(head, short, 8))
    assert reachable == reachable and asked == reachable
    trained = load_draft(pair[1], target)
    history = train_head(trained, short, steps=2, batch_size=2, ttt_steps=8)
    assert all(h == h for h in history)
    empty = DistillData(short.tokens, short.aux, short.target_next, torch.ones(2, dtype=torch.long),
                        short.target_logprobs)
    with pytest.raises(ValueError, match="no position to train"):
        distill_loss(head, empty, 1)


def test_a_failed_write_leaves_the_draft_checkpoint_intact(tmp_path, monkeypatch):
    import safetensors.torch

    from m3_eagle_plugin.models.tiny import MARKER

    target_dir, draft_dir = make_tiny(tmp_path, seed=2)
    weights = draft_dir / "model.safetensors"
    before = weights.read_bytes()

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(before[:100])  # what a write cut short leaves behind
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        distill_checkpoint(target_dir, draft_dir, plan=DistillPlan(steps=1, num_sequences=2, seq_len=16, iterations=1,
                                                                   batch_size=2))
    assert weights.read_bytes() == before
    assert sorted(p.name for p in draft_dir.iterdir()) == sorted([MARKER, "config.json", "model.safetensors"])


def _reduced_vocabulary_draft(draft_dir, out_dir, draft_vocab: int):
    """The draft checkpoint with a `draft_vocab`-id vocabulary: draft id d scores target id 2d."""
    import json
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(draft_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    tensors["d2t"] = torch.arange(draft_vocab)
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    config["draft_vocab_size"] = draft_vocab
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def test_a_reduced_draft_vocabulary_is_distilled_on_the_ids_it_can_propose(pair, data, tmp_path):
    """Such a head gives every other target id probability 0, so a KL against the whole target
    distribution is infinite. The loss is the KL against the target renormalized over the head's
    target ids (naive sums below), the hard term counts only labels the head can propose, and
    training sees finite, falling losses."""
    _, draft_dir, target, _ = pair
    head = load_draft(_reduced_vocabulary_draft(draft_dir, tmp_path / "reduced", 128), target)
    ids = torch.arange(128) * 2
    batch = data.select(torch.arange(4))
    with torch.no_grad():
        soft_loss = float(distill_loss(head, batch, 1))
        hard_loss = float(distill_loss(head, batch, 1, hard_weight=1.0))
        logits, _, _ = dense_head_step(head, batch.tokens[:, 1:], batch.aux[:, :-1])
    kl, nll, labelled, positions = 0.0, 0.0, 0, 0
    for row in range(batch.tokens.shape[0]):
        for p in range(batch.tokens.shape[1] - 1):  # every row is full length: every p predicts p + 2
            target_p = batch.target_logprobs[row, p + 1, ids].double().exp()
            target_p = target_p / target_p.sum()
            head_q = torch.softmax(logits[row, p, ids].double(), dim=0)
            kl += float((target_p * (target_p.log() - head_q.log())).sum())
            positions += 1
            label = int(batch.target_next[row, p + 1])
            if label % 2 == 0:  # every even id is some draft id's
                nll -= float(head_q[label // 2].log())
                labelled += 1
    assert 0 < labelled < positions
    assert soft_loss == pytest.approx(kl / positions, rel=1e-4)
    assert hard_loss - soft_loss == pytest.approx(nll / labelled, rel=1e-4)
    history = train_head(head, data, steps=6, batch_size=4, seed=0)
    assert all(torch.isfinite(torch.tensor(history))) and history[-1] < history[0]


def test_two_pass_loss_is_the_mean_of_per_pass_kl_and_cross_entropy_from_the_paged_chains(pair, data):
    """distill_loss(ttt_steps=2) against a per-position loop over the PAGED head (not dense_head_step).

    The docstring's definition: pass s's term is the KL(target || head) averaged over the positions
    it reaches, plus `hard_weight` times the mean cross-entropy against the target's greedy token;
    the loss is the mean of the two passes' terms. Pass 0 at p (p + 1 < row length) is draft step 0
    over 0..p; pass 1 at q (1 <= q, q + 1 < row length) is draft step 1 of the chain from p = q - 1.
    Both predict the token after the one they consume, whose target distribution is
    `target_logprobs[q + 1]` and greedy label `target_next[q + 1]`. A short row checks the masking."""
    _, _, target, head = pair
    assert head.target_ids is None or torch.unique(head.target_ids).numel() == data.target_logprobs.shape[-1]
    rows = torch.tensor([11, 6])
    picked = data.select(rows)
    batch = DistillData(picked.tokens, picked.aux, picked.target_next, torch.tensor([20, 9]), picked.target_logprobs)

    def kl_and_nll(logits, row, q):
        log_t = batch.target_logprobs[row, q + 1].double()
        log_q = logits.double().log_softmax(-1)
        return float((log_t.exp() * (log_t - log_q)).sum()), -float(log_q[batch.target_next[row, q + 1]])

    terms = {0: [], 1: []}  # pass -> [(kl, nll)] over the positions it reaches
    with torch.no_grad():
        for row, length in enumerate(batch.lengths.tolist()):
            tokens, aux = batch.tokens[row], batch.aux[row]
            cache, meta = _paged(target, head)
            cache.reserve("r", length - 1)
            meta.prepare([length - 1], [length - 1], cache.block_table(["r"]), num_context_requests=1)
            logits, _ = head(tokens[1:length], aux[:length - 1], meta, cache)  # step 0 at p = 0..length-2
            terms[0] += [kl_and_nll(logits[p], row, p) for p in range(length - 1)]
            for p in range(length - 2):  # chain from p: step 1 sits at q = p + 1 <= length - 2
                cache, meta = _paged(target, head)
                cache.reserve("r", p + 2)
                meta.prepare([p + 1], [p + 1], cache.block_table(["r"]), num_context_requests=1)
                _, out = head(tokens[1:p + 2], aux[:p + 1], meta, cache)
                meta.prepare([1], [p + 2], cache.block_table(["r"]))
                logits, _ = head(tokens[p + 2:p + 3], out[-1:], meta, cache)
                terms[1].append(kl_and_nll(logits[0], row, p + 1))
        soft = float(distill_loss(head, batch, 2))
        hard = float(distill_loss(head, batch, 2, hard_weight=0.5))
    assert [len(terms[0]), len(terms[1])] == [19 + 8, 18 + 7]
    mean_kl = [sum(kl for kl, _ in terms[s]) / len(terms[s]) for s in (0, 1)]
    mean_nll = [sum(nll for _, nll in terms[s]) / len(terms[s]) for s in (0, 1)]
    assert mean_kl[0] > 0 and mean_kl[1] > 0 and abs(mean_kl[0] - mean_kl[1]) > 1e-3  # passes distinguishable
    assert soft == pytest.approx((mean_kl[0] + mean_kl[1]) / 2, rel=1e-4)
    assert hard - soft == pytest.approx(0.5 * (mean_nll[0] + mean_nll[1]) / 2, rel=1e-4)


def test_dense_step_follows_norm_before_residual(pair, data, tmp_path):
    """With `norm_before_residual` the residual around attention is hidden_norm(g) (vLLM's
    `_residual_norm`); the dense training step must run the head the paged forward runs (itself
    checked against the public formulas in test_public_layout.py)."""
    import json
    import shutil

    _, draft_dir, target, _ = pair
    variant = tmp_path / "nbr"
    shutil.copytree(draft_dir, variant)
    config = json.loads((variant / "config.json").read_text())
    config["norm_before_residual"] = True
    (variant / "config.json").write_text(json.dumps(config))
    head = load_draft(variant, target)
    assert head.config.norm_before_residual
    _assert_dense_step_equals_paged_head(target, head, data)


def test_first_optimizer_step_is_adam_without_weight_decay_at_the_warmup_rate(pair, data):
    """By hand: AdamW's first step moves each parameter by lr_0 * g / (|g| + eps) <= lr_0, i.e. by lr_0
    where the gradient is not tiny, plus lr_0 * weight_decay * |p| with decay. The documented schedule
    warms up over min(20, max(1, steps // 10)) = 1 step when steps = 1, so lr_0 = lr * 1/1; weight
    decay is 0. So no parameter moves by more than lr_0, and most move by lr_0 itself. Shared weights stay."""
    _, draft_dir, target, _ = pair
    head = load_draft(draft_dir, target)
    shared = {id(p) for m in (head.embed_tokens, head.lm_head) for p in m.parameters()}
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    lr = 1e-2
    train_head(head, data, steps=1, batch_size=4, lr=lr, seed=0)
    lr0 = lr
    for name, p in head.named_parameters():
        delta = (p.detach() - before[name]).double().abs()
        if id(p) in shared:
            assert torch.equal(delta, torch.zeros_like(delta)), name
            continue
        assert float(delta.max()) <= lr0 + 5e-7, (name, float(delta.max()))
        # an fp32 parameter near 1 rounds its step to ~1e-7
        assert float((delta - lr0).abs().le(5e-7).double().mean()) > 0.5, name


def test_distilled_checkpoint_keeps_the_file_mode_the_stored_dtypes_and_the_metadata(tmp_path):
    """Weights are written back as they were stored (a bf16 checkpoint stays bf16, whatever dtype the
    head trained in), and the replaced file keeps its permissions (not the temp file's 0600) and the
    metadata its writer stored (all but {"format": "pt"} was dropped)."""
    import os
    import stat

    from safetensors import safe_open
    from safetensors.torch import save_file

    target_dir, draft_dir = make_tiny(tmp_path, seed=2)
    weights = draft_dir / "model.safetensors"
    stored = {k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    metadata = {"format": "pt", "producer": "a trainer's note"}
    save_file(stored, str(weights), metadata=metadata)
    os.chmod(weights, 0o640)
    distill_checkpoint(target_dir, draft_dir, plan=DistillPlan(steps=2, num_sequences=2, seq_len=16, iterations=1,
                                                               batch_size=2))
    assert stat.S_IMODE(os.stat(weights).st_mode) == 0o640
    after = load_file(str(weights))
    assert after.keys() == stored.keys()
    assert all(after[k].dtype == torch.bfloat16 for k in after)
    assert any(not torch.equal(after[k], stored[k]) for k in after)
    with safe_open(str(weights), "pt") as f:
        assert f.metadata() == metadata


def test_lr_factor_warms_up_then_decays_linearly_from_the_peak():
    """By hand from the documented rule: w = min(20, max(1, steps // 10)) warm-up steps at (i + 1) / w,
    then (steps - i) / (steps - w + 1), i.e. 1 at step w - 1 falling to 0 at step `steps`."""
    from m3_eagle_plugin.eagle3.train import lr_factor

    assert [lr_factor(i, 1) for i in range(1)] == [1.0]
    assert [lr_factor(i, 5) for i in range(5)] == pytest.approx([1, 4 / 5, 3 / 5, 2 / 5, 1 / 5])
    assert [lr_factor(i, 30) for i in range(4)] == pytest.approx([1 / 3, 2 / 3, 1, 27 / 28])
    assert lr_factor(29, 30) == pytest.approx(1 / 28)
    # the default plan (300 steps) and a long run: 20 warm-up steps
    for steps in (300, 1000):
        assert lr_factor(0, steps) == pytest.approx(1 / 20)
        assert lr_factor(18, steps) == pytest.approx(19 / 20)
        assert lr_factor(19, steps) == 1.0
        assert lr_factor(20, steps) == pytest.approx((steps - 20) / (steps - 19))
        assert lr_factor(steps - 1, steps) == pytest.approx(1 / (steps - 19))


@pytest.mark.parametrize("steps, factors", [
    (1, [1.0]),
    (5, [1, 4 / 5, 3 / 5, 2 / 5, 1 / 5]),
    (20, [1 / 2, 1] + [(20 - i) / 19 for i in range(2, 20)]),
])
def test_train_head_steps_at_the_documented_rates_and_reaches_lr(pair, data, steps, factors):
    """The rate each optimizer step actually uses (read off the optimizer just before it steps) is
    lr times the hand-computed schedule; in particular the peak is lr itself."""
    _, draft_dir, target, _ = pair
    head = load_draft(draft_dir, target)
    lr = 1e-2
    seen = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: seen.append(optimizer.param_groups[0]["lr"]))
    try:
        train_head(head, data, steps=steps, batch_size=2, lr=lr, seed=0)
    finally:
        hook.remove()
    assert seen == pytest.approx([lr * f for f in factors], rel=1e-9)
    assert max(seen) == pytest.approx(lr, rel=1e-12)


def test_an_lm_head_the_checkpoint_ships_trains_and_is_written_back(tmp_path):
    """An own lm_head is the draft's weight like any other (the next load reads it from this file);
    an embedding taken from the target stays the target's, and the target itself is untouched."""
    from safetensors.torch import save_file

    target_dir, draft_dir = make_tiny(tmp_path, seed=5)
    target = load_target(target_dir)
    weights = draft_dir / "model.safetensors"
    tensors = load_file(str(weights))
    dtype = next(iter(tensors.values())).dtype
    own = (target.lm_head.weight.detach() + 0.01 * torch.randn_like(target.lm_head.weight)).to(dtype)
    save_file({**tensors, "lm_head.weight": own}, str(weights), metadata={"format": "pt"})
    target_weights = load_file(str(target_dir / "model.safetensors"))

    distill_checkpoint(target_dir, draft_dir, plan=DistillPlan(steps=4, num_sequences=4, seq_len=16, iterations=2,
                                                               batch_size=4), embeddings="own")
    after = load_file(str(weights))
    assert set(after) == set(tensors) | {"lm_head.weight"}  # nothing of the target's added
    moved = (after["lm_head.weight"].float() - own.float()).abs()
    assert bool(torch.isfinite(moved).all()) and float(moved.max()) > 0
    assert all(torch.equal(v, target_weights[k]) for k, v in load_file(str(target_dir / "model.safetensors")).items())


def test_distilling_by_default_writes_back_the_shipped_embedding_and_lm_head_unchanged(tmp_path):
    """Served as the target's (the default), the shipped copies are frozen: the file keeps them bit for
    bit (nothing is lost, nor replaced by the target's), while the head's own weights train."""
    from safetensors.torch import save_file

    target_dir, draft_dir = make_tiny(tmp_path, seed=5)
    weights = draft_dir / "model.safetensors"
    tensors = load_file(str(weights))
    dtype = next(iter(tensors.values())).dtype
    shipped = {"embed_tokens.weight": torch.randn(VOCAB, HIDDEN, dtype=dtype),
               "lm_head.weight": torch.randn(VOCAB, HIDDEN, dtype=dtype)}
    save_file({**tensors, **shipped}, str(weights), metadata={"format": "pt"})
    distill_checkpoint(target_dir, draft_dir, plan=DistillPlan(steps=4, num_sequences=4, seq_len=16, iterations=2,
                                                               batch_size=4))
    after = load_file(str(weights))
    assert all(torch.equal(after[name], value) for name, value in shipped.items())
    assert not torch.equal(after["fc.weight"], tensors["fc.weight"])


def test_from_target_names_what_the_loader_took_from_the_target(pair):
    _, draft_dir, target, _ = pair
    assert load_draft(draft_dir, target).from_target == ("embed_tokens", "lm_head")


def test_training_keeps_what_came_from_the_target_and_trains_the_lm_head_the_checkpoint_ships(pair, data, tmp_path):
    """In memory: the embedding the loader took from the target stays the target's, unchanged."""
    import shutil

    from safetensors.torch import save_file

    _, draft_dir, target, _ = pair
    variant = tmp_path / "draft"
    shutil.copytree(draft_dir, variant)
    tensors = load_file(str(variant / "model.safetensors"))
    own = target.lm_head.weight.detach() + 0.01 * torch.randn_like(target.lm_head.weight)
    save_file({**tensors, "lm_head.weight": own}, str(variant / "model.safetensors"), metadata={"format": "pt"})
    head = load_draft(variant, target, embeddings="own")
    embed, target_lm_head = target.embed_tokens.weight.clone(), target.lm_head.weight.clone()
    train_head(head, data, steps=2, batch_size=4, seed=0)
    assert head.embed_tokens is target.embed_tokens and torch.equal(target.embed_tokens.weight, embed)
    assert torch.equal(target.lm_head.weight, target_lm_head)
    assert not torch.equal(head.lm_head.weight, own.to(head.lm_head.weight.dtype))


def test_a_head_built_directly_trains_without_the_target_modules_it_is_given(pair, data):
    """`Eagle3Head` built by hand (as the e2e bench does) with the target's embedding and lm_head
    attached: both count as taken from the target, so training leaves them as they were."""
    from m3_eagle_plugin.eagle3.head import Eagle3Head

    _, _, target, loaded = pair
    head = Eagle3Head(loaded.config)
    head.load_state_dict(loaded.state_dict())
    head.embed_tokens, head.lm_head = target.embed_tokens, target.lm_head
    embed, lm_head, fc = target.embed_tokens.weight.clone(), target.lm_head.weight.clone(), head.fc.weight.clone()
    train_head(head, data, steps=2, batch_size=4, seed=0)
    assert torch.equal(target.embed_tokens.weight, embed) and torch.equal(target.lm_head.weight, lm_head)
    assert not torch.equal(head.fc.weight, fc)


# ---- found by mutation testing: each test below kills a mutant the suite above let through ----


def test_training_clips_the_global_gradient_norm_to_one(pair, data):
    """With the hard term the raw gradient norm of this batch is about 4: every optimizer step must
    see a global norm (over the trained parameters, computed here independently) of at most 1, and
    the first, clipped one exactly 1."""
    _, draft_dir, target, _ = pair
    head = load_draft(draft_dir, target)
    norms = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    hook = register_optimizer_step_pre_hook(record)
    try:
        train_head(head, data, steps=3, batch_size=4, hard_weight=1.0, seed=0)
    finally:
        hook.remove()
    assert len(norms) == 3 and max(norms) <= 1 + 1e-5
    assert norms[0] == pytest.approx(1.0, abs=1e-5)


def test_a_batch_with_no_label_the_head_can_propose_adds_no_hard_term(pair, data, tmp_path):
    """Documented: a greedy label outside the draft vocabulary is not counted. When no label of the
    batch is countable (all odd ids, the head proposes only even ones) the hard term is left out
    entirely: the loss is the plain KL, not NaN from a cross-entropy over nothing."""
    _, draft_dir, target, _ = pair
    head = load_draft(_reduced_vocabulary_draft(draft_dir, tmp_path / "reduced", 128), target)
    batch = data.select(torch.arange(4))
    odd = DistillData(batch.tokens, batch.aux, batch.target_next | 1, batch.lengths, batch.target_logprobs)
    with torch.no_grad():
        soft, hard = float(distill_loss(head, odd, 1)), float(distill_loss(head, odd, 1, hard_weight=1.0))
    assert soft == soft and hard == soft


def test_distill_checkpoint_restores_the_thread_count(tmp_path):
    """It trains on one thread (for determinism) and must hand the caller's setting back."""
    target_dir, draft_dir = make_tiny(tmp_path, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        distill_checkpoint(target_dir, draft_dir, plan=DistillPlan(steps=1, num_sequences=2, seq_len=16, iterations=1,
                                                                   batch_size=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_prompt_lengths_must_start_at_one(pair):
    target, head = pair[2], pair[3]
    with pytest.raises(ValueError, match=r"prompt_lens must satisfy 1 <= low <= high <= seq_len \(8\), got \(0, 3\)"):
        collect_distill_data(target, head.aux_layer_ids, num_sequences=2, seq_len=8, prompt_lens=(0, 3))


def test_aux_layer_ids_out_of_the_fc_order_are_refused_naming_them(pair):
    """The aux rows are stacked in the order given, while the head's fc takes them in ascending layer order:
    reversed ids trained a head on permuted chunks without a word."""
    target, head = pair[2], pair[3]
    reversed_ids = list(head.aux_layer_ids)[::-1]
    assert reversed_ids != sorted(reversed_ids)
    with pytest.raises(ValueError, match=re.escape(f"aux layer ids {reversed_ids} must be strictly ascending")):
        collect_distill_data(target, reversed_ids, num_sequences=1, seq_len=4, iterations=1)
    repeated = [head.aux_layer_ids[0]] * 2 + [head.aux_layer_ids[-1]]
    with pytest.raises(ValueError, match=r"aux layer ids must be distinct"):
        collect_distill_data(target, repeated, num_sequences=1, seq_len=4, iterations=1)


def test_each_step_draws_its_batch_at_random_without_replacement(pair, data, monkeypatch):
    """Documented: each step draws `batch_size` rows of `data`. Read off the rows each step selects:
    distinct rows within a batch, batches that differ from step to step, the same draws for the same
    seed and other draws for another seed (12 rows, batches of 4: a fixed slice would repeat)."""
    _, draft_dir, target, _ = pair
    picks = []
    select = DistillData.select

    def recording_select(self, rows):
        picks.append(rows.tolist())
        return select(self, rows)

    monkeypatch.setattr(DistillData, "select", recording_select)
    runs = {}
    for seed in (0, 0, 1):
        picks.clear()
        train_head(load_draft(draft_dir, target), data, steps=4, batch_size=4, seed=seed)
        runs.setdefault(seed, []).append([list(p) for p in picks])
    n = data.tokens.shape[0]
    for batches in (runs[0][0], runs[1][0]):
        assert len(batches) == 4
        assert all(len(set(b)) == 4 and all(0 <= r < n for r in b) for b in batches)
        assert len({tuple(b) for b in batches}) > 1
    assert runs[0][0] == runs[0][1] and runs[0][0] != runs[1][0]


# ---- review: inputs the tests above did not model ----


def test_a_zero_probability_in_the_target_adds_nothing_to_the_kl(pair, data):
    """A target distribution may give a token probability 0 (log-probability -inf, e.g. a one-hot or
    truncated teacher): its KL term is 0 by definition, not NaN (kl_div read it as 0 * -inf). Naive
    sum over the target's positive entries, pass 0, every row full length."""
    head = pair[3]
    batch = data.select(torch.arange(3))
    logprobs = batch.target_logprobs.clone()
    logprobs[..., 7] = float("-inf")
    logprobs = logprobs - logprobs.logsumexp(-1, keepdim=True)
    batch = DistillData(batch.tokens, batch.aux, batch.target_next, batch.lengths, logprobs)
    with torch.no_grad():
        loss = float(distill_loss(head, batch, 1))
        logits, _, _ = dense_head_step(head, batch.tokens[:, 1:], batch.aux[:, :-1])
    kl, positions = 0.0, 0
    for row in range(3):
        for p in range(batch.tokens.shape[1] - 1):
            log_t, log_q = logprobs[row, p + 1].double(), logits[row, p].double().log_softmax(-1)
            keep = log_t > float("-inf")
            kl += float((log_t[keep].exp() * (log_t[keep] - log_q[keep])).sum())
            positions += 1
    assert loss == pytest.approx(kl / positions, rel=1e-5)


def test_rows_too_short_to_train_are_left_out_of_the_draw(pair, data):
    """A one-token row has no position to predict. Training on data holding one must run to the end
    (a batch drawn from it alone raised after earlier steps had changed the weights) and equal
    training on the data without it; data with no trainable row is refused before any step."""
    _, draft_dir, target, _ = pair
    mixed = DistillData(data.tokens, data.aux, data.target_next, torch.tensor([20] * 11 + [1]), data.target_logprobs)
    head, without = load_draft(draft_dir, target), load_draft(draft_dir, target)
    history = train_head(head, mixed, steps=12, batch_size=1, seed=0)
    assert history == train_head(without, data.select(torch.arange(11)), steps=12, batch_size=1, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), without.state_dict().values()))
    short = DistillData(data.tokens, data.aux, data.target_next, torch.ones(12, dtype=torch.long),
                        data.target_logprobs)
    fc = head.fc.weight.clone()
    with pytest.raises(ValueError, match="no position to train"):
        train_head(head, short, steps=2, batch_size=4)
    assert torch.equal(head.fc.weight, fc)


@pytest.mark.parametrize("lr, hard_weight", [(float("inf"), 0.0), (1e-2, float("inf"))])
def test_an_infinite_rate_or_hard_weight_is_refused_before_any_step(pair, data, lr, hard_weight):
    """Either turned every trained weight NaN (inf * update; an infinite loss's gradient)."""
    _, draft_dir, target, _ = pair
    head = load_draft(draft_dir, target)
    fc = head.fc.weight.clone()
    with pytest.raises(ValueError, match="lr must be finite and > 0 and hard_weight finite and >= 0"):
        train_head(head, data, steps=2, batch_size=4, lr=lr, hard_weight=hard_weight)
    assert torch.equal(head.fc.weight, fc)


def test_concatenating_nothing_names_that_cause_and_a_generator_is_read_once(data):
    """An empty list read as "data of different lengths []"; a generator of parts was spent by the
    length check, leaving nothing for the concatenation."""
    with pytest.raises(ValueError, match=r"^no distillation data to concatenate$"):
        concat_data([])
    halves = [data.select(torch.arange(6)), data.select(torch.arange(6, 12))]
    joined = concat_data(part for part in halves)
    assert all(torch.equal(getattr(joined, f), getattr(data, f)) for f in DistillData.FIELDS)


@pytest.mark.parametrize("ttt_steps, hard_weight, message", [
    (0, 0.0, r"^ttt_steps must be an int >= 1, got 0$"),  # no pass: torch.stack of no loss
    (1.5, 0.0, r"^ttt_steps must be an int >= 1, got float 1\.5$"),
    (1, -1.0, r"^hard_weight must be finite and >= 0, got -1\.0$"),  # rewarded missing the greedy token
    (1, float("inf"), r"^hard_weight must be finite and >= 0, got inf$"),
])
def test_distill_loss_refuses_pass_counts_and_hard_weights_it_cannot_use(pair, data, ttt_steps, hard_weight, message):
    with pytest.raises(ValueError, match=message):
        distill_loss(pair[3], data, ttt_steps, hard_weight)


def test_distillation_data_of_another_head_or_target_is_refused_naming_the_width(pair, data):
    """Aux rows narrower than fc takes, or distributions over another vocabulary, failed deep inside the
    step (and concat_data in torch.cat) with a bare size mismatch naming no field."""
    head = pair[3]
    narrow = DistillData(data.tokens, data.aux[..., :-8], data.target_next, data.lengths, data.target_logprobs)
    with pytest.raises(ValueError, match=rf"^distillation data has aux rows {head.fc.in_features - 8} wide; "
                                         rf"this head's fc takes {head.fc.in_features} "):
        distill_loss(head, narrow)
    with pytest.raises(ValueError, match=r"^cannot concatenate distillation data whose aux differ in width"):
        concat_data([data, narrow])
    vocab = head.config.vocab_size
    wide = DistillData(data.tokens, data.aux, data.target_next, data.lengths,
                       torch.cat([data.target_logprobs] * 2, dim=-1))
    with pytest.raises(ValueError, match=rf"^distillation data has target distributions over {2 * vocab} ids; "
                                         rf"this head's target vocabulary has {vocab}$"):
        distill_loss(head, wide)
    with pytest.raises(ValueError, match=r"^cannot concatenate distillation data whose target_logprobs differ"):
        concat_data([data, wide])


@pytest.mark.parametrize("tokens_shape, logprobs_shape, shown", [
    ((2, 5), (2, 4, 7), r"target_logprobs \(2, 4, 7\)"),  # checked, but missing from the message
    ((2, 5, 1), (2, 5, 7), r"tokens \(2, 5, 1\)"),  # "too many values to unpack" named no field
])
def test_inconsistent_distillation_data_names_every_field_shape(tokens_shape, logprobs_shape, shown):
    with pytest.raises(ValueError, match=r"^inconsistent distillation data shapes: (tokens .*)?" + shown):
        DistillData(torch.zeros(tokens_shape, dtype=torch.long), torch.zeros(2, 5, 6),
                    torch.zeros(2, 5, dtype=torch.long), torch.full((2,), 5), torch.zeros(logprobs_shape))
    DistillData(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, 6), torch.zeros(2, 5, dtype=torch.long),
                torch.full((2,), 5), torch.zeros(2, 5, 7))  # consistent: taken


def test_a_head_in_its_targets_bf16_steps_as_the_paged_head_on_the_collected_fp32_aux_and_trains(pair):
    """load_draft gives the head the target's dtype, while collected aux is fp32 (the bf16 capture upcast,
    exactly). The dense step takes it in the head's dtype, as the paged head takes the engine's bf16
    capture; the first training step failed "expected m1 and m2 to have the same dtype"."""
    target = load_target(pair[0], dtype=torch.bfloat16)
    head = load_draft(pair[1], target)
    data = collect_distill_data(target, head.aux_layer_ids, num_sequences=2, seq_len=12, prompt_lens=(2, 4),
                                iterations=1)
    assert data.aux.dtype == torch.float32 and head.fc.weight.dtype == torch.bfloat16
    tokens, aux = data.tokens[-1], data.aux[-1]
    s = tokens.shape[0] - 1
    cache, meta = _paged(target, head, dtype=torch.bfloat16)
    cache.reserve("r", s)
    meta.prepare([s], [s], cache.block_table(["r"]), num_context_requests=1)
    with torch.no_grad():
        want_logits, want_hidden = head(tokens[1:], aux[:s].bfloat16(), meta, cache)
        logits, hidden, _ = dense_head_step(head, tokens[None, 1:], aux[None, :s])
    torch.testing.assert_close(logits[0], want_logits, atol=0.05, rtol=0)  # bf16: an ulp at 4 to 8 is 0.03
    torch.testing.assert_close(hidden[0], want_hidden, atol=0.05, rtol=0)
    history = train_head(head, data, steps=4, batch_size=2, seed=0)
    assert all(h == h for h in history) and history[-1] < history[0] and head.fc.weight.dtype == torch.bfloat16


def test_a_plan_of_rows_shorter_than_the_default_prompts_distills(tmp_path):
    """DistillPlan holds no prompt lengths: a seq_len under the default's 16 failed naming prompt_lens,
    which distill_checkpoint cannot pass. The default 2..16 is capped at seq_len (docstring)."""
    target_dir, draft_dir = make_tiny(tmp_path, seed=2)
    before = load_file(str(draft_dir / "model.safetensors"))
    plan = DistillPlan(steps=2, num_sequences=2, seq_len=8, iterations=2, batch_size=2)
    history = distill_checkpoint(target_dir, draft_dir, plan=plan, seed=1)
    assert len(history) == 2 and all(h == h for h in history)
    after = load_file(str(draft_dir / "model.safetensors"))
    assert any(not torch.equal(after[k], before[k]) for k in after)
    target = load_target(target_dir)
    data = collect_distill_data(target, (2, 4, 5), num_sequences=16, seq_len=3, iterations=2, seed=0)
    rounds = data.tokens.view(2, 16, 3)
    kept = (rounds[0] == rounds[1]).long().cumprod(dim=1).sum(dim=1)  # a prompt never changes, the rest does
    assert set(kept.tolist()) == {2, 3}  # prompts from the default's 2 to seq_len


@pytest.mark.parametrize("prompt_lens", [(2.5, 4), (True, 4), (2, 4.0), (3,), (2, 3, 4), 5])
def test_prompt_lengths_other_than_two_ints_are_refused_by_name(pair, prompt_lens):
    """A float or a bool failed in torch.randint, another count of values in the unpacking, naming neither."""
    with pytest.raises(ValueError, match=r"^prompt_lens must be two ints \(low, high\), got "):
        collect_distill_data(pair[2], pair[3].aux_layer_ids, num_sequences=2, seq_len=8, prompt_lens=prompt_lens)


def test_ids_of_any_integer_dtype_give_the_int64_loss_and_float_ids_are_refused(pair, data):
    """int32 ids (a NumPy or Arrow dataset's) failed in nll_loss once the hard term was on ("expected target
    dtype to be Long or Byte, but got Int"). The loss must be that of the same ids as int64 (checked against
    naive sums above); float ids, which torch would truncate, are refused naming the field."""
    head = pair[3]
    batch = data.select(torch.arange(3))
    narrow = DistillData(batch.tokens.int(), batch.aux, batch.target_next.int(), batch.lengths.int(),
                         batch.target_logprobs)
    with torch.no_grad():
        assert float(distill_loss(head, narrow, 2, 0.5)) == float(distill_loss(head, batch, 2, 0.5))
    trained = load_draft(pair[1], pair[2])
    assert train_head(trained, narrow, steps=2, batch_size=3, hard_weight=0.5) == train_head(
        load_draft(pair[1], pair[2]), batch, steps=2, batch_size=3, hard_weight=0.5)
    with pytest.raises(ValueError, match=r"^distillation data target_next must hold integer token ids, got "
                                         r"torch\.float32$"):
        DistillData(batch.tokens, batch.aux, batch.target_next.float(), batch.lengths, batch.target_logprobs)


def _with(data: DistillData, **fields) -> DistillData:
    return DistillData(*(fields.get(f, getattr(data, f)) for f in DistillData.FIELDS))


def _spoiled(data: DistillData, field: str, value: float) -> DistillData:
    tensor = getattr(data, field).clone()
    tensor[:, 5] = value  # every row, at a position every pass trains on
    return _with(data, **{field: tensor})


@pytest.mark.parametrize("spoil, lr, cause", [
    (None, 1e30, r"lr=1e\+30 is too high"),
    (("target_logprobs", float("nan")), 1e-2, "NaN or \\+inf target log-probabilities"),
    (("aux", float("inf")), 1e-2, "non-finite aux features"),
])
def test_a_non_finite_loss_is_refused_by_its_cause_and_the_weights_are_put_back(pair, data, spoil, lr, cause):
    """A NaN loss trained on silently (clip_grad_norm_ passes NaN): every weight went NaN and the loss
    history read nan, nothing raised. The oracle: the weights before training, and finite."""
    head = load_draft(pair[1], pair[2])
    before = {k: v.clone() for k, v in head.state_dict().items()}
    batch = data if spoil is None else _spoiled(data, *spoil)
    with pytest.raises(ValueError, match=f"distillation loss is nan at step .*{cause}.*left as they were"):
        train_head(head, batch, steps=4, batch_size=4, lr=lr)
    after = head.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before) and not head.training
    assert all(bool(torch.isfinite(v).all()) for v in after.values())


def test_an_interrupt_between_steps_puts_the_weights_back(pair, data):
    head = load_draft(pair[1], pair[2])
    before = {k: v.clone() for k, v in head.state_dict().items()}
    steps = []

    def interrupt(optimizer, args, kwargs):
        steps.append(1)
        if len(steps) == 3:  # two steps have changed the weights
            raise KeyboardInterrupt

    hook = register_optimizer_step_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            train_head(head, data, steps=5, batch_size=2)
    finally:
        hook.remove()
    after = head.state_dict()
    assert len(steps) == 3 and all(torch.equal(after[k], before[k]) for k in before)


def test_a_diverging_distillation_saves_no_nan_head(tmp_path):
    """distill_checkpoint wrote the NaN head over the draft's weights (every trainable tensor NaN)."""
    target_dir, draft_dir = make_tiny(tmp_path, seed=2)
    weights = draft_dir / "model.safetensors"
    before = weights.read_bytes()
    with pytest.raises(ValueError, match="too high"):
        distill_checkpoint(target_dir, draft_dir, plan=DistillPlan(steps=3, num_sequences=2, seq_len=8, iterations=1,
                                                                   batch_size=2, lr=1e30))
    assert weights.read_bytes() == before


@pytest.mark.parametrize("width", [5, 128])
def test_dense_step_refuses_a_hidden_width_that_is_neither_aux_nor_draft_hidden_as_the_paged_head_does(pair, width):
    """A width other than the aux row's (fc) or the head's own (later passes) failed inside fc_norm with
    "The size of tensor a (64) must match the size of tensor b (2)", naming neither width."""
    head = pair[3]
    with pytest.raises(ValueError, match=rf"hidden \(1, 3, {width}\) must be \[B, S, width\] with width the aux "
                                         rf"width 192 or the draft hidden size 64"):
        dense_head_step(head, torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, width))


@pytest.mark.parametrize("seed", [1.5, True, "3", -1, 2**64])
def test_a_seed_that_is_not_a_generator_seed_is_refused_by_name_before_any_work(pair, data, seed, monkeypatch):
    """torch.Generator().manual_seed(1.5) raised a bare "manual_seed expected a long, but got float" RuntimeError
    (distill_checkpoint only after loading the pair: torch.manual_seed truncated 1.5 to 1 first); -1 silently
    seeded as 2**64 - 1, and 2**64 failed as "Overflow when unpacking long long". Seeds are ints in [0, 2**64)."""
    import m3_eagle_plugin.models.loader as loader

    target, head = pair[2], pair[3]
    message = r"seed must be an int in \[0, 2\*\*64\)"
    with pytest.raises(ValueError, match=message):
        collect_distill_data(target, head.aux_layer_ids, num_sequences=1, seq_len=8, iterations=1, seed=seed)
    before = [p.clone() for p in head.parameters()]
    with pytest.raises(ValueError, match=message):
        train_head(head, data, steps=1, seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(before, head.parameters()))
    assert not any(p.requires_grad for p in head.parameters())  # left as documented: gradients off

    def no_load(*args, **kwargs):
        raise AssertionError("the pair was loaded before the seed was checked")

    monkeypatch.setattr(loader, "load_target", no_load)
    with pytest.raises(ValueError, match=message):
        distill_checkpoint(pair[0], pair[1], plan=DistillPlan(steps=1), seed=seed)


def test_distill_checkpoint_leaves_every_device_generator_of_the_caller_alone(tmp_path, monkeypatch):
    """It seeds inside `fork_rng(devices=[])`, which restores the CPU generator only, with torch.manual_seed,
    which (as torch documents) seeds every device: a caller's CUDA generator came back reseeded to the
    distillation seed. Seen through `torch.cuda.manual_seed_all`, the call torch.manual_seed makes for CUDA."""
    target_dir, draft_dir = make_tiny(tmp_path, seed=5)
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    torch.manual_seed(1234)
    seeded.clear()
    cpu = torch.get_rng_state()
    distill_checkpoint(target_dir, draft_dir, plan=DistillPlan(steps=1, num_sequences=2, seq_len=16, iterations=1,
                                                               batch_size=2), seed=7)
    assert seeded == [] and torch.equal(torch.get_rng_state(), cpu)


@pytest.mark.parametrize("field, value, message", [
    ("steps", 0, "steps"), ("num_sequences", -1, "num_sequences"), ("seq_len", 1.5, "seq_len"),
    ("batch_size", True, "batch_size"), ("ttt_steps", 0, "ttt_steps"), ("iterations", "2", "iterations"),
    ("lr", 0.0, "lr must be finite and > 0"), ("lr", float("inf"), "lr must be finite and > 0"),
    ("hard_weight", -0.5, "hard_weight finite and >= 0"), ("hard_weight", float("nan"), "hard_weight finite"),
])
def test_a_plan_train_head_would_refuse_is_refused_where_it_is_made(field, value, message):
    """A bad plan was refused by train_head, after distill_checkpoint had loaded the pair and collected
    its data; now where the plan is made, naming the field."""
    with pytest.raises((ValueError, TypeError), match=message):
        DistillPlan(**{field: value})
    DistillPlan()  # the defaults stand


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_head_distills_on_collected_cpu_data_or_cuda_data_as_the_cpu_head_does(pair, data):
    """`collect_distill_data` returns CPU tensors: a CUDA head's loss failed in its fc_norm ("expected all
    tensors to be on the same device"), and the same data moved to CUDA failed against distill_loss's CPU
    positions. The reference is the CPU head on the same data (checked against the paged head above)."""
    target_dir, draft_dir = pair[0], pair[1]
    cpu_head = load_draft(draft_dir, load_target(target_dir))
    cuda_head = load_draft(draft_dir, load_target(target_dir, device="cuda"))
    on_cuda = DistillData(*(getattr(data, f).cuda() for f in DistillData.FIELDS))
    with torch.no_grad():
        want = float(distill_loss(cpu_head, data, 2, hard_weight=0.5))
        for batch in (data, on_cuda):
            assert float(distill_loss(cuda_head, batch, 2, hard_weight=0.5)) == pytest.approx(want, abs=1e-4)
    fc_before = cuda_head.fc.weight.clone()
    want_history = train_head(cpu_head, data, steps=3, batch_size=4, ttt_steps=2, seed=0)
    history = train_head(cuda_head, data, steps=3, batch_size=4, ttt_steps=2, seed=0)
    # not the weights element by element: Adam's first steps move each by about lr * sign(gradient), which
    # rounding flips where a gradient is next to 0
    assert history == pytest.approx(want_history, rel=1e-3) and not torch.equal(cuda_head.fc.weight, fc_before)
