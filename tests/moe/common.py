"""Shared helpers of the MoE tests: random full checkpoints and an independent oracle."""

from __future__ import annotations

import math

import torch

from headmoe.moe import MoEConfig


def full_state(cfg: MoEConfig, seed: int = 0, bias_scale: float = 0.1) -> dict[str, torch.Tensor]:
    """A random full (unsharded) MoE checkpoint: fp32 tensors under the MAGI-2 names."""
    g = torch.Generator().manual_seed(seed)
    rows, d, f = cfg.num_heads * cfg.num_experts, cfg.head_dim, cfg.expert_intermediate_size
    return {
        "gate": torch.randn(rows, d, generator=g) / math.sqrt(d),
        "W_gate": torch.randn(rows, d, f, generator=g) / math.sqrt(d),
        "W_up": torch.randn(rows, d, f, generator=g) / math.sqrt(d),
        "W_down": torch.randn(rows, f, d, generator=g) / math.sqrt(f),
        "router.expert_bias": torch.randn(rows, generator=g) * bias_scale,
        "router.expert_bias_ema": torch.randn(rows, generator=g) * bias_scale,
    }


def oracle(cfg: MoEConfig, state: dict[str, torch.Tensor], x: torch.Tensor, bias_key: str):
    """Token-by-token, head-by-head float64 evaluation of the MAGI-2 MoE maths.

    x: `[T, hidden]`; returns (out `[T, hidden]` float64, experts `[T, H, k]` chosen ids in
    ascending order). Written from MAGI2.md without any headmoe code."""
    e_count, k, d = cfg.num_experts, cfg.top_k, cfg.head_dim
    st = {n: t.double() for n, t in state.items()}
    z = x.double().view(x.shape[0], cfg.num_heads, d)
    out = torch.zeros_like(z)
    chosen = torch.zeros(x.shape[0], cfg.num_heads, k, dtype=torch.int64)
    for t in range(z.shape[0]):
        for h in range(cfg.num_heads):
            rows = range(h * e_count, (h + 1) * e_count)
            scores = [1 / (1 + math.exp(-float(z[t, h] @ st["gate"][r]))) for r in rows]
            sel = [scores[e] + float(st[bias_key][h * e_count + e]) for e in range(e_count)]
            top = sorted(sorted(range(e_count), key=lambda e: (-sel[e], e))[:k])
            total = sum(scores[e] for e in top)
            for j, e in enumerate(top):
                r = h * e_count + e
                gg = torch.clamp(z[t, h] @ st["W_gate"][r], max=7.0)
                uu = torch.clamp(z[t, h] @ st["W_up"][r], -7.0, 7.0)
                y = (gg * torch.sigmoid(1.702 * gg) * (uu + 1)) @ st["W_down"][r]
                out[t, h] += scores[e] / max(total, 1e-12) * cfg.route_scale * y
                chosen[t, h, j] = e
    return out.view(x.shape[0], -1), chosen
