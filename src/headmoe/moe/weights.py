"""The storage format of the routed experts' weights: the one seam a new format plugs into.

A `MultiHeadMoE` holds its routed experts' weights (per (head, expert) row: a gate, an up
and a down projection) through an `ExpertWeights` format object. The format decides which
tensors the layer registers (their checkpoint names, shapes and dtypes), and computes the
experts from them; everything else (routing, padding, the exchanges, checkpoint row
slicing, streaming, the planner's byte counts) works on whatever the format registered.
`Bf16Experts` is the released format (the model dtype, bf16 or fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from headmoe.layers import triton_runtime
from headmoe.moe import triton_moe
from headmoe.moe.experts import experts_grouped

#: `(z, experts, weights, W_gate, W_up, W_down) -> y`: a torch experts function
#: (`experts_grouped`, `experts_reference`)
ExpertFunction = Callable[..., torch.Tensor]


class ExpertWeights:
    """One storage format of the routed experts of one MoE layer on one rank.

    A new format (e.g. float8_e4m3fn weights with an fp32 scale per (expert, output
    channel)) is one subclass that implements exactly:

    - `NAMES`: the names of its tensors, relative to the MoE module (they are the checkpoint
      names and the `state_dict` keys). Every one has the (head, expert) rows first, ordered
      head * experts + expert, so the loader slices a rank's rows of each (`fit_rows`,
      `read_moe_rows`) and zero rows stand for padded heads.
    - `shapes(rows, head_dim, inner, dtype)`: `{name: (shape, dtype)}` of those tensors for
      `rows` local rows, head dim d, expert width `inner` and model dtype `dtype` (the
      planner's bytes come from the tensors so registered, on the meta device).
    - `compute(module, z, experts, weights, rows, expert_fn, triton)`: the experts' output
      `[N, h, d]` in z's dtype for the first `rows` rows of its tensors (read from `module`
      with `getattr(module, name)` at call time: streaming rebinds them), given z
      `[N, h, d]` in the model dtype, the routed `experts` `[N, h, k]` int64 and `weights`
      `[N, h, k]` fp32 (`headmoe.moe.routing.route`). `expert_fn` is the layer's torch
      experts function (`MultiHeadMoE.expert_compute`); a format with its own arithmetic
      may ignore it. `triton`: what `uses_triton` answered for this call (asked once).

    Optional: `uses_triton(module, z, expert_fn)` (default False): True where `compute`
    takes Triton kernels that expect the Triton router (`triton_moe.route_triton`).

    `register(module, ...)` (shared) registers zero tensors of `shapes` on the module as
    frozen parameters, in `NAMES` order.
    """

    NAMES: ClassVar[tuple[str, ...]] = ()

    def shapes(self, rows: int, head_dim: int, inner: int, dtype: torch.dtype
               ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def compute(self, module: nn.Module, z: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor, rows: int, expert_fn: ExpertFunction, triton: bool
                ) -> torch.Tensor:
        raise NotImplementedError

    def uses_triton(self, module: nn.Module, z: torch.Tensor, expert_fn: ExpertFunction) -> bool:
        return False

    def tensor(self, module: nn.Module, name: str) -> torch.Tensor:
        """This format's tensor `name` as `module` holds it now (streaming rebinds it)."""
        t = getattr(module, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{type(module).__name__}.{name} must be a tensor, got {type(t).__name__}")
        return t

    def register(self, module: nn.Module, rows: int, head_dim: int, inner: int,
                 dtype: torch.dtype) -> None:
        """Register this format's zero tensors on `module` (frozen parameters)."""
        shapes = self.shapes(rows, head_dim, inner, dtype)
        for name in self.NAMES:
            shape, dt = shapes[name]
            module.register_parameter(
                name, nn.Parameter(torch.zeros(shape, dtype=dt), requires_grad=False))


class Bf16Experts(ExpertWeights):
    """The released format: `W_gate`, `W_up` `[rows, d, inner]` and `W_down`
    `[rows, inner, d]` in the model dtype. Computed by `expert_fn` (the batch-invariant
    grouped GEMM `experts_grouped` by default), or by the Triton kernels
    (`headmoe.moe.triton_moe`, docs/moe.md section 3) on CUDA with triton installed when
    `expert_fn` is the default."""

    NAMES: ClassVar[tuple[str, ...]] = ("W_gate", "W_up", "W_down")

    def shapes(self, rows: int, head_dim: int, inner: int, dtype: torch.dtype
               ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"W_gate": ((rows, head_dim, inner), dtype), "W_up": ((rows, head_dim, inner), dtype),
                "W_down": ((rows, inner, head_dim), dtype)}

    def uses_triton(self, module: nn.Module, z: torch.Tensor, expert_fn: ExpertFunction) -> bool:
        """Whether `compute` (and the layer's routing) take the Triton kernels for `z`."""
        return expert_fn is experts_grouped and triton_runtime.use_triton(z) and (
            triton_moe.supported(z.shape[2], self.tensor(module, "W_gate").shape[2]))

    def compute(self, module: nn.Module, z: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor, rows: int, expert_fn: ExpertFunction, triton: bool
                ) -> torch.Tensor:
        if triton:
            expert_fn = triton_moe.experts_triton
        return expert_fn(z, experts, weights,
                         *(self.tensor(module, n)[:rows] for n in self.NAMES))
