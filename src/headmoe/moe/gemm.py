"""Batch-invariant building blocks of the MoE compute (CPU measurements in docs/moe.md).

- Sigmoids use `headmoe.layers.activations.sigmoid_`: `torch.sigmoid` gives different bits
  in its vectorised body and its scalar tail, so an element's bits would depend on its
  position in the batch.
- `aligned`: MKL's fp32 GEMM gives a row different bits depending on the 64-byte alignment
  of its address when rows are not a multiple of 64 bytes long (measured: K=10), and a row's
  address moves with the batch. Feature dims are zero-padded to multiples of `ALIGN` fp32
  elements, so every row of every GEMM operand and result starts 64-byte aligned. Zero
  features add exact zeros and are sliced off.
- Row counts below `MIN_ROWS` are padded (see `headmoe.layers.matmul`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from headmoe.layers.matmul import ALIGN, cpu_product
from headmoe.numerics import blas_mode


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def pad_features(t: torch.Tensor, dims: int = 1) -> torch.Tensor:
    """`t` with its last `dims` dims zero-padded to `aligned` sizes (itself if already)."""
    pad: list[int] = []
    for size in reversed(t.shape[t.dim() - dims :]):
        pad += [0, aligned(size) - size]
    return F.pad(t, pad) if any(pad) else t


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per-group products in one call: rows `[ends[g-1], ends[g])` of a (fp32 `[P, K]`) times
    b[g] (fp32 `[G, K, N]`) -> fp32 `[P, N]`; ends: `[G]` int32 cumulative row ends (empty
    groups allowed). On the CPU `torch._grouped_mm` runs one GEMM per group in C++; without
    it (torch before 2.9), and on other devices (CUDA's `_grouped_mm` takes bf16 operands
    only, and these are fp32), the same GEMMs run from a Python loop (`grouped_mm_loop`).
    Where oneMKL's strict mode does not hold (`headmoe.numerics`), each group runs through
    `headmoe.layers.matmul.cpu_product` (one MKL thread, fixed row blocks)."""
    if a.device.type == "cpu" and blas_mode().one_thread:
        return grouped_mm_loop(a, b, ends, partial(cpu_product, torch.matmul))
    if hasattr(torch, "_grouped_mm") and a.device.type == "cpu":
        return torch._grouped_mm(a, b, offs=ends)
    return grouped_mm_loop(a, b, ends)


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                    product: Callable[..., torch.Tensor] = torch.matmul) -> torch.Tensor:
    """`grouped_mm` as a Python loop of ``product(rows, b[g])`` over the non-empty groups
    (with `torch.matmul`: the same shapes and bits as `torch._grouped_mm`)."""
    out = a.new_empty((a.shape[0], b.shape[2]))
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = product(a[start:end], b[g])
        start = end
    return out
