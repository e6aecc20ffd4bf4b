"""Weight holders whose products go through the batch-invariant `bi_linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headmoe.layers import triton_dense, triton_runtime
from headmoe.layers.activations import swiglu7
from headmoe.layers.matmul import ALIGN, bi_linear
from headmoe.layers.norms import FoldedNorm

#: what a linear reads: rows, or rows with an RMSNorm its GEMM applies (`FoldedNorm`)
LinearInput = torch.Tensor | FoldedNorm


def _on_triton(x: LinearInput) -> bool:
    """Whether the Triton linear (`triton_dense.linear_rows`) runs: a FoldedNorm (built on
    that path only), or 2-d rows of a float weight on CUDA."""
    return isinstance(x, FoldedNorm) or (x.dim() == 2 and triton_runtime.use_triton(x))


def _empty_out(a: torch.Tensor, n: int, swiglu: bool, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((a.shape[0], n // 2 if swiglu else n), dtype=out_dtype, device=a.device)


def _fused_rows(x: LinearInput, b: torch.Tensor, bias: torch.Tensor | None, swiglu: bool,
                out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """One weight b `[in, out]` over all rows of x on the Triton path (a `FoldedNorm` of
    several modalities: one launch per modality's rows, each with its norm weights)."""
    if isinstance(x, torch.Tensor):
        return triton_dense.linear_rows(x, b, bias=bias, swiglu=swiglu, out_dtype=out_dtype)
    out = _empty_out(x.x, b.shape[1], swiglu, out_dtype)
    for rows, norm in x.parts():
        triton_dense.linear_rows(x.x, b, out=out, rows=rows, norm=norm, bias=bias,
                                 swiglu=swiglu)  # fmt: skip
    return out


def _finish(y: torch.Tensor, swiglu: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """The torch path's epilogue: SwiGLU7 of the fp32 rows when asked, then `out_dtype`."""
    return (swiglu7(y) if swiglu else y).to(out_dtype)


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

    def forward(self, x: LinearInput, *, swiglu: bool = False,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
        """x `[..., in]` (or a `FoldedNorm` of `[T, in]`) -> `[..., out]` in `out_dtype`
        (fp32 by default); each row independent of the others. swiglu: `swiglu7` of the
        fp32 result (`[..., out / 2]`), fused into the GEMM's epilogue on the Triton path,
        where the input cast and the output dtype are folded in too (same bits).

        An `in` that is not a multiple of `ALIGN` values is zero-padded on both operands
        (same result; keeps every row of x 64-byte aligned, see `headmoe.layers.matmul`)."""
        w: torch.Tensor = self.weight
        if _on_triton(x):
            return _fused_rows(x, w.t(), self.bias, swiglu, out_dtype)
        assert isinstance(x, torch.Tensor)
        x = x.to(w.dtype)
        if w.shape[1] % ALIGN:
            pad = ALIGN - w.shape[1] % ALIGN
            x, w = F.pad(x, (0, pad)), F.pad(w, (0, pad))
        y = bi_linear(x, w).float()
        return _finish(y if self.bias is None else y + self.bias, swiglu, out_dtype)


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

    def forward(self, x: LinearInput, groups: list[torch.Tensor], *, swiglu: bool = False,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
        """x `[T, in]` (or a `FoldedNorm` of it); `groups[m]` the int64 row indices of
        modality m (together a partition of the rows) -> `[T, out]` in `out_dtype` (fp32 by
        default). With one modality, `groups` is ignored. swiglu, and the Triton path (one
        kernel per modality, gather / casts / scatter folded in): as `Linear.forward`."""
        w = self.weight.view(self.num_modalities, self.out_features, -1)
        if _on_triton(x):
            return self._fused(x, groups, swiglu, out_dtype)
        assert isinstance(x, torch.Tensor)
        if self.num_modalities == 1:
            return _finish(bi_linear(x.to(w.dtype), self.weight).float(), swiglu, out_dtype)
        out = x.new_zeros((x.shape[0], self.out_features), dtype=torch.float32)
        for m, rows in enumerate(groups):
            if rows.numel():
                out[rows] = bi_linear(x[rows].to(w.dtype), w[m]).float()
        return _finish(out, swiglu, out_dtype)

    def _fused(self, x: LinearInput, groups: list[torch.Tensor], swiglu: bool,
               out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        if self.num_modalities == 1:
            return _fused_rows(x, self.weight.t(), None, swiglu, out_dtype)
        w = self.weight.view(self.num_modalities, self.out_features, -1)
        a = x.x if isinstance(x, FoldedNorm) else x
        out = _empty_out(a, w.shape[1], swiglu, out_dtype)
        for m, rows in enumerate(groups):
            if rows.numel():
                norm = None if isinstance(x, torch.Tensor) else x.row_norm(
                    m if x.groups is not None else 0)
                triton_dense.linear_rows(a, w[m].t(), out=out, rows=rows, norm=norm,
                                         swiglu=swiglu)  # fmt: skip
        return out
