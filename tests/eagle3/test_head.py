"""Eagle3Head on the paged cache vs a naive dense reference written from the formulas.

The reference has no cache: it recomputes, for the whole token history, Llama RMSNorm,
fc_norm + fc on aux rows, concat(input_layernorm(embed), hidden_norm(g)), full-head RoPE,
GQA causal softmax attention, the SiLU-GLU MLP and the final norm, then compares every step's
rows of the incremental paged run.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from m3_eagle_plugin.eagle3.checkpoint import load_draft
from m3_eagle_plugin.models.loader import load_target
from m3_eagle_plugin.models.tiny import make_tiny
from tests.models._oracle import PagedRunner

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target_dir, draft_dir = make_tiny(tmp_path_factory.mktemp("tiny"), seed=11)
    return target_dir, draft_dir


class Runner(PagedRunner):
    """The models' paged runner with the draft layer hosted in the target cache."""

    def __init__(self, target, head, dtype=torch.float32, device="cpu") -> None:
        super().__init__(target.config, num_blocks=32, device=device, dtype=dtype,
                         draft_num_kv_heads=head.config.num_kv_heads)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def naive_head(head, embed_w, lm_w, ids, rows):
    """Dense reference over a whole history. `rows[t]` is token t's incoming hidden (3H or H wide)."""
    cfg, sd = head.config, {k: v.double() for k, v in head.state_dict().items()}
    eps, H = cfg.rms_norm_eps, cfg.hidden_size
    p = "layers.0."
    g = []
    for r in rows:
        r = r.double()
        if r.shape[-1] == 3 * H:
            r = torch.cat([rms(c, sd[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(r.chunk(3))])
            r = r @ sd["fc.weight"].T
        g.append(r)
    g = torch.stack(g)
    e = rms(embed_w.double()[ids], sd[p + "input_layernorm.weight"], eps)
    hn = rms(g, sd[p + "hidden_norm.weight"], eps)
    x = torch.cat([e, hn], -1)
    T, Hq, Hkv, D = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = torch.arange(T)
    q = rope((x @ sd[p + "self_attn.q_proj.weight"].T).view(T, Hq, D), pos, cfg.rope_theta)
    k = rope((x @ sd[p + "self_attn.k_proj.weight"].T).view(T, Hkv, D), pos, cfg.rope_theta)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(T, Hkv, D)
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        scores = (q[:, h] @ k[:, kv].T) / D ** 0.5
        out[:, h] = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v[:, kv]
    y = g + out.reshape(T, -1) @ sd[p + "self_attn.o_proj.weight"].T
    m = rms(y, sd[p + "post_attention_layernorm.weight"], eps)
    z = y + (F.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)) @ sd[
        p + "mlp.down_proj.weight"].T
    normed = rms(z, sd["norm.weight"], eps)
    return normed @ lm_w.double().T, normed, z


def test_paged_steps_match_dense_reference(tiny):
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    assert head.config.norm_output and head.fc_norm is not None and head.config.num_kv_heads == 2
    H = head.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    runner = Runner(target, head)
    steps = [("aux", 7), ("h", 4), ("h", 1), ("aux", 3), ("h", 2)]
    ids = torch.randint(0, 256, (sum(n for _, n in steps),), generator=gen)
    rows, start = [], 0
    with torch.no_grad():
        for kind, n in steps:
            hidden = torch.randn(n, 3 * H if kind == "aux" else H, generator=gen)
            rows.extend(hidden)
            runner.prepare([("r", n)])
            logits, nxt = head(ids[start:start + n], hidden, runner.meta, runner.cache)
            start += n
            want_logits, want_normed, _ = naive_head(head, target.embed_tokens.weight, target.lm_head.weight,
                                                     ids[:start], rows)
            assert logits.dtype == torch.float32 and logits.shape == (n, 256)
            torch.testing.assert_close(logits.double(), want_logits[start - n:], atol=TOL, rtol=0)
            torch.testing.assert_close(nxt.double(), want_normed[start - n:], atol=TOL, rtol=0)


def test_two_requests_in_one_step_and_pre_norm_output(tiny, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny[1], draft)
    config = json.loads((draft / "config.json").read_text())
    config["norm_output"] = False  # the next-step hidden is then the pre-norm sum z
    (draft / "config.json").write_text(json.dumps(config))
    target = load_target(tiny[0])
    head = load_draft(draft, target)
    assert not head.config.norm_output
    H = head.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    ids = {"a": torch.randint(0, 256, (9,), generator=gen), "b": torch.randint(0, 256, (6,), generator=gen)}
    rows = {"a": [], "b": []}
    pos = {"a": 0, "b": 0}
    runner = Runner(target, head)
    plan = [[("a", 5, 3 * H)], [("a", 3, H), ("b", 5, 3 * H)], [("b", 1, H), ("a", 1, H)]]
    with torch.no_grad():
        for step in plan:
            runner.prepare([(r, n) for r, n, _ in step])
            hidden = [torch.randn(n, w, generator=gen) for _, n, w in step]
            # one step holds rows of both widths only if they agree; feed each width class separately
            batch_ids = torch.cat([ids[r][pos[r]:pos[r] + n] for r, n, _ in step])
            widths = {w for _, _, w in step}
            if len(widths) == 1:
                logits, nxt = head(batch_ids, torch.cat(hidden), runner.meta, runner.cache)
            else:  # mixed widths: combine aux rows first, then run everything as H-wide rows
                merged = torch.cat([head.combine_aux(h) if h.shape[-1] != H else h for h in hidden])
                logits, nxt = head(batch_ids, merged, runner.meta, runner.cache)
            row = 0
            for (r, n, w), h in zip(step, hidden):
                rows[r].extend(h)
                pos[r] += n
                want_logits, _, want_z = naive_head(head, target.embed_tokens.weight, target.lm_head.weight,
                                                    ids[r][:pos[r]], rows[r])
                torch.testing.assert_close(logits[row:row + n].double(), want_logits[-n:], atol=TOL, rtol=0)
                torch.testing.assert_close(nxt[row:row + n].double(), want_z[-n:], atol=TOL, rtol=0)
                row += n


def test_bad_hidden_width_is_rejected(tiny):
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    runner = Runner(target, head)
    runner.prepare([("r", 2)])
    with pytest.raises(ValueError, match="hidden width 5"):
        head(torch.zeros(2, dtype=torch.long), torch.zeros(2, 5), runner.meta, runner.cache)


def test_bf16_smoke(tiny):
    target = load_target(tiny[0], dtype=torch.bfloat16)
    head = load_draft(tiny[1], target, dtype=torch.bfloat16)
    ref_target = load_target(tiny[0])
    ref_head = load_draft(tiny[1], ref_target)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (6,), generator=gen)
    aux = torch.randn(6, 3 * 64, generator=gen)
    outs = []
    for t, h, dtype in ((target, head, torch.bfloat16), (ref_target, ref_head, torch.float32)):
        runner = Runner(t, h, dtype=dtype)
        runner.prepare([("r", 6)])
        with torch.no_grad():
            hidden = t(ids, runner.meta, runner.cache)
            logits, nxt = h(ids, aux.to(dtype), runner.meta, runner.cache)
        assert logits.dtype == torch.float32 and nxt.dtype == dtype and hidden.dtype == dtype
        assert torch.isfinite(logits).all()
        outs.append((logits, nxt.float()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=0.15, rtol=0.05)


def test_a_head_loads_in_its_targets_dtype_by_default_and_a_shared_embedding_of_another_is_named(tiny):
    """A bf16 target's head held fp32 weights beside the target's shared bf16 embedding and lm_head:
    the first forward failed mixing them, naming neither."""
    target = load_target(tiny[0], dtype=torch.bfloat16)
    head = load_draft(tiny[1], target)
    assert head.embed_tokens is target.embed_tokens
    assert {p.dtype for p in head.parameters()} == {torch.bfloat16}
    runner = Runner(target, head, dtype=torch.bfloat16)
    runner.prepare([("r", 3)])
    with torch.no_grad():
        logits, _ = head(torch.tensor([1, 2, 3]), torch.randn(3, 3 * 64).bfloat16(), runner.meta, runner.cache)
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"shares the target's embed_tokens and lm_head \(torch.bfloat16 on cpu\)"
                                         r".*got torch.float32 on cpu"):
        load_draft(tiny[1], target, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_dense_reference(tiny):
    for dtype, atol in ((torch.float32, 1e-3), (torch.bfloat16, 0.5)):
        target = load_target(tiny[0], dtype=dtype, device="cuda")
        head = load_draft(tiny[1], target, dtype=dtype, device="cuda")
        gen = torch.Generator().manual_seed(4)
        ids = torch.randint(0, 256, (9,), generator=gen)
        rows = [torch.randn(6, 3 * 64, generator=gen), torch.randn(3, 64, generator=gen)]
        runner = Runner(target, head, dtype=dtype, device="cuda")
        got = []
        with torch.no_grad():
            for start, hidden in ((0, rows[0]), (6, rows[1])):
                n = hidden.shape[0]
                runner.prepare([("r", n)])
                logits, _ = head(ids[start:start + n].cuda(), hidden.to("cuda", dtype), runner.meta, runner.cache)
                got.append(logits.cpu())
        ref_target = load_target(tiny[0])
        ref_head = load_draft(tiny[1], ref_target)
        want, _, _ = naive_head(ref_head, ref_target.embed_tokens.weight, ref_target.lm_head.weight, ids,
                                list(rows[0]) + list(rows[1]))
        torch.testing.assert_close(torch.cat(got).double(), want, atol=atol, rtol=0)


def _old_to_target_logits(d2t, vocab, logits):
    """to_target_logits as it was before the precomputed maps (arange + d2t each step)."""
    out = logits.new_full((logits.shape[0], vocab), float("-inf"))
    draft_ids = torch.arange(logits.shape[1])
    out[:, draft_ids + d2t[draft_ids]] = logits
    return out


def test_vocabulary_maps_follow_d2t(tiny):
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    assert head.d2t is None and head.target_ids is None and head.draft_index is None
    vd, vocab = 32, head.config.vocab_size
    target_ids = torch.arange(vd) * 7 % 200
    head.d2t = target_ids - torch.arange(vd)
    assert torch.equal(head.target_ids, target_ids)
    assert head.draft_index.dtype == torch.int32 and head.draft_index.shape == (vocab,)
    assert torch.equal(head.draft_index[target_ids], torch.arange(vd, dtype=torch.int32))
    assert (head.draft_index >= 0).sum() == vd
    assert "target_ids" not in head.state_dict() and "draft_index" not in head.state_dict()
    logits = torch.randn(3, vd)
    assert torch.equal(head.to_target_logits(logits), _old_to_target_logits(head.d2t, vocab, logits))
    assert torch.equal(head._target_logits(logits.bfloat16()), head.to_target_logits(logits.bfloat16().float()))
    ids = torch.tensor([0, 5, 31, -1])
    assert torch.equal(head.draft_to_target(ids), ids + head.d2t[ids])
    head.d2t = None
    assert head.target_ids is None and head.draft_index is None
    full = torch.randn(3, vocab)
    assert torch.equal(head.to_target_logits(full), full)
    # draft-vocabulary logits without a d2t: their ids would be read as target ids, the shape [T, Vd]
    with pytest.raises(ValueError, match=f"draft_vocab_size {vd} < vocab_size {vocab} needs a d2t"):
        head.to_target_logits(logits)


def test_a_d2t_that_is_not_one_to_one_keeps_the_scatter(tiny):
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    d2t = -torch.arange(8)  # every draft id -> target id 0
    head.d2t = d2t
    assert head.draft_index is None and torch.equal(head.target_ids, torch.zeros(8, dtype=torch.long))
    logits = torch.randn(2, 8)
    out = head.to_target_logits(logits)
    assert torch.equal(out, _old_to_target_logits(d2t, head.config.vocab_size, logits))


def test_loading_a_state_dict_re_derives_the_vocabulary_maps(tiny):
    """`load_state_dict` copies a new d2t into the existing buffer in place (no `__setattr__`): logits
    must still land on `draft_to_target`'s ids, not on the ones of the d2t the head had before."""
    target = load_target(tiny[0])
    head, other = load_draft(tiny[1], target), load_draft(tiny[1], target)
    vd = 16
    head.d2t = torch.zeros(vd, dtype=torch.long)  # draft d -> target d
    other.d2t = torch.arange(vd) + 1  # draft d -> target 2d + 1
    head.load_state_dict(other.state_dict())
    assert torch.equal(head.target_ids, other.target_ids)
    assert torch.equal(head.draft_index, other.draft_index)
    logits = torch.randn(3, vd)
    want = _old_to_target_logits(other.d2t, head.config.vocab_size, logits)
    assert torch.equal(head.to_target_logits(logits), want)
    assert torch.equal(head.to_target_logits(logits).argmax(-1), head.draft_to_target(logits.argmax(-1)))


@pytest.mark.parametrize("bad", [torch.zeros(8), torch.zeros(2, 4, dtype=torch.long), torch.zeros(8, dtype=torch.bool)])
def test_a_d2t_that_is_not_1d_integer_offsets_is_refused_and_the_head_keeps_its_maps(tiny, bad):
    """A float d2t used to be stored first and then fail deep inside the index build (a bare
    IndexError), leaving d2t and target_ids changed and every later forward failing the same way."""
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    d2t = torch.arange(8)  # draft d -> target 2d
    head.d2t = d2t
    before = (head.d2t, head.target_ids, head.draft_index)
    with pytest.raises(TypeError, match=r"^d2t must be a 1-D integer tensor of id offsets, got "):
        head.d2t = bad
    assert all(now is then for now, then in zip((head.d2t, head.target_ids, head.draft_index), before))
    logits = torch.randn(2, 8)
    assert torch.equal(head.to_target_logits(logits)[:, 2 * torch.arange(8)], logits)


def test_a_d2t_reaching_past_the_target_vocabulary_keeps_no_draft_index(tiny):
    """`draft_index` exists only when d2t maps one-to-one INTO [0, V): a target id equal to V (one past
    the end) leaves it None at assignment (instead of failing to index a [V] table); V - 1 is inside."""
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    vocab = head.config.vocab_size
    d2t = torch.zeros(8, dtype=torch.long)
    d2t[7] = vocab - 7  # draft 7 -> target id V
    head.d2t = d2t
    assert head.draft_index is None and int(head.target_ids[7]) == vocab
    d2t = d2t.clone()
    d2t[7] = vocab - 8  # draft 7 -> target id V - 1
    head.d2t = d2t
    assert head.draft_index is not None and int(head.draft_index[vocab - 1]) == 7


def test_the_head_writes_its_kv_to_the_first_draft_layer_of_the_cache(tiny):
    """Module docstring: the head's K/V live in `cache.draft_layer_ids[0]`. With two draft layers
    hosted, the first receives exactly this step's keys (RoPE'd k_proj of concat(e, h), checked against
    the formulas for one token at position 0, where RoPE is the identity) and the second stays untouched."""
    from m3_eagle_plugin.kv import PagedKVCache

    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    cfg, tc = head.config, target.config
    runner = Runner(target, head)
    runner.cache = PagedKVCache.for_minimax_m3(
        tc.num_layers, tc.sparse_layer_ids, tc.num_kv_heads, tc.head_dim, tc.index_dim or tc.head_dim,
        tc.block_size, 32, num_draft_layers=2, draft_num_kv_heads=cfg.num_kv_heads, dtype=torch.float32)
    first, second = runner.cache.draft_layer_ids
    runner.prepare([("r", 1)])
    ids = torch.tensor([17])
    g = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        head(ids, g, runner.meta, runner.cache)
    sd = {k: v.double() for k, v in head.state_dict().items()}
    e = rms(target.embed_tokens.weight.double()[ids], sd["layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
    h = rms(g.double(), sd["layers.0.hidden_norm.weight"], cfg.rms_norm_eps)
    want_k = (torch.cat([e, h], -1) @ sd["layers.0.self_attn.k_proj.weight"].T).view(cfg.num_kv_heads, cfg.head_dim)
    slot = int(runner.meta.cache_slots[0])
    got = runner.cache.k(first)[slot // tc.block_size, :, slot % tc.block_size]  # [P, Hkv, B, D] pages
    torch.testing.assert_close(got.double(), want_k, atol=TOL, rtol=0)
    assert not runner.cache.k(second).any() and not runner.cache.v(second).any()


@pytest.mark.parametrize("kwargs, message", [
    ({"num_heads": 4, "num_kv_heads": 3}, "draft num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"draft_vocab_size": 257}, "draft_vocab_size 257 exceeds vocab_size 256"),
    ({"num_kv_heads": 0}, "draft num_key_value_heads must be >= 1, got 0"),  # was a ZeroDivisionError
])
def test_eagle3_config_refuses_what_no_head_can_be_built_from(kwargs, message):
    base = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                rope_theta=10000.0, vocab_size=256, draft_vocab_size=256, target_hidden_size=64, aux_layer_ids=(1, 2))
    from m3_eagle_plugin.eagle3.head import Eagle3Config

    Eagle3Config(**base)
    with pytest.raises(ValueError, match=f"^{message}$"):
        Eagle3Config(**{**base, **kwargs})


def test_hidden_rows_that_do_not_match_the_ids_are_refused(tiny):
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    runner = Runner(target, head)
    runner.prepare([("r", 2)])
    with pytest.raises(ValueError, match=r"^expected input_ids \[T\] and hidden \[T, width\], got \(2,\) and \(3, 64\)$"):
        head(torch.zeros(2, dtype=torch.long), torch.zeros(3, 64), runner.meta, runner.cache)


@pytest.mark.parametrize("count", [1, 3])
def test_ids_of_another_count_than_the_metadata_are_refused_naming_both(tiny, count):
    # fewer ids read the first positions of the step, more failed in RoPE's reshape naming nothing
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    runner = Runner(target, head)
    runner.prepare([("r", 2)])
    with pytest.raises(ValueError, match=rf"^input_ids has {count} tokens, the step metadata 2"):
        head(torch.zeros(count, dtype=torch.long), torch.zeros(count, 64), runner.meta, runner.cache)


def test_metadata_of_another_block_size_than_the_cache_is_refused_before_the_draft_layer_writes(tiny):
    """Slots counted in blocks of half a page name other pages' tokens: the draft layer wrote its K/V
    there, then the attention refused the shapes. Refused now with every page as it was."""
    from m3_eagle_plugin.msa.metadata import MsaDecodeMetadata

    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    runner = Runner(target, head)
    runner.prepare([("r", 2)])
    page = runner.cache.k(runner.cache.draft_layer_ids[0]).shape[2]
    meta = MsaDecodeMetadata(2, 8, 8, page // 2, "cpu")
    meta.prepare([2], [4], runner.cache.block_table(["r"]).repeat(1, 2))  # tokens 2, 3: block 1 of 2 tokens
    for pool in runner.cache._storage:
        pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(3)))
    pools = [t.clone() for t in runner.cache._storage]
    with pytest.raises(ValueError, match=rf"the cache's pages hold {page} tokens, the step metadata's block size is "
                                         rf"{page // 2}"):
        head(torch.zeros(2, dtype=torch.long), torch.zeros(2, 64), meta, runner.cache)
    assert all(torch.equal(a, b) for a, b in zip(pools, runner.cache._storage))


@pytest.mark.parametrize("aux_layer_ids, target_hidden", [((3,), 64), ((1, 2), 32), ((), 64)])
def test_an_aux_capture_as_wide_as_the_draft_hidden_is_refused(aux_layer_ids, target_hidden):
    """forward tells step 0 (aux rows, through fc) from later steps (the head's own hidden) by width: one
    aux layer of the draft's width made every aux capture read as a hidden, so fc never ran (a head
    built from such a config gave the same logits with fc zeroed)."""
    from m3_eagle_plugin.eagle3.head import Eagle3Config

    base = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                rope_theta=10000.0, vocab_size=256, draft_vocab_size=256, target_hidden_size=64, aux_layer_ids=(1, 2))
    Eagle3Config(**base)
    with pytest.raises(ValueError, match=rf"^{len(aux_layer_ids)} aux layer id\(s\) of target width {target_hidden} "
                                         rf"make an aux capture {len(aux_layer_ids) * target_hidden} wide, .*fc would "
                                         r"never run$"):
        Eagle3Config(**{**base, "aux_layer_ids": aux_layer_ids, "target_hidden_size": target_hidden})


@pytest.mark.parametrize("width", [16, 40])
def test_draft_logits_of_another_width_than_d2t_are_refused_on_both_paths(tiny, width, monkeypatch):
    """The fused gather reads each row at the draft ids d2t maps: logits 16 wide for a 32-entry d2t were
    read past each row's end (40 wide: in part) and came back as if placed, while the torch scatter
    failed with a bare shape mismatch. Both now name the two widths; the matching width still places."""
    from m3_eagle_plugin.models import fused_ops

    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    head.d2t = torch.arange(32)  # draft d -> target 2d
    gathered = []

    def gather(logits, index):  # the fused op's contract, naively: out[:, c] = logits[:, index[c]]
        gathered.append(logits.shape)
        safe = index.clamp(min=0).long()
        return torch.where(index >= 0, logits.float()[:, safe], float("-inf"))

    for fused in (False, True):
        monkeypatch.setattr(fused_ops, "gather_logits", gather if fused else lambda logits, index: None)
        for call in (head.to_target_logits, head._target_logits):
            with pytest.raises(ValueError, match=rf"^logits score {width} draft ids but d2t maps 32$"):
                call(torch.randn(3, width))
        logits = torch.randn(3, 32)
        assert torch.equal(head._target_logits(logits)[:, 2 * torch.arange(32)], logits)
    assert gathered == [(3, 32)]


def test_one_unbatched_row_of_draft_logits_is_refused_not_broadcast(tiny):
    """to_target_logits takes `[T, Vd]`: one `[Vd]` row came back as Vd rows of `[V]` (the row broadcast
    down every one), not as one placed row."""
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    head.d2t = torch.arange(32)
    row = torch.randn(32)
    with pytest.raises(ValueError, match=r"^draft logits must be \[T, Vd\], got shape \(32,\)$"):
        head.to_target_logits(row)
    assert torch.equal(head.to_target_logits(row[None])[0, 2 * torch.arange(32)], row)


@pytest.mark.parametrize("draft_vocab", [256, 128])
def test_logits_wider_than_the_target_vocabulary_are_named_so_without_d2t(draft_vocab):
    """Without d2t, logits of the target's width are placed as they are and narrower (draft) ones need a
    d2t; wider ones were reported as "draft_vocab_size 300 < vocab_size 256", a false bound naming a
    d2t as the cure."""
    from m3_eagle_plugin.eagle3.head import Eagle3Config, Eagle3Head

    head = Eagle3Head(Eagle3Config(
        hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, vocab_size=256, draft_vocab_size=draft_vocab, target_hidden_size=64,
        aux_layer_ids=(1, 2)))
    full = torch.randn(3, 256)
    assert torch.equal(head.to_target_logits(full), full)
    with pytest.raises(ValueError, match=r"^logits score 300 ids, more than the target's vocab_size 256$"):
        head.to_target_logits(torch.randn(3, 300))
    with pytest.raises(ValueError, match=r"^draft_vocab_size 200 < vocab_size 256 needs a d2t"):
        head.to_target_logits(torch.randn(3, 200))


@pytest.mark.parametrize("kv_heads, params", [(4, 3_074_992_128), (64, 3_263_735_808)], ids=["gqa", "mha"])
def test_production_head_holds_the_references_parameter_count(kv_heads, params):
    """minimax_m3_msa.md §4.5: H 6144, 64 heads x 128, intermediate 18432, full-vocabulary embed and
    lm_head (200064), three aux chunks with fc_norm, 7 RMSNorms: 3,074,992,128 parameters for the GQA
    head (4 KV heads), 3,263,735,808 for the MHA head (64). Built on the meta device (no storage)."""
    from m3_eagle_plugin.eagle3.head import Eagle3Config, Eagle3Head

    config = Eagle3Config(hidden_size=6144, num_heads=64, num_kv_heads=kv_heads, head_dim=128,
                          intermediate_size=18432, rms_norm_eps=1e-6, rope_theta=5e6, vocab_size=200064,
                          draft_vocab_size=200064, target_hidden_size=6144, aux_layer_ids=(2, 30, 57),
                          norm_output=True, has_fc_norm=True)
    with torch.device("meta"):
        head = Eagle3Head(config)
    shapes = {name: tuple(p.shape) for name, p in head.named_parameters()}
    assert shapes["fc.weight"] == (6144, 18432)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (8192, 12288)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (kv_heads * 128, 12288)
    assert sum(1 for name in shapes if "norm" in name) == 7
    assert sum(p.numel() for p in head.parameters()) == params


def test_a_step_of_no_tokens_runs_as_through_the_target_and_changes_nothing(tiny):
    """T = 0 (an idle step) runs through the target model ([0, H], an empty aux capture), and SGLang's
    head returns early on it; the head failed in its attention's reshape(0, -1) ('cannot reshape tensor
    of 0 elements'). It now gives [0, V] fp32 logits and a [0, H] hidden, from aux rows or its own, and
    the next step still equals the dense reference."""
    from m3_eagle_plugin.eagle3.capture import AuxCapture

    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    H, V = head.config.hidden_size, head.config.vocab_size
    runner, capture, none = Runner(target, head), AuxCapture(head.aux_layer_ids), torch.zeros(0, dtype=torch.long)
    runner.prepare([])
    with torch.no_grad():
        assert target(none, runner.meta, runner.cache, capture=capture).shape == (0, H)
        for hidden in (capture.stacked(), torch.zeros(0, H)):
            logits, nxt = head(none, hidden, runner.meta, runner.cache)
            assert logits.dtype == torch.float32 and logits.shape == (0, V) and nxt.shape == (0, H)
        gen = torch.Generator().manual_seed(4)
        ids, aux = torch.randint(0, V, (3,), generator=gen), torch.randn(3, 3 * H, generator=gen)
        runner.prepare([("r", 3)])
        logits, nxt = head(ids, aux, runner.meta, runner.cache)
    want_logits, want_normed, _ = naive_head(head, target.embed_tokens.weight, target.lm_head.weight, ids, list(aux))
    torch.testing.assert_close(logits.double(), want_logits, atol=TOL, rtol=0)
    torch.testing.assert_close(nxt.double(), want_normed, atol=TOL, rtol=0)


def test_a_cache_without_a_draft_layer_is_named_before_anything_is_written(tiny):
    """The head's K/V live in the cache's first draft layer (module docstring); a target-only cache
    (built without num_draft_layers) failed on draft_layer_ids[0] with a bare 'list index out of range'."""
    from m3_eagle_plugin.kv import PagedKVCache

    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    tc = target.config
    runner = Runner(target, head)
    runner.cache = PagedKVCache.for_minimax_m3(tc.num_layers, tc.sparse_layer_ids, tc.num_kv_heads, tc.head_dim,
                                               tc.index_dim or tc.head_dim, tc.block_size, 32, dtype=torch.float32)
    assert not runner.cache.draft_layer_ids
    runner.prepare([("r", 2)])
    pools = [t.clone() for t in runner.cache._storage]
    with pytest.raises(ValueError, match=rf"^the cache hosts no draft layer for the Eagle3 head's K/V: build it with "
                                         rf"num_draft_layers=1, draft_num_kv_heads={head.config.num_kv_heads}$"):
        head(torch.zeros(2, dtype=torch.long), torch.zeros(2, 3 * tc.hidden_size), runner.meta, runner.cache)
    assert all(torch.equal(a, b) for a, b in zip(pools, runner.cache._storage))


def test_a_d2t_outside_the_target_vocabulary_is_refused_where_the_logits_are_placed(tiny):
    """Draft id d means target id d + d2t[d] (vLLM, SGLang, EAGLE). A d2t reaching target id -1 put draft
    d's logit at target id V - 1 (a negative index wraps), while `draft_to_target` said -1; one reaching V
    failed with a bare IndexError. Both are refused by cause, on the paged forward as well."""
    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    vocab = head.config.vocab_size
    logits = torch.arange(1.0, 9.0).view(1, 8)
    d2t = torch.zeros(8, dtype=torch.long)
    d2t[0] = -1  # draft 0 -> target id -1
    head.d2t = d2t
    with pytest.raises(ValueError, match=rf"d2t maps draft ids \[0\] to target ids \[-1\] outside the target "
                                         rf"vocabulary \[0, {vocab}\)"):
        head.to_target_logits(logits)
    d2t = torch.zeros(8, dtype=torch.long)
    d2t[7] = vocab - 7  # draft 7 -> target id V
    head.d2t = d2t
    with pytest.raises(ValueError, match=rf"draft ids \[7\] to target ids \[{vocab}\] outside"):
        head.to_target_logits(logits)
    d2t = d2t.clone()
    d2t[7] = vocab - 8  # draft 7 -> target id V - 1: inside
    head.d2t = d2t
    assert torch.equal(head.to_target_logits(logits)[0, vocab - 1], logits[0, 7])
    head.d2t = torch.full((vocab,), -1)  # draft d -> d - 1: draft 0 -> -1; refused on the paged forward too
    runner = Runner(target, head)
    runner.prepare([("r", 2)])
    with torch.no_grad(), pytest.raises(ValueError, match=r"draft ids \[0\] to target ids \[-1\] outside"):
        head(torch.tensor([1, 2]), torch.randn(2, 3 * 64), runner.meta, runner.cache)


def test_the_paged_head_takes_hidden_states_in_its_own_dtype_as_the_dense_step_does(tiny):
    """`dense_head_step` takes aux in the head's dtype (collected data is fp32); the paged forward failed
    on fp32 rows into a bf16 head with a bare "expected m1 and m2 to have the same dtype", for the aux
    capture and for an H-wide hidden alike. It now steps exactly as on the rows cast first."""
    target = load_target(tiny[0], dtype=torch.bfloat16)
    head = load_draft(tiny[1], target)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (3,), generator=gen)
    for width in (3 * 64, 64):
        rows = torch.randn(3, width, generator=gen)
        outs = []
        for hidden in (rows, rows.bfloat16()):
            runner = Runner(target, head, dtype=torch.bfloat16)
            runner.prepare([("r", 3)])
            with torch.no_grad():
                outs.append(head(ids, hidden, runner.meta, runner.cache))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert outs[0][1].dtype == torch.bfloat16
    runner = Runner(target, head, dtype=torch.bfloat16)
    runner.prepare([("r", 3)])
    with pytest.raises(TypeError, match="hidden must be a floating-point tensor of hidden states, got torch.int64"):
        head(ids, torch.zeros(3, 64, dtype=torch.long), runner.meta, runner.cache)


def test_a_d2t_replacing_a_one_to_one_one_drops_the_old_draft_index_on_both_paths(tiny, monkeypatch):
    """`draft_index` is None unless the CURRENT d2t is one-to-one into the target vocabulary: one left
    from an earlier d2t would make the fused gather (GPU) place logits at the earlier d2t's ids."""
    from m3_eagle_plugin.models import fused_ops

    target = load_target(tiny[0])
    head = load_draft(tiny[1], target)
    vocab = head.config.vocab_size
    head.d2t = torch.arange(8)  # draft d -> target 2d: one-to-one, so a draft_index is built
    assert head.draft_index is not None
    head.d2t = -torch.arange(8)  # every draft id -> target id 0
    assert head.draft_index is None

    def gather(logits, index):  # the fused op's contract, naively: out[:, c] = logits[:, index[c]]
        safe = index.clamp(min=0).long()
        return torch.where(index >= 0, logits.float()[:, safe], float("-inf"))

    logits = torch.randn(2, 8)
    for fused in (False, True):
        monkeypatch.setattr(fused_ops, "gather_logits", gather if fused else lambda logits, index: None)
        out = head._target_logits(logits)
        assert out.shape == (2, vocab) and torch.isinf(out[:, 1:]).all()
        for row in range(2):  # target id 0 holds one of the draft logits that map to it
            assert out[row, 0] in logits[row]
    head.d2t = torch.arange(8)
    head.d2t = torch.full((8,), vocab)  # outside the target vocabulary: refused on the fused path too
    monkeypatch.setattr(fused_ops, "gather_logits", gather)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        head._target_logits(logits)
