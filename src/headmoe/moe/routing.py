"""Per-head sigmoid routing with a selection-only bias (MAGI-2 semantics).

Every operation here is row-local and batch-invariant: a (token, head) row's routes and
weights have the same bits whatever other rows are routed with it.
"""

from __future__ import annotations

import torch

from headmoe.layers.activations import sigmoid_
from headmoe.layers.matmul import bi_bmm
from headmoe.moe.gemm import pad_features

#: eps of the L1 normalisation of the route weights
ROUTE_EPS = 1e-12


def route_groups(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The (head, expert) group id `head * num_experts + expert` of every route: experts
    `[N, h, k]` int64 ids in [0, num_experts) -> `[N*h*k]` int64, flat `[N, h, k]` order
    (the row of the group's weights in `[h*E, ...]` expert tensors)."""
    heads = torch.arange(experts.shape[1], device=experts.device).view(1, -1, 1)
    return (experts + heads * num_experts).reshape(-1)


def route(
    z: torch.Tensor,
    gate: torch.Tensor,
    expert_bias: torch.Tensor,
    top_k: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose `top_k` experts per (token, head) and their weights.

    z: `[N, h, d]` (any float dtype; routed in fp32); gate: `[h*E, d]` fp32, rows ordered
    (head, expert); expert_bias: `[h*E]` fp32, added to the scores for selection only.
    Returns `(experts, weights)`: experts `[N, h, top_k]` int64 in ascending expert id
    (the fixed combine order), weights `[N, h, top_k]` fp32 = the unbiased sigmoid scores
    of the chosen experts, L1-normalised over the k (eps 1e-12), times `route_scale`.
    Ties in the selection go to the lowest expert id.
    """
    n, h, d = z.shape
    e = gate.shape[0] // h
    a = pad_features(z.float()).transpose(0, 1)  # [h, N, d'], rows 64-byte aligned
    b = pad_features(gate.view(h, e, d), dims=2).transpose(1, 2)  # [h, d', E']
    scores = sigmoid_(bi_bmm(a, b)[..., :e].transpose(0, 1))  # [N, h, E]
    selection = scores + expert_bias.view(h, e)
    order = torch.sort(selection, dim=-1, descending=True, stable=True).indices
    experts = order[..., :top_k].sort(dim=-1).values
    weights = scores.gather(-1, experts)
    total = weights[..., 0].clone()
    for j in range(1, top_k):  # fixed summation order
        total += weights[..., j]
    weights = weights / total.clamp_min(ROUTE_EPS).unsqueeze(-1) * route_scale
    return experts, weights
