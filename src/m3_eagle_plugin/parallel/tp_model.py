"""One tensor-parallel rank's shard of a loaded `MiniMaxM3ForCausalLM`.

The shard is a plain `MiniMaxM3ForCausalLM` built from the rank config (`sharding.rank_config`),
so the paged cache, the step metadata and the reference host run it unchanged. Weights are cut
Megatron style: q/k/v and index_q are column-parallel (this rank's contiguous heads), o_proj is
row-parallel, the MLP / shared expert / routed experts are split on the intermediate dim (gate
and up halves each); the router, embeddings, norms, lm_head and the single shared index_k head
are replicated. Attention's o_proj and the MLP / MoE then hold partial sums, so a forward hook
all-reduces each of them: two all-reduces per layer, the only communication.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
from m3_eagle_plugin.parallel.sharding import ShardingError, rank_config

__all__ = ["shard_state_dict", "shard_target", "attach_all_reduce"]

# (name suffix, how to cut): "rows" = dim 0 slice, "cols" = last dim slice, "halves" = gate and up
# halves of a fused gate_up, each sliced on its intermediate dim (dim -2).
_RULES: tuple[tuple[str, str], ...] = (
    ("self_attn.q_proj.weight", "rows"),
    ("self_attn.k_proj.weight", "rows"),
    ("self_attn.v_proj.weight", "rows"),
    ("self_attn.indexer.q_proj.weight", "rows"),
    ("self_attn.o_proj.weight", "cols"),
    ("gate_up_proj.weight", "halves"),
    ("down_proj.weight", "cols"),
    ("experts.gate_up_proj", "halves"),
    ("experts.down_proj", "cols"),
)


def _rule(name: str) -> str | None:
    for suffix, rule in _RULES:
        if name.endswith(suffix):
            return rule
    return None


def _cut(full: torch.Tensor, rule: str, rank: int, tp_size: int) -> torch.Tensor:
    if rule == "rows":
        return full.chunk(tp_size, dim=0)[rank]
    if rule == "cols":
        return full.chunk(tp_size, dim=-1)[rank]
    gate, up = full.chunk(2, dim=-2)
    return torch.cat([gate.chunk(tp_size, dim=-2)[rank], up.chunk(tp_size, dim=-2)[rank]], dim=-2)


def shard_state_dict(full: dict[str, torch.Tensor], shard_shapes: dict[str, torch.Size], rank: int,
                     tp_size: int) -> dict[str, torch.Tensor]:
    """Cut ``full`` to ``shard_shapes`` (a rank model's state-dict shapes); unsplit names are copied."""
    missing = sorted(set(shard_shapes) - set(full))
    if missing:
        raise KeyError(f"full state dict lacks {missing[:5]}")
    out = {}
    for name, want in shard_shapes.items():
        tensor = full[name]
        if tensor.shape != want:
            rule = _rule(name)
            if rule is None:
                raise ShardingError(f"{name}: full shape {tuple(tensor.shape)} differs from the shard's "
                                    f"{tuple(want)} but the tensor has no tensor-parallel split rule")
            tensor = _cut(tensor, rule, rank, tp_size)
            if tensor.shape != want:
                raise ShardingError(f"{name}: cutting {rule} for rank {rank}/{tp_size} gave "
                                    f"{tuple(tensor.shape)}, the shard needs {tuple(want)}")
        out[name] = tensor.contiguous()
    return out


def attach_all_reduce(model: MiniMaxM3ForCausalLM,
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


def shard_target(model: MiniMaxM3ForCausalLM, rank: int, tp_size: int, *,
                 group: dist.ProcessGroup | None = None) -> MiniMaxM3ForCausalLM:
    """This rank's shard of ``model`` (left untouched), with the all-reduces attached.

    With ``tp_size == 1`` nothing is reduced. Otherwise the default (or given) process group of
    ``tp_size`` ranks must be initialised; tensors are reduced where they live, so the same code
    runs with gloo on CPU and NCCL on GPUs.
    """
    if not isinstance(model, MiniMaxM3ForCausalLM):
        raise TypeError(f"model must be a MiniMaxM3ForCausalLM, got {type(model).__name__}")
    if tp_size > 1:
        if not dist.is_initialized():
            raise RuntimeError("tensor-parallel sharding needs an initialised torch.distributed process group")
        if dist.get_world_size(group) != tp_size:
            raise ShardingError(f"process group has {dist.get_world_size(group)} ranks, tp_size is {tp_size}")
    config = rank_config(model.config, tp_size)
    with torch.device("meta"):  # shapes only: the weights come from ``model``
        shard = MiniMaxM3ForCausalLM(config)
    shapes = {name: t.shape for name, t in shard.state_dict().items()}
    shard.load_state_dict(shard_state_dict(model.state_dict(), shapes, rank, tp_size), strict=True, assign=True)
    shard.rotary = copy.deepcopy(model.rotary)
    left = [name for name, t in shard.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise ShardingError(f"shard tensors left unassigned: {left[:5]}")
    for layer, source in zip(shard.layers, model.layers):
        if hasattr(source.mlp, "graph_safe"):
            layer.mlp.graph_safe = source.mlp.graph_safe
    shard.eval()
    if tp_size > 1:
        attach_all_reduce(shard, lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group))
    return shard
