"""Elementwise activations whose bits do not depend on a value's position in its tensor.

Measured with torch 2.13 on our CPUs: fp32 `torch.sigmoid` (and `F.silu`) take a vectorised
path for most elements and a scalar path for the tail of a tensor, and the two differ in the
last bit, so a token's gate would change with the shard size. `torch.exp`, division and the
IEEE arithmetic ops gave identical bits on both paths, so `sigmoid` is built from them.
tests/layers/test_activations.py checks the property on the machine that runs the tests.
"""

from __future__ import annotations

import torch


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-x))`, any shape and float dtype; position-independent bits."""
    return 1.0 / (1.0 + torch.exp(-x))


def swiglu7(h: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """MAGI-2's clamped SwiGLU on a fused `[..., 2 * I]` projection (gate half first).

    g = min(gate, limit); u = clamp(up, -limit, limit); returns g * sigmoid(alpha * g) * (u + 1)
    as `[..., I]` fp32 (the activation is computed in fp32 whatever the input dtype).
    """
    gate, up = h.float().chunk(2, dim=-1)
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return g * sigmoid(alpha * g) * (u + 1.0)
