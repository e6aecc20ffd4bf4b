"""Weight holders whose products go through the batch-invariant `bi_linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headmoe.layers.matmul import ALIGN, bi_linear


class Linear(nn.Module):
    """`y = x W^T (+ b)` with `weight` `[out, in]` in `dtype` (zeros until loaded) and an
    optional fp32 `bias` `[out]`. The input is cast to `dtype`; the result is fp32."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=torch.float32)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., in]` -> fp32 `[..., out]`; each row independent of the others.

        An `in` that is not a multiple of `ALIGN` values is zero-padded on both operands
        (same result; keeps every row of x 64-byte aligned, see `headmoe.layers.matmul`)."""
        w: torch.Tensor = self.weight
        x = x.to(w.dtype)
        if w.shape[1] % ALIGN:
            pad = ALIGN - w.shape[1] % ALIGN
            x, w = F.pad(x, (0, pad)), F.pad(w, (0, pad))
        y = bi_linear(x, w).float()
        return y if self.bias is None else y + self.bias


class ModalityLinear(nn.Module):
    """One linear per modality: `weight` `[num_modalities * out, in]` in `dtype`, modality-major
    (MAGI-2's storage of modality-specific linears)."""

    def __init__(
        self, num_modalities: int, in_features: int, out_features: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.num_modalities, self.out_features = num_modalities, out_features
        self.weight = nn.Parameter(
            torch.zeros(num_modalities * out_features, in_features, dtype=dtype)
        )

    def forward(self, x: torch.Tensor, groups: list[torch.Tensor]) -> torch.Tensor:
        """x `[T, in]`; `groups[m]` the int64 row indices of modality m (together a partition
        of the rows) -> fp32 `[T, out]`. With one modality, `groups` is ignored."""
        if self.num_modalities == 1:
            return bi_linear(x.to(self.weight.dtype), self.weight).float()
        w = self.weight.view(self.num_modalities, self.out_features, -1)
        out = x.new_zeros((x.shape[0], self.out_features), dtype=torch.float32)
        for m, rows in enumerate(groups):
            if rows.numel():
                out[rows] = bi_linear(x[rows].to(w.dtype), w[m]).float()
        return out
