"""`MoEConfig`: the static description of one multi-head MoE layer (pure data, validated)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headmoe.config import DTYPES, check_positive_int, is_number

MOE_DTYPES: tuple[torch.dtype, ...] = tuple(DTYPES.values())


@dataclass(frozen=True)
class MoEConfig:
    """One multi-head MoE layer (MAGI-2 semantics, see docs/moe.md).

    The input `[T, hidden_size]` is viewed as `[T, num_heads, head_dim]`; every head routes
    each token among its own `num_experts` experts (top `top_k`).
    """

    hidden_size: int
    num_heads: int
    num_experts: int
    """Experts per head."""
    top_k: int
    expert_intermediate_size: int
    route_scale: float = 1.0
    """Factor applied to the L1-normalised route weights (MAGI-2: 4.9)."""
    dtype: torch.dtype = torch.float32
    """dtype of the input, the output and the expert weights (gate and biases stay fp32)."""
    bias_from_ema: bool = True
    """After a checkpoint load, replace `router.expert_bias` by `router.expert_bias_ema`."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_heads",
            "num_experts",
            "top_k",
            "expert_intermediate_size",
        ):
            check_positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size!r} must be divisible by "
                f"num_heads={self.num_heads!r}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k!r} must not exceed num_experts={self.num_experts!r}"
            )
        if not is_number(self.route_scale) or not self.route_scale > 0:
            raise ValueError(f"route_scale must be a positive number, got {self.route_scale!r}")
        if self.dtype not in MOE_DTYPES:
            raise ValueError(f"dtype must be one of {MOE_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.bias_from_ema, bool):
            raise ValueError(f"bias_from_ema must be a bool, got {self.bias_from_ema!r}")

    @property
    def head_dim(self) -> int:
        """MoE head width d_head = hidden_size // num_heads."""
        return self.hidden_size // self.num_heads
