"""Batch-invariant dense ops on the GPU: a Triton GEMM with fixed tiles and no split-K, and a
one-row-per-program RMSNorm (issue 21).

Why: on CUDA, cuBLAS picks its kernel (tile shape, split-K, stream-K) from the matrix sizes,
so a row of `F.linear` can get other bits when the number of rows in the call changes, and
torch's CUDA reductions pick their block shape and vectorisation from the tensor's shape
too. The layout contract (every parallel layout gives the same bytes) needs a token's bits
to be independent of how many rows share its call (SP shard sizes, modality groups, tokens
per expert) and of where its row sits; a 1-ulp change in an MoE input can flip a top-6
choice.

How: `matmul` computes every output element from its own row of a and column of b with
one fixed order: tiles are fixed per dtype (`DENSE_TILES`; never chosen from M), each
program walks the whole K in steps of `block_k` from 0 (no split-K, no atomics), masked
rows and columns load zeros. `rms_norm_rows` sums each row's squares in `NORM_BLOCK` lanes
in column order and reduces the lanes with one fixed tree, the same for every row of its
block of `NORM_ROWS` rows (rows never mix; the block size is fixed).
So a row's bits depend on its own values, the other operand, the dtype and the tiles only
(given that the GPU's MMA computes an element the same way wherever its row sits in a
tile: `benchmarks/gpu_check.py` section (b) measures it on the device). CPU runs check the
kernels under Triton's interpreter (tests/layers/test_triton_dense.py). Not bit-equal to
cuBLAS / torch, nor to the CPU path.

Arithmetic: operands in their dtype (bf16/fp16; fp32 with IEEE products, no TF32), fp32
accumulation, an fp32 bias added after the last K step, the result rounded to a's dtype;
RMSNorm entirely in fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from headmoe.config import check_positive_int
from headmoe.layers.activations import SWIGLU_ALPHA, SWIGLU_LIMIT
from headmoe.layers.triton_runtime import KERNEL_FLOATS, check_tensors, check_tile_sizes, kernels

#: the module of the kernels (imported at the first call)
KERNELS = "headmoe.layers.triton_dense_kernels"


@dataclasses.dataclass(frozen=True)
class DenseTiles:
    """Fixed tiles of `matmul`: block_m x block_n outputs per program, K in steps of block_k
    (powers of two >= 16); group_m: row blocks per column sweep (the order programs take
    tiles in, for L2 reuse of the weight; it never changes a tile's bits); num_warps /
    num_stages: CUDA launch options (ignored by the interpreter). Rows compared for bits must
    come from calls with the same block sizes."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_tile_sizes(self, ("block_m", "block_n", "block_k"))
        check_positive_int("DenseTiles.group_m", self.group_m)


#: the tiles of each dtype (fixed: a row never sees another configuration). fp32 runs IEEE
#: products on CUDA cores, so its tiles are smaller (registers, shared memory).
DENSE_TILES = {
    torch.bfloat16: DenseTiles(),
    torch.float16: DenseTiles(),
    torch.float32: DenseTiles(block_m=64, block_n=64, block_k=32, num_warps=8),
}
#: rows per program and columns per step of `rms_norm_rows` (fixed: never chosen from the
#: row count; a row is reduced on its own whatever block it shares)
NORM_ROWS = 32
NORM_BLOCK = 128


def matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
    tiles: DenseTiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """`a @ b (+ bias)` with rows independent of the batch.

    a: `[M, K]` or `[G, M, K]`; b: `[K, N]` or `[G, K, N]` (any strides; `weight.t()` of
    an `[N, K]` weight is a view), same float dtype (fp32, fp16, bf16); bias: `[N]` or
    None, added in fp32. Returns `[M, N]` / `[G, M, N]` in a's dtype. tiles: the
    `DENSE_TILES` entry of the dtype when None."""
    if a.dim() not in (2, 3) or b.dim() != a.dim() or a.dtype not in KERNEL_FLOATS:
        raise ValueError(f"a and b must be 2-d or 3-d float tensors of the same rank, got "
                         f"{tuple(a.shape)} {a.dtype} and {tuple(b.shape)}")  # fmt: skip
    if b.dtype != a.dtype or b.shape[-2] != a.shape[-1] or b.shape[:-2] != a.shape[:-2]:
        raise ValueError(f"b must be {a.dtype} [..., {a.shape[-1]}, N] matching a "
                         f"{tuple(a.shape)}, got {tuple(b.shape)} {b.dtype}")  # fmt: skip
    if bias is not None and tuple(bias.shape) != (b.shape[-1],):
        raise ValueError(f"bias must be [{b.shape[-1]}], got {tuple(bias.shape)}")
    tiles = tiles or DENSE_TILES[a.dtype]
    kern = kernels(KERNELS).matmul_kernel
    check_tensors(kern, a=a, b=b, **({} if bias is None else {"bias": bias}))
    a3, b3 = (a, b) if a.dim() == 3 else (a.unsqueeze(0), b.unsqueeze(0))
    g, m, k = a3.shape
    n = b3.shape[2]
    c3 = torch.empty((g, m, n), dtype=a.dtype, device=a.device)
    if m and n and g:
        bias32 = c3 if bias is None else bias.float().contiguous()
        grid = (-(-m // tiles.block_m) * -(-n // tiles.block_n), g)
        kern[grid](
            a3, b3, bias32, c3, m, n, k, *a3.stride(), *b3.stride(), *c3.stride(),
            HAS_BIAS=bias is not None, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            GROUP_M=tiles.group_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip
    return c3 if a.dim() == 3 else c3[0]


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * (1 + weight)` over the last dim, each row reduced on its
    own (`NORM_ROWS` rows per program).

    x: `[..., C]` float (fp32/fp16/bf16); weight: fp32 broadcastable to x (`[C]`, or one
    row of weights per token such as `[T, C]` / `[T, 1, C]`). Returns fp32 `[..., C]`."""
    if x.dtype not in KERNEL_FLOATS or x.dim() == 0:
        raise ValueError(f"x must be a float tensor [..., C], got {tuple(x.shape)} {x.dtype}")
    c = x.shape[-1]
    kern = kernels(KERNELS).rms_norm_kernel
    check_tensors(kern, x=x, weight=weight)
    x2 = x.reshape(-1, c)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w2 = weight.float().expand(x.shape).reshape(-1, c)  # a view unless weight is per token
    if w2.stride(-1) != 1:
        w2 = w2.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] and c:
        o2 = out.view(-1, c)
        r = x2.shape[0]
        kern[(-(-r // NORM_ROWS),)](
            x2, w2, o2, r, c, x2.stride(0), w2.stride(0), o2.stride(0), float(eps),
            BLOCK_R=NORM_ROWS, BLOCK_C=min(NORM_BLOCK, max(16, 1 << (c - 1).bit_length())),
            num_warps=8,
        )  # fmt: skip
    return out


#: rows / columns / K step of `rms_norm_matmul` (fp32 IEEE products; N is the mHC's 2n + n*n)
RMS_MATMUL_TILES = (64, 32, 32)


def rms_norm_matmul(x: torch.Tensor, weight: torch.Tensor, b: torch.Tensor,
                    eps: float) -> torch.Tensor:  # fmt: skip
    """`rms_norm_rows(x, weight, eps) @ b` in one kernel, the norm a per-row scale of the
    GEMM (the mHC logits, issue 30: no `[T, K]` fp32 normed copy is written).

    x: `[M, K]` float (fp32/fp16/bf16, read once per column block); weight: fp32 `[K]` or
    `[M, K]` (one row per token); b: fp32 `[K, N]`. Returns fp32 `[M, N]`; rows independent
    of the batch (fixed tiles, whole K per program). Equal to the two-step form within
    rounding (the scale is applied after the products)."""
    m, k = x.shape
    if b.dtype != torch.float32 or b.dim() != 2 or b.shape[0] != k:
        raise ValueError(f"b must be fp32 [{k}, N], got {tuple(b.shape)} {b.dtype}")
    kern = kernels(KERNELS).rms_matmul_kernel
    check_tensors(kern, x=x, weight=weight, b=b)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = weight.float()
    w = (w.contiguous() if w.dim() == 2 else w.reshape(1, k).contiguous())
    if w.shape[1] != k or w.shape[0] not in (1, m):
        raise ValueError(f"weight must be fp32 [{k}] or [{m}, {k}], got {tuple(weight.shape)}")
    out = torch.empty((m, b.shape[1]), dtype=torch.float32, device=x.device)
    bm, bn, bk = RMS_MATMUL_TILES
    if m and b.shape[1]:
        kern[(-(-m // bm), -(-b.shape[1] // bn))](
            x, w, b.contiguous(), out, m, b.shape[1], k, x.stride(0),
            w.stride(0) if w.shape[0] == m and m > 1 else 0, b.shape[1], out.stride(0),
            float(eps), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
        )  # fmt: skip
    return out


def rms_inv_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`rsqrt(mean(x^2) + eps)` of every row of x `[R, C]` (fp32/fp16/bf16, last stride 1)
    -> fp32 `[R]`: the same bits as the scale `rms_norm_rows` applies (one reduction rule,
    `row_inv_rms`), for the GEMMs that fold the norm in (`linear_rows(norm=...)`)."""
    if x.dim() != 2 or x.dtype not in KERNEL_FLOATS or x.stride(-1) != 1:
        raise ValueError(f"x must be a float [R, C] tensor with last stride 1, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")  # fmt: skip
    kern = kernels(KERNELS).rms_inv_kernel
    check_tensors(kern, x=x)
    r, c = x.shape
    inv = torch.empty(r, dtype=torch.float32, device=x.device)
    if r and c:
        kern[(-(-r // NORM_ROWS),)](
            x, inv, r, c, x.stride(0), float(eps), BLOCK_R=NORM_ROWS,
            BLOCK_C=min(NORM_BLOCK, max(16, 1 << (c - 1).bit_length())), num_warps=8,
        )  # fmt: skip
    return inv


@dataclasses.dataclass(frozen=True)
class RowNorm:
    """An RMSNorm a GEMM applies in its prologue: row r of the operand is read as
    `x[r] * inv[r] * (1 + weight)` in fp32 (`rms_norm_rows`' arithmetic, same bits).
    inv: fp32 `[R]` (`rms_inv_rows` of the operand); weight: fp32 `[K]`."""

    inv: torch.Tensor
    weight: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ColumnGate:
    """A per-row, per-column-group scale a GEMM applies in its prologue: element k of row r
    is read as `a[r, k] * scale[r, k // width]` in fp32 (the attention gate on `[T, H*D]`
    rows: scale fp32 `[T, H]`, width D)."""

    scale: torch.Tensor
    width: int


def _check_linear(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None,
                  norm: RowNorm | None, swiglu: bool, gate: ColumnGate | None,
                  add: torch.Tensor | None) -> None:  # fmt: skip
    """ValueError naming the first argument of `linear_rows` with a bad shape or dtype."""
    if a.dim() != 2 or a.dtype not in KERNEL_FLOATS or b.dim() != 2 or b.shape[0] != a.shape[1]:
        raise ValueError(f"a must be a float [M, K] and b [K, N], got {tuple(a.shape)} "
                         f"{a.dtype} and {tuple(b.shape)}")  # fmt: skip
    n_out = b.shape[1] // 2 if swiglu else b.shape[1]
    if b.dtype not in KERNEL_FLOATS or (swiglu and b.shape[1] % 2):
        raise ValueError(f"b must be float [K, N] (N even with swiglu), got {tuple(b.shape)} "
                         f"{b.dtype}")  # fmt: skip
    if out.dim() != 2 or tuple(out.shape) != (a.shape[0], n_out) or out.stride(1) != 1:
        raise ValueError(f"out must be [{a.shape[0]}, {n_out}] with last stride 1, got "
                         f"{tuple(out.shape)} strides {out.stride()}")  # fmt: skip
    if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 1):
        raise ValueError(f"rows must be int64 [R], got {tuple(rows.shape)} {rows.dtype}")
    if norm is not None and (tuple(norm.inv.shape) != (a.shape[0],)
                             or tuple(norm.weight.shape) != (a.shape[1],)):
        raise ValueError(f"norm must hold inv [{a.shape[0]}] and weight [{a.shape[1]}], got "
                         f"{tuple(norm.inv.shape)} and {tuple(norm.weight.shape)}")  # fmt: skip
    if gate is not None and (norm is not None or gate.scale.dim() != 2
                             or gate.scale.shape[0] != a.shape[0]
                             or gate.scale.shape[1] * gate.width != a.shape[1]):
        raise ValueError(f"gate must be fp32 [{a.shape[0]}, G] with G * width = {a.shape[1]} "
                         f"(and no norm), got {tuple(gate.scale.shape)} x {gate.width}")
    if add is not None and (add.dtype != torch.float32 or add.shape != out.shape
                            or add.stride(1) != 1):
        raise ValueError(f"add must be fp32 {tuple(out.shape)} with last stride 1, got "
                         f"{tuple(add.shape)} {add.dtype}")  # fmt: skip


def linear_rows(
    a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None, norm: RowNorm | None = None,
    gate: ColumnGate | None = None, bias: torch.Tensor | None = None, swiglu: bool = False,
    add: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
    tiles: DenseTiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """A layer's linear in one kernel, casts and gathers folded in: for each row r (all of
    a, or the int64 `rows` `[R]`), `out[r] = epilogue(prologue(a[r]) @ b)`.

    a: `[M, K]` fp32/fp16/bf16 (last stride 1), read in its dtype; prologue: `norm`'s
    per-row RMSNorm in fp32 (`RowNorm`) or `gate`'s per-column-group scale (`ColumnGate`),
    then the cast to b's dtype in registers. b: `[K, N]` in the compute dtype (`weight.t()`
    is a view). Epilogue: the fp32 sum rounded to b's dtype and widened (what
    `bi_linear(a.to(b.dtype), ...).float()` gives), + bias (fp32 `[N]`), SwiGLU7 of the even
    (gate) / odd (up) columns with `swiglu` (N/2 columns out), + add (fp32, out's shape).
    out: `[M, N or N/2]` to write the rows into (other rows untouched), else a new tensor in
    `out_dtype`. Rows independent of the batch and of their place (fixed tiles of b's
    dtype, whole K per program): bits equal to the unfused sequence, given the MMA's."""
    n_out = b.shape[1] // 2 if swiglu else b.shape[1]
    if out is None:
        out = torch.empty((a.shape[0], n_out), dtype=out_dtype, device=a.device)
    _check_linear(a, b, out, rows, norm, swiglu, gate, add)
    a = a if a.stride(1) == 1 else a.contiguous()
    kern = kernels(KERNELS).linear_kernel
    extra = {} if bias is None else {"bias": bias}
    check_tensors(kern, a=a, b=b, out=out, **extra)
    tiles = tiles or DENSE_TILES[b.dtype]
    m = a.shape[0] if rows is None else rows.numel()
    k, n = b.shape
    if m == 0 or n == 0:
        return out
    idx = out if rows is None else rows.contiguous()
    inv, nw = (out, out) if norm is None else (norm.inv, norm.weight.float().contiguous())
    if gate is not None:
        inv = gate.scale if gate.scale.stride(1) == 1 else gate.scale.contiguous()
    kern[(-(-m // tiles.block_m) * -(-n // tiles.block_n),)](
        a, idx, inv, nw, b, out if bias is None else bias.float().contiguous(),
        out if add is None else add, out, m, n, k, a.stride(0), *b.stride(), inv.stride(0),
        (out if add is None else add).stride(0), out.stride(0), GATHER=rows is not None,
        NORM=norm is not None, SCALE_DIV=0 if gate is None else gate.width,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, ADD=add is not None, LIMIT=SWIGLU_LIMIT,
        ALPHA=SWIGLU_ALPHA, PRECISION="ieee" if b.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
