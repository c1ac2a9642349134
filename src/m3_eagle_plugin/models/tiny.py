"""`m3-eagle make-tiny OUT_DIR [--seed N] [--train-steps N]`: a tiny MiniMax-M3 target and Eagle3 head.

OUT_DIR/target is a production-layout checkpoint (`MiniMaxM3SparseForConditionalGeneration`,
`language_model.model.layers.{i}...`, unfused expert w1/w2/w3) that transformers>=5.13 loads
(vision weights are left out; transformers initialises its tiny vision tower itself). It has
8 layers (3 dense + 5 MSA/MoE), block size 4 and top-3 blocks, so sparsity is active after
12 tokens. OUT_DIR/draft is an Eagle3 head in the public `LlamaForCausalLMEagle3` layout
(`midlayer.*`, `fc`, `fc_norm.{0,1,2}`, GQA, no embed/lm_head: it shares the target's).
The target is random. The draft starts random and, unless `--train-steps 0`, is then
self-distilled from the target (`eagle3.train.distill_checkpoint`, ~15 s on one CPU thread) so
that the demo shows real acceptance; `make_tiny()` defaults to the random head (fast fixtures).
Output is a pure function of the seed and the step count. Only torch + safetensors are used.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save

from m3_eagle_plugin._ints import as_int

HIDDEN, LAYERS, DENSE_LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 8, 3, 4, 2, 16
VOCAB, EXPERTS, TOP_K, EXPERT_I, DENSE_I, SHARED_I = 256, 8, 2, 32, 96, 32
INDEX_HEADS, INDEX_DIM, BLOCK, TOPK_BLOCKS = 2, 16, 4, 3
ROPE_THETA, DRAFT_I = 10000.0, 128
DEFAULT_TRAIN_STEPS = 300  # the CLI default; make_tiny() itself defaults to 0 (random head)


def target_config() -> dict[str, Any]:
    moe = [0] * DENSE_LAYERS + [1] * (LAYERS - DENSE_LAYERS)
    text = {
        "model_type": "minimax_m3_vl_text",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "intermediate_size": EXPERT_I, "dense_intermediate_size": DENSE_I, "shared_intermediate_size": SHARED_I,
        "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "routed_scaling_factor": 2.0,
        "scoring_func": "sigmoid", "hidden_act": "swigluoai", "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "moe_layer_freq": moe, "rms_norm_eps": 1e-6, "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.5,
        "rotary_dim": HEAD_DIM // 2, "qk_norm_type": "per_head", "use_gemma_norm": True,
        "attention_output_gate": False, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": None,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": INDEX_DIM, "sparse_num_index_heads": INDEX_HEADS,
            "sparse_topk_blocks": TOPK_BLOCKS, "sparse_block_size": BLOCK, "sparse_score_type": "max",
            "sparse_init_block": 0, "sparse_local_block": 1, "sparse_disable_index_value": moe,
            "sparse_attention_freq": moe,
        },
    }
    vision = {
        "model_type": "minimax_m3_vl_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "patch_size": 14, "image_size": 56, "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
        "text_config": text, "vision_config": vision, "projector_hidden_size": HIDDEN,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def draft_config(aux_layer_ids: tuple[int, int, int] = (2, LAYERS // 2, LAYERS - 3)) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": DRAFT_I, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": ROPE_THETA, "max_position_embeddings": 4096,
        "vocab_size": VOCAB, "draft_vocab_size": VOCAB, "target_hidden_size": HIDDEN,
        "tie_word_embeddings": False, "norm_output": True, "fc_norm": True, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    }


def _target_shapes() -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (VOCAB, HIDDEN),
        "language_model.model.norm.weight": (HIDDEN,),
        "language_model.lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"language_model.model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (q, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
        })
        if i < DENSE_LAYERS:
            shapes.update({p + "mlp.gate_proj.weight": (DENSE_I, HIDDEN), p + "mlp.up_proj.weight": (DENSE_I, HIDDEN),
                           p + "mlp.down_proj.weight": (HIDDEN, DENSE_I)})
            continue
        shapes.update({
            p + "self_attn.index_q_proj.weight": (INDEX_HEADS * INDEX_DIM, HIDDEN),
            p + "self_attn.index_k_proj.weight": (INDEX_DIM, HIDDEN),
            p + "self_attn.index_q_norm.weight": (INDEX_DIM,), p + "self_attn.index_k_norm.weight": (INDEX_DIM,),
        })
        m = p + "block_sparse_moe."
        shapes.update({m + "gate.weight": (EXPERTS, HIDDEN), m + "e_score_correction_bias": (EXPERTS,),
                       m + "shared_experts.gate_proj.weight": (SHARED_I, HIDDEN),
                       m + "shared_experts.up_proj.weight": (SHARED_I, HIDDEN),
                       m + "shared_experts.down_proj.weight": (HIDDEN, SHARED_I)})
        for e in range(EXPERTS):
            shapes.update({f"{m}experts.{e}.w1.weight": (EXPERT_I, HIDDEN),
                           f"{m}experts.{e}.w3.weight": (EXPERT_I, HIDDEN),
                           f"{m}experts.{e}.w2.weight": (HIDDEN, EXPERT_I)})
    return shapes


def _draft_shapes() -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    p = "midlayer."
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (HIDDEN, 3 * HIDDEN), "norm.weight": (HIDDEN,),
        p + "input_layernorm.weight": (HIDDEN,), p + "hidden_norm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (q, 2 * HIDDEN), p + "self_attn.k_proj.weight": (kv, 2 * HIDDEN),
        p + "self_attn.v_proj.weight": (kv, 2 * HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, q),
        p + "mlp.gate_proj.weight": (DRAFT_I, HIDDEN), p + "mlp.up_proj.weight": (DRAFT_I, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, DRAFT_I),
    }
    shapes.update({f"fc_norm.{i}.weight": (HIDDEN,) for i in range(3)})
    return shapes


def _random_tensors(shapes: dict[str, tuple[int, ...]], seed: int, llama_norms: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        x = torch.randn(shapes[name], generator=gen)
        if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm."):
            # Gemma norms scale by 1 + w (w near 0); Llama norms by w (w near 1)
            x = (1.0 if llama_norms else 0.0) + 0.2 * x
        elif "e_score_correction_bias" in name:
            x = 0.1 * x
        elif "embed_tokens" in name:
            x = 0.5 * x
        else:
            x = x / shapes[name][-1] ** 0.5  # unit-variance outputs
        out[name] = x.contiguous()
    return out


#: Left in each directory make-tiny writes, so a later run (of any version) knows it may replace it.
MARKER = ".m3-eagle-make-tiny"


def _write(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # not save_file: it can create the file 0600 (safetensors 0.8 does), hiding the weights from other
    # users; written like config.json, the file gets 0666 less the umask
    (directory / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    (directory / MARKER).write_text("written by m3-eagle make-tiny; it may replace this directory\n")


def make_tiny(out_dir: str | Path, seed: int = 0, train_steps: int = 0) -> tuple[Path, Path]:
    """Write OUT_DIR/target and OUT_DIR/draft; returns both paths.

    `train_steps > 0` self-distills the draft from the target for that many optimizer steps. Both
    are built in a temporary directory inside OUT_DIR and moved into place at the end (replacing
    an earlier pair), so a failure or an interrupt leaves no half-written or untrained output.
    """
    train_steps = as_int("train_steps", train_steps, 0, ValueError)
    seed = as_int("seed", seed, 0, ValueError)
    if seed >= 2**63 - 1:
        raise ValueError(f"seed must be an int in [0, 2**63 - 1), got {seed!r}")
    if not str(out_dir).strip():  # Path("") is the current directory
        raise ValueError("OUT_DIR is empty: give the directory to write target/ and draft/ in")
    out = Path(out_dir)
    target, draft = out / "target", out / "draft"
    for path in (out, target, draft):  # a broken symlink too: it fails only at the swap, after the training
        if os.path.lexists(path) and not path.is_dir():
            broken = "" if path.exists() else " (a broken symlink)"
            raise ValueError(f"{path} exists and is not a directory{broken}")
    for path, configs in ((target, [target_config()]), (draft, _draft_configs_written())):
        if path.is_dir() and not _replaceable(path, configs):
            raise ValueError(f"{path} exists and is not make-tiny output, or holds files make-tiny did not write: "
                             "refusing to replace it (choose another OUT_DIR, or remove it yourself)")
    created = [p for p in (out, *out.parents) if not os.path.lexists(p)]  # removed again on a failure
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".make-tiny-", dir=out))
    done = False
    try:
        _write(staging / "target", target_config(), _random_tensors(_target_shapes(), seed, llama_norms=False))
        _write(staging / "draft", draft_config(), _random_tensors(_draft_shapes(), seed + 1, llama_norms=True))
        if train_steps:
            from m3_eagle_plugin.eagle3.train import DistillPlan, distill_checkpoint

            distill_checkpoint(staging / "target", staging / "draft", plan=DistillPlan(steps=train_steps), seed=seed)
        _swap_in(staging, out)
        done = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for path in () if done else created:  # innermost first; one another process filled stays
            with contextlib.suppress(OSError):
                path.rmdir()
    return target, draft


_PAIR = ("target", "draft")


#: What make-tiny writes in each of target/ and draft/: a directory holding anything more is not replaced.
_WRITTEN = frozenset({"config.json", "model.safetensors", MARKER})


def _draft_configs_written() -> list[dict[str, Any]]:
    """The draft config.json of every version before the marker: today's, and the one before `fc_norm`
    was written beside the fc_norm tensors (otherwise the same)."""
    earlier = draft_config()
    del earlier["fc_norm"]
    return [draft_config(), earlier]


def _replaceable(path: Path, configs: list[dict[str, Any]]) -> bool:
    """Whether make-tiny may replace directory `path`: empty, or an earlier make-tiny's output (its
    marker, or, from versions before the marker, exactly a config.json make-tiny wrote there, one of
    `configs`) holding nothing make-tiny did not write; anything else may be someone's checkpoint or files."""
    entries = {entry.name for entry in path.iterdir()}
    if not entries:
        return True
    if not entries <= _WRITTEN:  # a tokenizer or a save_pretrained over the pair would be deleted with it
        return False
    if (path / MARKER).is_file():
        return True
    try:
        return json.loads((path / "config.json").read_text()) in json.loads(json.dumps(configs))
    except (OSError, ValueError):
        return False


def _swap_in(staging: Path, out: Path) -> None:
    """Move the new pair from `staging` into `out`; the earlier pair is parked in `staging` first and
    put back if that fails part way, so `out` never keeps one new and one old (or a lone) directory."""
    parked = staging / "previous"
    parked.mkdir()
    try:
        for name in _PAIR:
            if (out / name).is_dir():
                os.replace(out / name, parked / name)
        for name in _PAIR:
            os.replace(staging / name, out / name)
    except BaseException:
        for name in _PAIR:
            if not (staging / name).exists() and (out / name).is_dir():  # already swapped in: take it out
                shutil.rmtree(out / name)
            if (parked / name).is_dir():
                os.replace(parked / name, out / name)
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to create target/ and draft/ in")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed in [0, 2**63 - 1) (default 0; output is a pure function of it)")
    parser.add_argument("--train-steps", type=int, default=DEFAULT_TRAIN_STEPS, metavar="N",
                        help=f"self-distillation steps for the draft head (default {DEFAULT_TRAIN_STEPS}, "
                             "5-10 s on two CPU cores; 0 = random head)")


def main(args: argparse.Namespace) -> int:
    if args.train_steps < 0:
        print(f"m3-eagle make-tiny: --train-steps must be >= 0, got {args.train_steps}", file=sys.stderr)
        return 2
    if not 0 <= args.seed < 2**63 - 1:  # make_tiny's own check names its parameter, not the option
        print(f"m3-eagle make-tiny: --seed must be in [0, 2**63 - 1), got {args.seed}", file=sys.stderr)
        return 2
    try:
        target, draft = make_tiny(args.out_dir, args.seed, args.train_steps)
    except (ValueError, OSError, SafetensorError) as error:  # SafetensorError: a failed write (disk full)
        print(f"m3-eagle make-tiny: {error}", file=sys.stderr)
        return 2
    how = f"trained for {args.train_steps} steps" if args.train_steps else "random"
    print(f"wrote {target} and {draft} (draft head {how})")
    return 0
