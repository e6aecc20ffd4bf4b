"""Elementwise activations whose bits do not depend on a value's position in its tensor.

Measured with torch 2.13 on our CPUs: fp32 `torch.sigmoid` (and `F.silu`) take a vectorised
path for most elements and a scalar path for the tail of a tensor, and the two differ in the
last bit (in ~3% of elements), so a token's gate would change with the shard size.
Negation, `torch.exp`, addition and the reciprocal gave identical bits on both paths, so
`sigmoid` is built from them. tests/layers/test_activations.py checks the property on the
machine that runs the tests. The in-place forms keep large activations (MoE experts) out of
fresh memory and give the same bits as the out-of-place ones.
"""

from __future__ import annotations

import torch

#: MAGI-2's SwiGLU7 clamp limit and sigmoid gain (MAGI2.md section 2)
SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702


def sigmoid_(x: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-x))` in place in x (any shape, float dtype); returns x."""
    return x.neg_().exp_().add_(1).reciprocal_()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-x))`, any shape and float dtype; position-independent bits."""
    return sigmoid_(x.clone())


def swiglu7_(
    g: torch.Tensor, u: torch.Tensor, limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA
) -> torch.Tensor:
    """`min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1)`,
    computed in place in g (u is clobbered too); returns g.

    g, u: the fp32 gate and up projections, same shape `[..., I]`."""
    g.clamp_(max=limit)
    s = sigmoid_(g * alpha)
    return g.mul_(s).mul_(u.clamp_(-limit, limit).add_(1))


def swiglu7(
    h: torch.Tensor, limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA
) -> torch.Tensor:
    """MAGI-2's clamped SwiGLU on a fused `[..., 2 * I]` projection: the gate is the **even**
    columns, "up" the **odd** ones (MAGI2.md section 3; the released fused projections
    interleave them).

    Returns `[..., I]` fp32 (the activation is computed in fp32 whatever the input dtype);
    h itself is not modified."""
    h = h.to(torch.float32)
    gate, up = h[..., 0::2].contiguous(), h[..., 1::2].contiguous()
    return swiglu7_(gate, up, limit, alpha)
