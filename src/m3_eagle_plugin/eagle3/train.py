"""Self-distillation of an Eagle3 head from its own target (what makes the tiny demo's drafts accept).

Data (`collect_distill_data`): random prompts, the target's greedy continuations (Jacobi
iteration of batched prefills), and for every position p the target's aux capture `aux[p]`, its
distribution and greedy choice `next[p]` for the token at p + 1, all from the plugin's own paged
target forward with `AuxCapture`. Objective (the Eagle3 shift rule): at position p the head
consumes (token at p + 1, aux[p]) and must predict the target's distribution at p + 1, i.e. for the
token at p + 2 (`distill_loss`: KL, optionally plus cross-entropy against `next[p + 1]`).

Training runs a DENSE forward of the head's own submodules (`dense_head_step`: full causal SDPA
over each sequence, no paged cache) with autograd. Test-time training (TTT) pass s >= 1 feeds the
pass s - 1 output hidden from position q - 1 and attends exactly what draft step s of the chain
started at p = q - s sees at inference: pass-0 keys at positions <= p and pass-r keys at p + r.
Only the head's own weights train, an embedding or lm_head its checkpoint ships included; what the
loader took from the target (shared, or the lm_head's rows gathered) stays frozen.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from m3_eagle_plugin._ints import as_int, exact_index
from m3_eagle_plugin.eagle3.capture import AuxCapture
from m3_eagle_plugin.eagle3.head import Eagle3Head
from m3_eagle_plugin.models.rope import apply_rope
from m3_eagle_plugin.msa.blocks import is_integer_dtype

__all__ = [
    "DistillData", "DistillPlan", "collect_distill_data", "concat_data", "dense_head_step", "distill_checkpoint",
    "distill_loss", "lr_factor", "train_head",
]


@dataclass(frozen=True)
class DistillData:
    """Right-padded sequences: `tokens [N, S]`, `aux [N, S, n*H]`, `target_next [N, S]`, `lengths [N]`,
    and the target's log-probabilities `target_logprobs [N, S, V]` (the soft labels of `distill_loss`)."""

    tokens: torch.Tensor
    aux: torch.Tensor
    target_next: torch.Tensor
    lengths: torch.Tensor
    target_logprobs: torch.Tensor

    FIELDS = ("tokens", "aux", "target_next", "lengths", "target_logprobs")

    def select(self, rows: torch.Tensor) -> "DistillData":
        return DistillData(*(getattr(self, f)[rows] for f in self.FIELDS))

    def __post_init__(self) -> None:
        n, s = self.tokens.shape if self.tokens.dim() == 2 else (-1, -1)  # tokens must be [N, S]
        if (n < 0 or self.aux.shape[:2] != (n, s) or self.target_next.shape != (n, s) or self.lengths.shape != (n,)
                or self.target_logprobs.shape[:2] != (n, s)):  # every field named: the one that differs too
            raise ValueError("inconsistent distillation data shapes: "
                             + ", ".join(f"{f} {tuple(getattr(self, f).shape)}" for f in self.FIELDS))
        for field in ("tokens", "target_next"):  # any integer dtype is taken (distill_loss reads them as int64)
            dtype = getattr(self, field).dtype
            if not is_integer_dtype(dtype):
                raise ValueError(f"distillation data {field} must hold integer token ids, got {dtype}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        as_int(name, value, 1, ValueError)


def _check_rates(lr: float, hard_weight: float) -> None:
    if not 0 < lr < math.inf or not 0 <= hard_weight < math.inf:  # an infinite one turns every weight NaN
        raise ValueError(f"lr must be finite and > 0 and hard_weight finite and >= 0, got lr={lr!r}, "
                         f"hard_weight={hard_weight!r}")


def _check_seed(seed: int) -> None:
    """Seeds are ints in [0, 2**64): torch's generators took no float, bool or str but said only "manual_seed
    expected a long" (torch.manual_seed truncated 1.5 first), wrapped -1 to 2**64 - 1 and overflowed past it."""
    value = exact_index(seed)
    if value is None or not 0 <= value < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")


@torch.no_grad()
def collect_distill_data(target, aux_layer_ids: Sequence[int], *, num_sequences: int, seq_len: int,
                         prompt_lens: tuple[int, int] | None = None, iterations: int = 8, seed: int = 0
                         ) -> DistillData:
    """Random prompts continued greedily by `target` (a `MiniMaxM3ForCausalLM`), with aux features.

    Continuations come from Jacobi fixed-point iteration of batched prefills on the paged cache
    (decode steps cost a full pass per request; a prefill costs little per token): start from random
    tokens, prefill every sequence, replace each continuation token by the target's greedy choice at
    the position before it, repeat. After i iterations at least the first i continuation tokens are
    exactly greedy, and every later one is the target's greedy choice for an almost-converged context.
    Every iteration's prefill is kept (`iterations * num_sequences` rows, the last ones the most
    greedy-like): its aux and `target_next` are exact for its tokens. Prompt lengths are uniform in
    `prompt_lens` (inclusive; by default 2..16, capped at `seq_len`). `aux_layer_ids` must be strictly
    ascending, the order in which the head's `fc` takes the aux states (`head.aux_layer_ids`).
    """
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.msa.metadata import MsaDecodeMetadata

    capture = AuxCapture(aux_layer_ids)  # refuses non-int, negative and repeated ids by name
    if list(capture.layer_ids) != sorted(capture.layer_ids):
        # the aux rows are stacked in the given order: any other order trains fc on permuted chunks
        raise ValueError(f"aux layer ids {list(capture.layer_ids)} must be strictly ascending (the order the "
                         "head's fc takes the aux states, as head.aux_layer_ids lists them)")
    _check_positive(num_sequences=num_sequences, seq_len=seq_len, iterations=iterations)
    _check_seed(seed)
    low, high = _prompt_lens(prompt_lens, seq_len)
    cfg = target.config
    device = next(target.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(low, high + 1, (num_sequences, 1), generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (num_sequences, seq_len), generator=gen)
    is_prompt = torch.arange(seq_len)[None, :] < prompt_len
    blocks_per_seq = -(-seq_len // cfg.block_size)
    cache = PagedKVCache.for_minimax_m3(
        cfg.num_layers, list(cfg.sparse_layer_ids), cfg.num_kv_heads, cfg.head_dim, cfg.index_dim or cfg.head_dim,
        cfg.block_size, blocks_per_seq * num_sequences, dtype=next(target.parameters()).dtype, device=device)
    meta = MsaDecodeMetadata(num_sequences, num_sequences * seq_len, blocks_per_seq, cfg.block_size, device,
                             num_index_heads=max(cfg.index_heads, 1))
    for rid in range(num_sequences):
        cache.add_request(rid)
        cache.reserve(rid, seq_len)
    lens = [seq_len] * num_sequences
    meta.prepare(lens, lens, cache.block_table(list(range(num_sequences)), width=blocks_per_seq),
                 num_context_requests=num_sequences)

    def prefill(ids: torch.Tensor) -> DistillData:
        hidden = target(ids.reshape(-1).to(device), meta, cache, capture=capture)
        logprobs = target.compute_logits(hidden).log_softmax(dim=-1).view(num_sequences, seq_len, -1).cpu()
        aux = capture.stacked().float().cpu().view(num_sequences, seq_len, -1)
        return DistillData(ids, aux, logprobs.argmax(dim=-1), torch.full((num_sequences,), seq_len), logprobs)

    rounds = []
    for _ in range(iterations):
        rounds.append(prefill(tokens))
        shifted = torch.cat((tokens[:, :1], rounds[-1].target_next[:, :-1]), dim=1)
        tokens = torch.where(is_prompt, tokens, shifted)
    return concat_data(rounds)


def _prompt_lens(prompt_lens: tuple[int, int] | None, seq_len: int) -> tuple[int, int]:
    if prompt_lens is None:  # capped: a DistillPlan's seq_len under 16 failed naming a pair it cannot set
        return min(2, seq_len), min(16, seq_len)
    # a float, a bool or another count of values failed in torch.randint or the unpacking, naming neither
    pair = tuple(exact_index(v) for v in prompt_lens) if isinstance(prompt_lens, (tuple, list)) else ()
    if len(pair) != 2 or None in pair:
        raise ValueError(f"prompt_lens must be two ints (low, high), got {prompt_lens!r}")
    if not 1 <= pair[0] <= pair[1] <= seq_len:
        raise ValueError(f"prompt_lens must satisfy 1 <= low <= high <= seq_len ({seq_len}), got {prompt_lens!r}")
    return pair


def concat_data(parts: Iterable[DistillData]) -> DistillData:
    """Stack `DistillData` sets of equal sequence length (more rows)."""
    parts = list(parts)
    if not parts:
        raise ValueError("no distillation data to concatenate")
    widths = {p.tokens.shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(f"cannot concatenate distillation data of different lengths {sorted(widths)}")
    for field in ("aux", "target_logprobs"):  # torch.cat's size mismatch named neither the field nor the parts
        sizes = {getattr(p, field).shape[2:] for p in parts}
        if len(sizes) != 1:
            raise ValueError(f"cannot concatenate distillation data whose {field} differ in width: "
                             f"{sorted(tuple(s) for s in sizes)}")
    return DistillData(*(torch.cat([getattr(p, f) for p in parts]) for f in DistillData.FIELDS))


def dense_head_step(head: Eagle3Head, input_ids: torch.Tensor, hidden: torch.Tensor,
                    prior_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One head step over whole sequences `input_ids [B, S]`, `hidden [B, S, W]` (aux or head width, taken
    in the head's dtype as the engine's capture arrives in the target's: collected aux is fp32).

    With no `prior_kv` this is causal attention over the sequence (= draft step 0). With s earlier
    passes' keys/values it is TTT pass s (see the module docstring). Returns (fp32 target-vocabulary
    logits `[B, S, V]`, next-step hidden `[B, S, H]`, this pass's (k, v) `[B, Hkv, S, D]`).
    """
    cfg = head.config
    b, s = input_ids.shape
    if hidden.shape[:2] != (b, s):
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match input_ids {tuple(input_ids.shape)}")
    if hidden.dim() != 3 or hidden.shape[-1] not in (head.fc.in_features, cfg.hidden_size):
        # as the paged head refuses it: any other width failed inside fc_norm or fc with a bare size mismatch
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [B, S, width] with width the aux width "
                         f"{head.fc.in_features} or the draft hidden size {cfg.hidden_size}")
    layer = head.layers[0]
    attn = layer.self_attn
    hidden = hidden.to(head.fc.weight.dtype)
    g = head.combine_aux(hidden) if hidden.shape[-1] != cfg.hidden_size else hidden
    h = layer.hidden_norm(g)
    residual = h if layer.norm_before_residual else g
    x = torch.cat((layer.input_layernorm(head.embed_tokens(input_ids)), h), dim=-1).reshape(b * s, -1)
    cos, sin = head.rotary.cos_sin(torch.arange(s, device=x.device).repeat(b))
    q = apply_rope(attn.q_proj(x).view(b * s, attn.num_heads, attn.head_dim), cos, sin)
    k = apply_rope(attn.k_proj(x).view(b * s, attn.num_kv_heads, attn.head_dim), cos, sin)
    v = attn.v_proj(x).view(b * s, attn.num_kv_heads, attn.head_dim)

    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, s, t.shape[1], attn.head_dim).transpose(1, 2)

    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    passes = len(prior_kv)
    query = torch.arange(s, device=x.device)[:, None]
    key = torch.arange(s, device=x.device)[None, :]
    masks = [key <= query - passes] + [key == query - passes + r for r in range(1, passes + 1)]
    keys = torch.cat([kv[0] for kv in prior_kv] + [k], dim=2)
    values = torch.cat([kv[1] for kv in prior_kv] + [v], dim=2)
    group = attn.num_heads // attn.num_kv_heads
    out = F.scaled_dot_product_attention(
        q, keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1),
        attn_mask=torch.cat(masks, dim=1), scale=attn.scale)
    y = residual + attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
    z = y + layer.mlp(layer.post_attention_layernorm(y))
    normed = head.norm(z)
    logits = head.to_target_logits(head.draft_logits(normed).reshape(b * s, -1)).view(b, s, -1)
    return logits, (normed if cfg.norm_output else z), (k, v)


def distill_loss(head: Eagle3Head, data: DistillData, ttt_steps: int = 1, hard_weight: float = 0.0) -> torch.Tensor:
    """Mean over passes 0..ttt_steps-1 of KL(target || head) at the position the head predicts (Eagle3
    shift rule), plus `hard_weight` times the cross-entropy against the target's greedy token. Passes
    that no position of the batch reaches (pass s needs s + 2 tokens before the row's end) are left out.

    The tiny random target's distributions are nearly flat, so its argmax is a fragile function of
    the context: matching the whole distribution teaches far more per example than the argmax alone.

    A head with a smaller draft vocabulary (`d2t`) gives every other target id probability 0, so the
    KL against the full target distribution is infinite: both sides are taken over the target ids the
    head can propose, the target's renormalized there, and a greedy label outside them is not counted.
    """
    _check_positive(ttt_steps=ttt_steps)  # 0 passes stacked no loss; a float failed in range()
    _check_hard_weight(hard_weight)
    _check_data_fits(head, data)
    # int64: nll_loss took no other labels (int32 ids from a NumPy or Arrow dataset failed with the hard term).
    # On the head's device: `collect_distill_data` returns CPU data, which a CUDA head's embedding refused,
    # and CUDA data failed against the CPU positions below.
    device = head.fc.weight.device
    tokens, target_next = data.tokens.to(device).long(), data.target_next.to(device).long()
    aux, lengths = data.aux.to(device), data.lengths.to(device)
    soft = data.target_logprobs[:, 1:].to(device)  # the target's distribution for the token at p + 2
    s = tokens.shape[1] - 1
    input_ids = tokens[:, 1:]                  # token at p + 1
    features = aux[:, :s]                      # aux at p
    labels = target_next[:, 1:]                # target's greedy token at p + 2
    positions = torch.arange(s, device=device)[None, :]
    valid = positions + 1 < lengths[:, None]   # position p + 1 went through the target
    draft_ids = _draft_target_ids(head, soft.shape[-1])
    hidden: torch.Tensor = features
    prior: list[tuple[torch.Tensor, torch.Tensor]] = []
    losses = []
    for pass_index in range(ttt_steps):
        mask = valid & (positions >= pass_index)
        if not mask.any():  # rows too short for this pass (and so for every later one): KL of nothing is NaN
            if pass_index == 0:
                raise ValueError("distillation batch has no position to train: every row is shorter than 2 tokens")
            break
        logits, out, kv = dense_head_step(head, input_ids, hidden, prior)
        head_logits, target_logprobs, greedy = _on_draft_vocabulary(draft_ids, logits[mask], soft[mask], labels[mask])
        log_q = head_logits.log_softmax(dim=-1)
        # A target probability of 0 (log-probability -inf) adds 0 to the KL; kl_div's exp(t) * (t - log q)
        # reads it as 0 * -inf = NaN, so it is clamped to the lowest finite value, whose term is 0 too.
        target_logprobs = target_logprobs.clamp(min=torch.finfo(target_logprobs.dtype).min)
        loss = F.kl_div(log_q, target_logprobs, log_target=True, reduction="batchmean")
        counted = greedy >= 0
        if hard_weight and counted.any():
            loss = loss + hard_weight * F.nll_loss(log_q[counted], greedy[counted])
        losses.append(loss)
        prior.append(kv)
        hidden = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)  # from q - 1 to q
    return torch.stack(losses).mean()


def _check_hard_weight(hard_weight: float) -> None:
    # a negative one rewards missing the target's greedy token, an infinite one turns every weight NaN
    if not 0 <= hard_weight < math.inf:
        raise ValueError(f"hard_weight must be finite and >= 0, got {hard_weight!r}")


def _check_data_fits(head: Eagle3Head, data: DistillData) -> None:
    """The data's aux rows must be as wide as `fc` takes and its distributions span the target vocabulary
    (data collected for another head or target failed deep inside the step with a bare size mismatch)."""
    if data.aux.shape[-1] != head.fc.in_features:
        raise ValueError(f"distillation data has aux rows {data.aux.shape[-1]} wide; this head's fc takes "
                         f"{head.fc.in_features} ({len(head.aux_layer_ids)} aux layers x target hidden "
                         f"{head.config.target_hidden_size})")
    if data.target_logprobs.shape[-1] != head.config.vocab_size:
        raise ValueError(f"distillation data has target distributions over {data.target_logprobs.shape[-1]} ids; "
                         f"this head's target vocabulary has {head.config.vocab_size}")


def _draft_target_ids(head: Eagle3Head, vocab_size: int) -> torch.Tensor | None:
    """The sorted target ids the head can propose, or None when that is every id (no restriction)."""
    if head.target_ids is None:
        return None
    ids = torch.unique(head.target_ids)
    return None if ids.numel() == vocab_size else ids


def _on_draft_vocabulary(draft_ids: torch.Tensor | None, logits: torch.Tensor, target_logprobs: torch.Tensor,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[P, V]`` head logits and target log-probabilities and ``[P]`` greedy labels, restricted to
    ``draft_ids``: the target renormalized over them, labels as indices into them (-1 when outside)."""
    if draft_ids is None:
        return logits, target_logprobs, labels
    target_logprobs = target_logprobs[:, draft_ids.to(target_logprobs.device)]
    target_logprobs = target_logprobs - target_logprobs.logsumexp(dim=-1, keepdim=True)
    label_ids = draft_ids.to(labels.device)
    where = torch.searchsorted(label_ids, labels).clamp(max=label_ids.numel() - 1)
    labels = torch.where(label_ids[where] == labels, where, torch.full_like(labels, -1))
    return logits[:, draft_ids.to(logits.device)], target_logprobs, labels


def lr_factor(step: int, steps: int) -> float:
    """The learning-rate multiplier of 0-based optimizer step `step` out of `steps`.

    Warm-up over w = min(20, max(1, steps // 10)) steps: (step + 1) / w, reaching 1 at step w - 1;
    then a linear decay from 1 there to 0 at step `steps`: (steps - step) / (steps - w + 1). Step
    `steps` is one past the last, so every step trains at a positive rate.
    """
    warmup = min(20, max(1, steps // 10))
    return min((step + 1) / warmup, (steps - step) / (steps - warmup + 1))


def train_head(head: Eagle3Head, data: DistillData, *, steps: int, batch_size: int = 16, lr: float = 1e-2,
               ttt_steps: int = 1, hard_weight: float = 0.0, seed: int = 0) -> list[float]:
    """AdamW on the head's own weights, those its checkpoint ships (not the embedding or lm_head taken
    from the target, `head.from_target`); returns the loss per step.

    Each step draws `batch_size` rows of `data` (of those with a position to train: 2 tokens or more);
    step i runs at `lr * lr_factor(i, steps)` (a linear warm-up to `lr`, then a linear decay toward 0).
    The head is left in eval mode with gradients off. A loss that is not finite (NaN data, a target's
    inf logits, a rate too high) is refused by its cause; on that or any other error, Ctrl-C
    included, the weights are put back as they were (a copy of the trainable ones is kept meanwhile).
    """
    _check_positive(steps=steps, batch_size=batch_size, ttt_steps=ttt_steps)
    _check_seed(seed)
    _check_rates(lr, hard_weight)
    # A row shorter than 2 tokens has no position to predict; a batch drawn from such rows alone raised
    # in `distill_loss` after earlier steps had changed the weights. They are left out of the draw.
    trainable = (data.lengths >= 2).nonzero().flatten()
    if trainable.numel() == 0:
        raise ValueError("distillation data has no position to train: every row is shorter than 2 tokens")
    if trainable.numel() < data.lengths.shape[0]:
        data = data.select(trainable)
    shared = {id(p) for name in head.from_target for p in getattr(head, name).parameters()}
    params = [p for p in head.parameters() if id(p) not in shared]
    for p in head.parameters():
        p.requires_grad_(id(p) not in shared)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i, steps))
    gen = torch.Generator().manual_seed(seed)
    n = data.tokens.shape[0]
    history = []
    # put back on an error: a NaN loss trained on silently (clip_grad_norm_ passes NaN) and distill_checkpoint saved it
    before = [p.detach().clone() for p in params]
    head.train()
    try:
        for step in range(steps):
            pick = torch.randperm(n, generator=gen)[:batch_size]
            batch = data.select(pick)
            loss = distill_loss(head, batch, ttt_steps, hard_weight)
            if not torch.isfinite(loss):
                raise ValueError(f"distillation loss is {loss.item()} at step {step} of {steps}: "
                                 f"{_non_finite_cause(batch, before, lr)}; the head's weights are left as they were")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            history.append(float(loss.detach()))
    except BaseException:
        with torch.no_grad():
            for p, saved in zip(params, before):
                p.copy_(saved)
        raise
    finally:
        head.eval().requires_grad_(False)
    return history


def _non_finite_cause(data: DistillData, weights: list[torch.Tensor], lr: float) -> str:
    """Why training went non-finite: the head's own weights, the data (a target log-probability of -inf
    is a probability of 0, and legal), else the step size."""
    if not all(bool(torch.isfinite(w).all()) for w in weights):
        return "the head's weights were not finite before training"
    if not torch.isfinite(data.aux).all():
        return "the data holds non-finite aux features"
    if data.target_logprobs.isnan().any() or (data.target_logprobs == math.inf).any():
        return "the data holds NaN or +inf target log-probabilities (a target with non-finite logits)"
    return f"the weights diverged (lr={lr!r} is too high)"


@dataclass(frozen=True)
class DistillPlan:
    """How much data and training `distill_checkpoint` spends (defaults: ~15 s on one CPU thread)."""

    steps: int = 300
    num_sequences: int = 64
    seq_len: int = 48
    iterations: int = 6
    batch_size: int = 16
    lr: float = 1e-2
    ttt_steps: int = 1  # 2 trains draft step 2 as well but doubles the time for little gain on the tiny target
    hard_weight: float = 0.0

    def __post_init__(self) -> None:  # refused where it is made, not after the pair loaded and the data collected
        _check_positive(steps=self.steps, num_sequences=self.num_sequences, seq_len=self.seq_len,
                        iterations=self.iterations, batch_size=self.batch_size, ttt_steps=self.ttt_steps)
        _check_rates(self.lr, self.hard_weight)


def distill_checkpoint(target_dir, draft_dir, *, plan: DistillPlan = DistillPlan(), seed: int = 0,
                       embeddings: str = "target") -> list[float]:
    """Train the Eagle3 head at `draft_dir` on its target at `target_dir` and overwrite its weights in place.

    The head is loaded as it will be served (``embeddings`` as `load_draft` takes it): what it takes
    from the target stays frozen, and an embedding or lm_head the checkpoint ships but that choice
    leaves unused is written back unchanged. The tensor names, the config and the file's metadata (its
    "format" "pt") stay those of the input checkpoint (public Eagle3 layout).
    Runs on one CPU thread, so the result is a pure function of the inputs, the plan and the seed.
    Returns the training loss per step.
    """
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from m3_eagle_plugin.eagle3.checkpoint import canonical_name, check_embeddings, load_draft
    from m3_eagle_plugin.models.loader import load_target

    _check_seed(seed)  # before the pair is loaded and the data collected
    check_embeddings(embeddings)
    weights = Path(draft_dir) / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"no draft weights at {weights} (distill_checkpoint expects one safetensors file)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone, which fork_rng puts back: torch.manual_seed reseeded every device's
            torch.random.default_generator.manual_seed(seed)
            target = load_target(target_dir)
            head = load_draft(draft_dir, target, embeddings=embeddings)
            data = collect_distill_data(target, head.aux_layer_ids, num_sequences=plan.num_sequences,
                                        seq_len=plan.seq_len, iterations=plan.iterations, seed=seed)
            history = train_head(head, data, steps=plan.steps, batch_size=plan.batch_size, lr=plan.lr,
                                 ttt_steps=plan.ttt_steps, hard_weight=plan.hard_weight, seed=seed)
    finally:
        torch.set_num_threads(threads)
    trained = head.state_dict()
    old = load_file(str(weights))
    with safe_open(str(weights), "pt") as f:
        metadata = {**(f.metadata() or {}), "format": "pt"}  # written by torch, whatever wrote the original
    new = {}
    for name in sorted(old):  # names the head does not hold as weights (d2t, t2d) are kept as they were
        canon = canonical_name(name)
        value = old[name] if canon.split(".")[0] in head.from_target else trained.get(canon, old[name])
        new[name] = value.detach().to(old[name].dtype).contiguous()
    _replace_file(weights, lambda path: save_file(new, str(path), metadata=metadata))
    return history


def _replace_file(path, write) -> None:
    """`write(tmp)` next to `path`, then rename over it: a failed or interrupted write (disk full,
    Ctrl-C) leaves the old checkpoint intact instead of a truncated one."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, os.stat(path).st_mode & 0o777)  # mkstemp's 0600 would hide a shared checkpoint
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
