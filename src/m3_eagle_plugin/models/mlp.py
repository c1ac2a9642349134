"""MiniMax-M3 feed-forward blocks: the SwiGLU-OAI MLP and the sigmoid-routed MoE.

SwiGLU-OAI: gate = min(gate, limit), up = clamp(up, -limit, limit),
out = down((up + 1) * gate * sigmoid(alpha * gate)). Gate and up live in one fused
`gate_up_proj` (gate rows first). The MoE routes with sigmoid scores; the selection adds
`e_score_correction_bias`, the combine weights are the unbiased scores of the chosen experts
renormalised to 1, the routed sum is scaled by `routed_scaling_factor` and the shared expert's
output is added.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class SwigluOaiMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))


class SigmoidRouter(nn.Module):
    """Top-k expert choice; router logits are computed in fp32."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (combine weights fp32 `[T, k]`, expert ids `[T, k]`)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.float()
        expert_ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        return weights / weights.sum(dim=-1, keepdim=True), expert_ids


class RoutedExperts(nn.Module):
    """Expert weights as stacked tensors: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float,
                 limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                graph_safe: bool = False) -> torch.Tensor:
        if graph_safe:
            return self._all_experts(x, weights, expert_ids)
        num_tokens, top_k = expert_ids.shape
        flat_experts = expert_ids.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // top_k
        out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
        flat_weights = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start:start + count]
            h = swiglu_oai(F.linear(x[rows], self.gate_up_proj[expert]), self.alpha, self.limit)
            y = F.linear(h, self.down_proj[expert])
            out.index_add_(0, rows, y.float() * flat_weights[start:start + count, None])
            start += count
        return out

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, no host sync (CUDA-graph safe; for small models)."""
        num_experts = self.gate_up_proj.shape[0]
        dense_w = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device)
        dense_w.scatter_(1, expert_ids, weights)
        chosen = torch.zeros(x.shape[0], num_experts, dtype=torch.bool, device=x.device)
        chosen.scatter_(1, expert_ids, True)
        h = swiglu_oai(torch.einsum("th,eih->tei", x, self.gate_up_proj), self.alpha, self.limit)
        y = torch.einsum("tei,ehi->teh", h, self.down_proj)
        # drop the unchosen experts by selection, not by weight 0: an overflow in one of them
        # (-inf * 0 = NaN) must not reach the token, as it cannot where only chosen experts run
        return torch.where(chosen[..., None], y.float() * dense_w[..., None], 0.0).sum(dim=1)


class M3SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, routed_scaling_factor: float, alpha: float,
                 limit: float) -> None:
        super().__init__()
        self.routed_scaling_factor = routed_scaling_factor
        self.graph_safe = False
        self.gate = SigmoidRouter(hidden_size, num_experts, top_k)
        self.experts = RoutedExperts(num_experts, hidden_size, intermediate_size, alpha, limit)
        self.shared_experts = (SwigluOaiMLP(hidden_size, shared_intermediate_size, alpha, limit)
                               if shared_intermediate_size > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        routed = self.experts(x, weights, expert_ids, graph_safe=self.graph_safe)
        out = (routed * self.routed_scaling_factor).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
