"""RMSNorm with a zero-initialised delta weight, computed in fp32 (MAGI-2 convention)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from headmoe.layers import triton_dense, triton_runtime


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * (1 + weight)` over the last dim.

    x: `[..., C]` any float dtype; weight: `[C]` or broadcastable to x (for example one row
    of weights per token, `[T, C]`), fp32. Returns fp32 `[..., C]`; each row depends only on
    itself (on CUDA through the one-row-per-program kernel `triton_dense.rms_norm_rows`,
    since torch's CUDA reductions pick their strategy from the tensor's shape).
    """
    if triton_runtime.use_triton(x):
        return triton_dense.rms_norm_rows(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`rms_norm` in torch ops on any device (the CPU path; on CUDA its rows are not
    batch-invariant, see `rms_norm`). Same shapes and dtypes as `rms_norm`."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


@dataclasses.dataclass(frozen=True)
class FoldedNorm:
    """An RMSNorm left to the linears that read it (the Triton path, issue 30): each applies
    it in its GEMM prologue (`triton_dense.linear_rows(norm=...)`), so the fp32 normed
    `[T, C]` copy is never written. x: `[T, C]` (its dtype); inv: fp32 `[T]`
    (`triton_dense.rms_inv_rows`); weights: fp32 `[m, C]`, one row per modality; groups: the
    rows of each modality (`RowPlan.groups`) when m > 1, else None."""

    x: torch.Tensor
    inv: torch.Tensor
    weights: torch.Tensor
    groups: list[torch.Tensor] | None

    def row_norm(self, m: int) -> triton_dense.RowNorm:
        """The prologue norm of modality m's rows."""
        return triton_dense.RowNorm(self.inv, self.weights[m])

    def parts(self) -> list[tuple[torch.Tensor | None, triton_dense.RowNorm]]:
        """(rows or None for all rows, norm) of each modality with rows."""
        if self.groups is None:
            return [(None, self.row_norm(0))]
        return [(rows, self.row_norm(m)) for m, rows in enumerate(self.groups) if rows.numel()]


class RMSNorm(nn.Module):
    """`rms_norm` with its own fp32 `weight` `[dim]` (zeros: the identity scale)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., dim]` -> fp32 `[..., dim]`."""
        return rms_norm(x, self.weight, self.eps)


class ModalityRMSNorm(nn.Module):
    """One RMSNorm per modality; `weight` `[num_modalities * dim]` fp32, modality-major.
    With one modality it is a plain RMSNorm (weight `[dim]`)."""

    def __init__(self, num_modalities: int, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_modalities, self.dim, self.eps = num_modalities, dim, eps
        self.weight = nn.Parameter(torch.zeros(num_modalities * dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, modality: torch.Tensor) -> torch.Tensor:
        """x `[T, ..., dim]`, modality `[T]` int64 ids -> fp32 `[T, ..., dim]` (row t uses
        the weight of `modality[t]`; with one modality every row uses the same weight)."""
        if self.num_modalities == 1:
            return rms_norm(x, self.weight, self.eps)
        w = self.weight.view(self.num_modalities, self.dim)[modality]
        w = w.view(w.shape[0], *([1] * (x.dim() - 2)), self.dim)
        return rms_norm(x, w, self.eps)

    def folded(self, x: torch.Tensor, modality: torch.Tensor,
               groups: list[torch.Tensor]) -> torch.Tensor | FoldedNorm:  # fmt: skip
        """`forward(x, modality)` for the linears that consume it: on the Triton path (x
        `[T, dim]` on CUDA) a `FoldedNorm` they apply in their prologue (same bits as the
        fp32 normed rows cast to their dtype), elsewhere the fp32 tensor. groups: the rows
        of each modality (`RowPlan.groups`, matching `modality`)."""
        if not triton_runtime.use_triton(x) or x.dim() != 2:
            return self.forward(x, modality)
        x = x if x.stride(1) == 1 else x.contiguous()
        weights = self.weight.view(self.num_modalities, self.dim)
        return FoldedNorm(x, triton_dense.rms_inv_rows(x, self.eps), weights,
                          groups if self.num_modalities > 1 else None)
