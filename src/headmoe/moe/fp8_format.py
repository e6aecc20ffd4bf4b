"""The `fp8-e4m3` expert weight format: `headmoe.moe.weights.ExpertWeights` with the routed
experts' weights in FP8 E4M3 and one fp32 scale per (head, expert) and output channel
(the rule: `headmoe.moe.fp8`; docs/fp8.md).

Tensors (every one with the (head, expert) rows first, as the seam requires): `W_gate`,
`W_up` `[rows, d, inner]` and `W_down` `[rows, inner, d]` float8_e4m3fn, and their scales
`W_gate_scale`, `W_up_scale` `[rows, inner]` and `W_down_scale` `[rows, d]` fp32. The
`_scale` names are those of headmoe's FP8 release folders (`headmoe quantize`).
Computed by `headmoe.moe.fp8_experts.experts_fp8` (torch), or by the W8A16 kernels
(`headmoe.moe.triton_fp8`) where triton runs on z's device.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from headmoe.layers import triton_runtime
from headmoe.moe import triton_moe
from headmoe.moe.fp8 import FP8_DTYPE, Fp8Weight
from headmoe.moe.fp8_experts import experts_fp8
from headmoe.moe.triton_fp8 import experts_triton_fp8
from headmoe.moe.weights import ExpertFunction, ExpertWeights

#: the weights stored in FP8, and the suffix of their scale tensors
VALUES: tuple[str, ...] = ("W_gate", "W_up", "W_down")
SCALE_SUFFIX = "_scale"


class Fp8Experts(ExpertWeights):
    """The routed experts in FP8 E4M3 with per-(row, output channel) fp32 scales."""

    NAMES: ClassVar[tuple[str, ...]] = VALUES + tuple(n + SCALE_SUFFIX for n in VALUES)

    def shapes(self, rows: int, head_dim: int, inner: int, dtype: torch.dtype
               ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:  # fmt: skip
        """`{name: (shape, dtype)}`; `dtype` (the model's) is the activations', unused."""
        values = {"W_gate": (rows, head_dim, inner), "W_up": (rows, head_dim, inner),
                  "W_down": (rows, inner, head_dim)}  # fmt: skip
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            n: (s, FP8_DTYPE) for n, s in values.items()}
        out.update({n + SCALE_SUFFIX: ((s[0], s[2]), torch.float32) for n, s in values.items()})
        return out

    def weights(self, module: nn.Module, rows: int) -> list[Fp8Weight]:
        """The first `rows` rows of W_gate, W_up, W_down as `Fp8Weight`s (views)."""
        return [Fp8Weight(self.tensor(module, n)[:rows],
                          self.tensor(module, n + SCALE_SUFFIX)[:rows]) for n in VALUES]  # fmt: skip

    def uses_triton(self, module: nn.Module, z: torch.Tensor, expert_fn: ExpertFunction) -> bool:
        """Triton where `use_triton(z)` and the kernels take d and inner (`supported`)."""
        inner = self.tensor(module, "W_gate").shape[2]
        return triton_runtime.use_triton(z) and triton_moe.supported(z.shape[2], inner)

    def compute(self, module: nn.Module, z: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor, rows: int, expert_fn: ExpertFunction, triton: bool
                ) -> torch.Tensor:  # fmt: skip
        """`experts_triton_fp8` if `triton`, else `experts_fp8` (`expert_fn` is not used:
        this format has its own arithmetic)."""
        fn = experts_triton_fp8 if triton else experts_fp8
        return fn(z, experts, weights, *self.weights(module, rows))
