"""One tensor-parallel rank's shard of a loaded `MiniMaxM3ForCausalLM`.

The shard is a plain `MiniMaxM3ForCausalLM` built from the rank config (`sharding.rank_config`),
so the paged cache, the step metadata and the reference host run it unchanged. Weights are cut
Megatron style: q/k/v and index_q are column-parallel (this rank's contiguous heads), o_proj is
row-parallel, the MLP / shared expert / routed experts are split on the intermediate dim (gate
and up halves each); the router, embeddings, norms, lm_head and the single shared index_k head
are replicated. Attention's o_proj and the MLP / MoE then hold partial sums, so a forward hook
all-reduces each of them: two all-reduces per layer, the only communication. The Eagle3 head's
one layer is cut the same way (`shard_draft_head`), so its KV heads per rank match the target's.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from m3_eagle_plugin._ints import as_int
from m3_eagle_plugin.eagle3.head import Eagle3Head
from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
from m3_eagle_plugin.parallel.sharding import ShardingError, rank_config, shard_width

__all__ = ["shard_state_dict", "shard_target", "shard_draft_head", "attach_all_reduce"]

# (name suffix, how to cut): "rows" = dim 0 slice, "cols" = last dim slice, "halves" = gate and up
# halves of a fused gate_up, each sliced on its intermediate dim (dim -2).
_RULES: tuple[tuple[str, str], ...] = (
    ("self_attn.q_proj.weight", "rows"),
    ("self_attn.k_proj.weight", "rows"),
    ("self_attn.v_proj.weight", "rows"),
    ("self_attn.indexer.q_proj.weight", "rows"),
    ("self_attn.o_proj.weight", "cols"),
    ("gate_up_proj.weight", "halves"),
    ("mlp.gate_proj.weight", "rows"),  # the Eagle3 head's unfused SiLU-GLU
    ("mlp.up_proj.weight", "rows"),
    ("down_proj.weight", "cols"),
    ("experts.gate_up_proj", "halves"),
    ("experts.down_proj", "cols"),
)


def _rule(name: str) -> str | None:
    for suffix, rule in _RULES:
        if name.endswith(suffix):
            return rule
    return None


def _part(name: str, full: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Rank's equal slice of ``dim``. Not `torch.chunk`: for a size ``parts`` does not divide it
    gives the first ranks full-size pieces (that pass a shape check) and the last a short one or none."""
    size = full.shape[dim]
    if size % parts:
        raise ShardingError(f"{name}: dim {dim} of size {size} does not split into {parts} equal parts")
    step = size // parts
    return full.narrow(dim, rank * step, step)


def _cut(name: str, full: torch.Tensor, rule: str, rank: int, tp_size: int) -> torch.Tensor:
    if rule == "rows":
        return _part(name, full, 0, rank, tp_size)
    if rule == "cols":
        return _part(name, full, full.dim() - 1, rank, tp_size)
    gate, up = (_part(name, full, full.dim() - 2, half, 2) for half in (0, 1))
    return torch.cat([_part(name, gate, gate.dim() - 2, rank, tp_size),
                      _part(name, up, up.dim() - 2, rank, tp_size)], dim=-2)


def shard_state_dict(full: dict[str, torch.Tensor], shard_shapes: dict[str, torch.Size], rank: int,
                     tp_size: int) -> dict[str, torch.Tensor]:
    """Cut ``full`` to ``shard_shapes`` (a rank model's state-dict shapes). A cut tensor owns its
    memory (just this rank's slice); an unsplit one is passed through (shares ``full``'s storage,
    or is a contiguous copy of a non-contiguous one). A ``full`` already cut (a rank's shard, of any
    rank) is refused."""
    rank, tp_size = _check_rank(rank, tp_size)
    missing = sorted(set(shard_shapes) - set(full))
    if missing:
        raise ShardingError(f"the full state dict lacks {missing[:5]}")
    out = {}
    for name, want in shard_shapes.items():
        tensor = full[name]
        if tensor.shape == want and tp_size > 1 and _rule(name) is not None:
            # every split width is >= 1, so a full tensor is tp_size times its cut: this one was cut before
            raise ShardingError(f"{name}: full shape {tuple(tensor.shape)} is already the shard's: the state "
                                f"dict holds a rank's shard, not the unsharded model (it would pass as rank {rank}'s)")
        if tensor.shape != want:
            rule = _rule(name)
            if rule is None:
                raise ShardingError(f"{name}: full shape {tuple(tensor.shape)} differs from the shard's "
                                    f"{tuple(want)} but the tensor has no tensor-parallel split rule")
            tensor = _cut(name, tensor, rule, rank, tp_size)
            if tensor.shape != want:
                raise ShardingError(f"{name}: cutting {rule} for rank {rank}/{tp_size} gave "
                                    f"{tuple(tensor.shape)}, the shard needs {tuple(want)}")
            # a copy of its own: a row cut is a view that would pin (and save, and write through
            # to) the whole unsharded tensor
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        out[name] = tensor.contiguous()
    return out


def attach_all_reduce(model: MiniMaxM3ForCausalLM | Eagle3Head,
                      reduce: Callable[[torch.Tensor], None]) -> list[torch.utils.hooks.RemovableHandle]:
    """Hook ``reduce`` (an in-place sum over the ranks) on every layer's attention and MLP / MoE."""
    def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        reduce(output)
        return output

    handles = []
    for layer in model.layers:
        handles.append(layer.self_attn.register_forward_hook(hook))
        handles.append(layer.mlp.register_forward_hook(hook))
    return handles


def _check_rank(rank: int, tp_size: int) -> tuple[int, int]:
    """Both as ints (a float rank failed inside ``narrow``, a bool one cut as rank 1), rank in range."""
    rank, tp_size = as_int("rank", rank), as_int("tp_size", tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside [0, {tp_size})")
    return rank, tp_size


def _check_unsharded(module: nn.Module, what: str) -> None:
    """A rank's shard holds a part of every cut weight and sums through its hooks: cut again it ran
    with a part of a part (or, at TP1, without the sums), on other logits, without a word."""
    shard = getattr(module, "tp_shard", None)
    if shard is not None:
        raise ShardingError(f"{what} is already rank {shard[0]}'s shard of tensor-parallel size {shard[1]}: "
                            f"shard the unsharded {what}")


def _joined(shard: nn.Module, rank: int, tp_size: int, group: dist.ProcessGroup | None) -> nn.Module:
    """``shard`` summing its partial outputs over ``group`` and saying whose shard it is (tp_size > 1)."""
    if tp_size > 1:
        attach_all_reduce(shard, _reduce_over(group, rank, tp_size))
        shard.tp_shard = (rank, tp_size)
    return shard


def _reduce_over(group: dist.ProcessGroup | None, rank: int, tp_size: int) -> Callable[[torch.Tensor], None]:
    """The in-place sum over ``group``, which must still be the one the shard was cut for: torn down
    and re-initialised (an engine rebuilt after a failure) in a group of another size, or at another
    rank, the shard's partial sums were summed with the wrong shards or not at all, without a word."""
    def reduce(tensor: torch.Tensor) -> None:
        try:
            joined = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else None
        except ValueError:  # a group torn down since: "not registered"
            joined = None
        if joined != (rank, tp_size):
            where = "no process group" if joined is None else f"process group rank {joined[0]} of {joined[1]}"
            raise ShardingError(f"rank {rank}'s shard of tensor-parallel size {tp_size} runs in {where} (the group "
                                f"was re-initialised since it was cut?): shard the model again in this group")
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        except RuntimeError as error:  # gloo and NCCL name neither this rank nor the sum
            cause = (f"rank {rank} of tensor-parallel size {tp_size}: the all-reduce of a layer's partial sums "
                     f"failed (a rank died, raised before it, or did not reach it within the process group's "
                     f"timeout): {error}")
            try:  # the same type (torch's DistBackendError, say), so a caller's handler still matches
                named = type(error)(cause)
            except Exception:  # noqa: BLE001 - a type that does not take a message
                named = RuntimeError(cause)
            raise named from error
    return reduce


def _check_group(rank: int, tp_size: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    rank, tp_size = _check_rank(rank, tp_size)
    if tp_size > 1:
        if not dist.is_initialized():
            raise RuntimeError("tensor-parallel sharding needs an initialised torch.distributed process group")
        if dist.get_world_size(group) != tp_size or dist.get_rank(group) != rank:
            raise ShardingError(f"process group rank {dist.get_rank(group)} of {dist.get_world_size(group)} "
                                f"does not match rank {rank} of tp_size {tp_size}")
    return rank, tp_size


def _cut_copy(source: nn.Module, build: Callable[[], nn.Module], rank: int, tp_size: int) -> nn.Module:
    """``build()`` on the meta device (shapes only), then filled with ``source``'s cut weights."""
    with torch.device("meta"):
        shard = build()
    shapes = {name: t.shape for name, t in shard.state_dict().items()}
    shard.load_state_dict(shard_state_dict(source.state_dict(), shapes, rank, tp_size), strict=True, assign=True)
    shard.rotary = copy.deepcopy(source.rotary)
    for name, buffer in source.named_buffers():  # buffers the state dict skips (None at build time)
        if buffer is not None and name not in shapes and "." not in name:
            setattr(shard, name, buffer)
    left = [name for name, t in [*shard.named_parameters(), *shard.named_buffers()] if t.is_meta]
    if left:
        raise ShardingError(f"shard tensors left unassigned: {left[:5]}")
    return shard.eval().requires_grad_(False)  # inference only, like the loaded models it is cut from


def shard_target(model: MiniMaxM3ForCausalLM, rank: int, tp_size: int, *,
                 group: dist.ProcessGroup | None = None) -> MiniMaxM3ForCausalLM:
    """This rank's shard of ``model`` (left untouched), with the all-reduces attached.

    With ``tp_size == 1`` nothing is reduced. Otherwise the default (or given) process group of
    ``tp_size`` ranks must be initialised and ``rank`` must be this process's rank in it; tensors
    are reduced where they live, so the same code runs with gloo on CPU and NCCL on GPUs.
    Replicated weights share storage with ``model`` (inference only). A shard of ``tp_size > 1``
    says whose it is (``tp_shard = (rank, tp_size)``) and is refused here, as by `shard_draft_head`;
    run in a group where this process is no longer ``rank`` of ``tp_size`` it raises `ShardingError`.
    """
    if not isinstance(model, MiniMaxM3ForCausalLM):
        raise TypeError(f"model must be a MiniMaxM3ForCausalLM, got {type(model).__name__}")
    _check_unsharded(model, "model")
    rank, tp_size = _check_group(rank, tp_size, group)
    config = rank_config(model.config, tp_size)
    shard = _cut_copy(model, lambda: MiniMaxM3ForCausalLM(config), rank, tp_size)
    for layer, source in zip(shard.layers, model.layers):
        if hasattr(source.mlp, "graph_safe"):
            layer.mlp.graph_safe = source.mlp.graph_safe
    return _joined(shard, rank, tp_size, group)


def shard_draft_head(head: Eagle3Head, rank: int, tp_size: int, *,
                     group: dist.ProcessGroup | None = None) -> Eagle3Head:
    """This rank's shard of the Eagle3 head, cut like a target layer (q/k/v and gate/up by column,
    o/down by row, fc / norms / embeddings / lm_head / d2t replicated), all-reduces attached.

    Its KV heads per rank then match the target's, so the shared draft layer keeps fitting the
    target's K/V pool on every rank.
    """
    if not isinstance(head, Eagle3Head):
        raise TypeError(f"head must be an Eagle3Head, got {type(head).__name__}")
    _check_unsharded(head, "head")
    rank, tp_size = _check_group(rank, tp_size, group)
    cfg = head.config
    config = dataclasses.replace(
        cfg, num_heads=shard_width("draft num_attention_heads", cfg.num_heads, tp_size),
        num_kv_heads=shard_width("draft num_key_value_heads", cfg.num_kv_heads, tp_size),
        intermediate_size=shard_width("draft intermediate_size", cfg.intermediate_size, tp_size),
    )
    shard = _cut_copy(head, lambda: Eagle3Head(config), rank, tp_size)
    shard.from_target = head.from_target  # what came from the target still does (`train_head` keeps it)
    return _joined(shard, rank, tp_size, group)
