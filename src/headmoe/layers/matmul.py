"""Batch-invariant matrix products.

A token's result must not depend on how many other rows share its matmul (that number
changes with the layout: SP shard sizes, modality groups of a shard, tokens per expert).
Measured with torch 2.13 (MKL) on our CPU machines: an fp32 `A[:M] @ W` differs in bits
from the first M rows of a larger product for M in {1, 2, 3} with one thread and
{1, 2, 3, 5, 6, 7, 9, 10, 11} with two, and matches for every M >= 12 tried (up to 3000,
at any row offset); bf16 matched everywhere. Small row counts therefore get padded with
zero rows to `MIN_ROWS`, which takes the same kernel path as large batches. MKL also gave
a row different fp32 bits depending on its 64-byte alignment when rows are not a multiple
of 64 bytes long (measured with K = 10, see `headmoe.moe.gemm`): every K that headmoe's
models feed here is a multiple of 16 fp32 values, so row slices stay aligned. Every
layout-dependent matmul in headmoe goes through these helpers; tests/layers/test_matmul.py
checks the property on the machine that runs the tests.

The thread count must not matter either (`headmoe.numerics`): fp32 GEMMs run inside
`headmoe.numerics.reproducible_blas` (oneMKL's strict reproducible mode, which `import
headmoe` sets). Where strict mode does not hold (another vendor's CPU, a non-AVX2 MKL
branch) MKL runs on one thread and `cpu_product` cuts every product into row blocks of
`BLOCK_ROWS`: measured under ``MKL_CBWR=COMPATIBLE,STRICT`` on an Intel Xeon, the
padding rule above did not hold (row 17 of a ``[17, 384] @ [384, 96]`` product differed
from the same row of a 700-row product) while fixed 64-row blocks kept every row's bits
(tests/test_numerics.py). torch sends CPU bf16 and fp16 GEMMs to oneDNN instead, which
splits some shapes by thread count (measured with torch 2.13 on an Intel Xeon with AMX:
bf16 ``[298, 1536] @ [1536, 64]`` and ``[2000, 3072] @ [3072, 3072]`` differ between 1, 2 and 3 threads), so on the CPU these run as fp32 MKL GEMMs and are
rounded back: a product of two bf16 (or fp16) values is exact in fp32 and the accumulation
is fp32 in both, so only the summation order changes, as between any two GEMM kernels.

On CUDA (with triton installed, `headmoe.layers.triton_runtime.use_triton`) none of this
padding is relied on: cuBLAS picks kernels and split-K from the sizes, so the helpers call
`headmoe.layers.triton_dense.matmul` instead, a GEMM with fixed tiles and no split-K whose
rows are invariant by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from headmoe.layers import triton_dense, triton_runtime
from headmoe.numerics import blas_mode, reproducible_blas

#: reduction dims of `Linear` and of the MoE's CPU GEMMs are padded to a multiple of this
#: many values (16 fp32 = 64 bytes: every row of an operand starts 64-byte aligned)
ALIGN = 16
#: row counts below this are padded with zero rows (a multiple of every small-M kernel block)
MIN_ROWS = 16


#: CPU GEMM dtypes that torch runs on oneDNN (thread-count dependent); computed in fp32 here
_ONEDNN_FLOATS = (torch.bfloat16, torch.float16)
#: where oneMKL's strict mode does not hold (`headmoe.numerics.BlasMode.one_thread`), CPU
#: products run in row blocks of exactly this many rows (the last one zero-padded): every
#: call then has one shape and takes one kernel path, whatever the row count
BLOCK_ROWS = 64


def _row_blocks(op: Callable[..., torch.Tensor], first: torch.Tensor,
                *operands: torch.Tensor | None) -> torch.Tensor:
    """``op(first, *operands)`` as products of `BLOCK_ROWS`-row blocks of ``first``'s rows
    (its dim -2: `[M, K]` or `[G, M, K]`)."""
    m = first.shape[-2]
    if m % BLOCK_ROWS:
        padded = first.new_zeros((*first.shape[:-2], -(-m // BLOCK_ROWS) * BLOCK_ROWS,
                                  first.shape[-1]))
        padded[..., :m, :] = first
        first = padded
    blocks = [op(first[..., s : s + BLOCK_ROWS, :], *operands)
              for s in range(0, first.shape[-2], BLOCK_ROWS)]
    return torch.cat(blocks, dim=-2)[..., :m, :]


def _whole(op: Callable[..., torch.Tensor], first: torch.Tensor,
           *operands: torch.Tensor | None) -> torch.Tensor:
    return op(first, *operands)


def cpu_product(op: Callable[..., torch.Tensor], first: torch.Tensor,
                *operands: torch.Tensor | None) -> torch.Tensor:
    """``op(first, *operands)`` on the CPU with a thread-count-independent kernel, for ops
    that are row-local in ``first`` (dim -2; `F.linear`, `torch.matmul`, `torch.bmm`):
    reduced floats (`_ONEDNN_FLOATS`) computed in fp32 by oneMKL and returned in ``first``'s
    dtype; inside `reproducible_blas`, and in `BLOCK_ROWS` row blocks where its one-thread
    mode applies (a row's bits then do not depend on the row count on any MKL branch)."""
    dtype = first.dtype
    run = _row_blocks if blas_mode().one_thread else _whole
    with reproducible_blas():
        if dtype not in _ONEDNN_FLOATS:
            return run(op, first, *operands)
        wide = [None if t is None else t.float() for t in operands]
        return run(op, first.float(), *wide).to(dtype)


def _pad_rows(x2d: torch.Tensor) -> torch.Tensor:
    m = x2d.shape[0]
    if m >= MIN_ROWS:
        return x2d
    padded = x2d.new_zeros((MIN_ROWS, x2d.shape[1]))
    padded[:m] = x2d
    return padded


def bi_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` whose rows do not depend on the batch.

    x: `[..., K]`; weight: `[N, K]`; bias: `[N]` or None; returns `[..., N]` in the
    promoted dtype of `F.linear`. Row i of the result has the same bits whatever the other
    rows are and however many there are.
    """
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    m = x2d.shape[0]
    if m == 0:
        return x.new_empty((*lead, weight.shape[0]))
    if triton_runtime.use_triton(x2d):
        return triton_dense.matmul(x2d, weight.t(), bias).reshape(*lead, weight.shape[0])
    out = cpu_product(F.linear, _pad_rows(x2d), weight, bias)
    return out[:m].reshape(*lead, weight.shape[0])


def bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for a: `[M, K]`, b: `[K, N]` -> `[M, N]`, batch-invariant over the rows of a."""
    m = a.shape[0]
    if m == 0:
        return a.new_empty((0, b.shape[1]))
    if triton_runtime.use_triton(a):
        return triton_dense.matmul(a, b)
    return cpu_product(torch.matmul, _pad_rows(a), b)[:m]


def bi_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm` for a: `[G, M, K]`, b: `[G, K, N]` -> `[G, M, N]`, batch-invariant over
    the rows of each group (M padded to at least `MIN_ROWS`)."""
    g, m, k = a.shape
    if m == 0:
        return a.new_empty((g, 0, b.shape[2]))
    if triton_runtime.use_triton(a):
        return triton_dense.matmul(a, b)
    if m < MIN_ROWS:
        padded = a.new_zeros((g, MIN_ROWS, k))
        padded[:, :m] = a
        a = padded
    return cpu_product(torch.bmm, a, b)[:, :m]
