"""Weight holders whose products go through the batch-invariant `bi_linear`."""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Fusion:
    """What a linear does around its product (issue 30; one kernel on the Triton path, the
    same ops in torch elsewhere, same bits): gate `[T, G]` fp32 scales input column k of
    row t by `gate[t, k // (in / G)]` in fp32 before the cast (the attention gate); swiglu:
    `swiglu7` of the fp32 result (`out / 2` columns); add `[T, out']` fp32 is added to the
    result (`add + y`); the result is returned in out_dtype."""

    swiglu: bool = False
    out_dtype: torch.dtype = torch.float32
    gate: torch.Tensor | None = None
    add: torch.Tensor | None = None

    def width(self, n: int) -> int:
        """Columns out of a product with n columns."""
        return n // 2 if self.swiglu else n

    def prologue(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path's input: x `[T, in]`, gated in fp32 when a gate is set."""
        if self.gate is None:
            return x
        t, g = self.gate.shape
        # explicit widths: a rank may hold no rows (t = 0), where -1 is ambiguous
        return (x.float().view(t, g, x.shape[-1] // g) * self.gate[:, :, None]).reshape(t, x.shape[-1])

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The torch path's epilogue on the fp32 product y."""
        y = swiglu7(y) if self.swiglu else y
        return (y if self.add is None else self.add + y).to(self.out_dtype)

    def launch(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
               rows: torch.Tensor | None, norm: triton_dense.RowNorm | None,
               bias: torch.Tensor | None) -> None:  # fmt: skip
        """`triton_dense.linear_rows` of a's rows (all, or `rows`) into out."""
        gate = None if self.gate is None else triton_dense.ColumnGate(
            self.gate, a.shape[1] // self.gate.shape[1])
        triton_dense.linear_rows(a, b, out=out, rows=rows, norm=norm, gate=gate, bias=bias,
                                 swiglu=self.swiglu, add=self.add)  # fmt: skip


def _empty_out(a: torch.Tensor, n: int, fusion: Fusion) -> torch.Tensor:
    return torch.empty((a.shape[0], fusion.width(n)), dtype=fusion.out_dtype, device=a.device)


def _fused_rows(x: LinearInput, b: torch.Tensor, bias: torch.Tensor | None,
                fusion: Fusion) -> torch.Tensor:  # fmt: skip
    """One weight b `[in, out]` over all rows of x on the Triton path (a `FoldedNorm` of
    several modalities: one launch per modality's rows, each with its norm weights)."""
    a = x if isinstance(x, torch.Tensor) else x.x
    out = _empty_out(a, b.shape[1], fusion)
    parts = [(None, None)] if isinstance(x, torch.Tensor) else x.parts()
    for rows, norm in parts:
        fusion.launch(a, b, out, rows, norm, bias)
    return out


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

    def forward(self, x: LinearInput, fusion: Fusion | None = None) -> torch.Tensor:
        """x `[..., in]` (or a `FoldedNorm` of `[T, in]`) -> fp32 `[..., out]`, or what
        `fusion` asks (`Fusion`: gate, SwiGLU7, add, output dtype); each row independent of
        the others. On the Triton path (2-d rows on CUDA) one kernel, the input cast, the
        norm and the fusion folded into it (same bits but SwiGLU7's `exp`).

        An `in` that is not a multiple of `ALIGN` values is zero-padded on both operands
        (same result; keeps every row of x 64-byte aligned, see `headmoe.layers.matmul`)."""
        fusion = fusion or Fusion()
        w: torch.Tensor = self.weight
        if _on_triton(x):
            return _fused_rows(x, w.t(), self.bias, fusion)
        assert isinstance(x, torch.Tensor)
        x = fusion.prologue(x).to(w.dtype)
        if w.shape[1] % ALIGN:
            pad = ALIGN - w.shape[1] % ALIGN
            x, w = F.pad(x, (0, pad)), F.pad(w, (0, pad))
        y = bi_linear(x, w).float()
        return fusion.finish(y if self.bias is None else y + self.bias)


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

    def forward(self, x: LinearInput, groups: list[torch.Tensor],
                fusion: Fusion | None = None) -> torch.Tensor:  # fmt: skip
        """x `[T, in]` (or a `FoldedNorm` of it); `groups[m]` the int64 row indices of
        modality m (together a partition of the rows) -> fp32 `[T, out]`, or what `fusion`
        asks. With one modality, `groups` is ignored. The Triton path (one kernel per
        modality, gather / casts / scatter folded in): as `Linear.forward`."""
        fusion = fusion or Fusion()
        w = self.weight.view(self.num_modalities, self.out_features, -1)
        if _on_triton(x):
            return self._fused(x, groups, fusion)
        assert isinstance(x, torch.Tensor)
        x = fusion.prologue(x)
        if self.num_modalities == 1:
            return fusion.finish(bi_linear(x.to(w.dtype), self.weight).float())
        out = x.new_zeros((x.shape[0], self.out_features), dtype=torch.float32)
        for m, rows in enumerate(groups):
            if rows.numel():
                out[rows] = bi_linear(x[rows].to(w.dtype), w[m]).float()
        return fusion.finish(out)

    def _fused(self, x: LinearInput, groups: list[torch.Tensor], fusion: Fusion) -> torch.Tensor:
        if self.num_modalities == 1:
            return _fused_rows(x, self.weight.t(), None, fusion)
        w = self.weight.view(self.num_modalities, self.out_features, -1)
        a = x.x if isinstance(x, FoldedNorm) else x
        out = _empty_out(a, w.shape[1], fusion)
        for m, rows in enumerate(groups):
            if rows.numel():
                norm = None if isinstance(x, torch.Tensor) else x.row_norm(
                    m if x.groups is not None else 0)
                fusion.launch(a, w[m].t(), out, rows, norm, None)
        return out
