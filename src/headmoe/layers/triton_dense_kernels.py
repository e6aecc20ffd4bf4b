"""Triton kernels of the batch-invariant dense ops (imported lazily by
`headmoe.layers.triton_dense`, which documents shapes and the invariance argument).
Importing this module imports triton; TRITON_INTERPRET is read at import."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, m_blocks, n_blocks, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid` of an `m_blocks` x `n_blocks` tile grid
    swept in groups of GROUP_M row blocks: the programs of a group walk down its row blocks
    within one column block, then move to the next column block, so programs running at the
    same time share their b (weight) tiles in L2 instead of each streaming all of b. The last
    group holds the remaining row blocks. A bijection of [0, m_blocks * n_blocks); which
    program computes a tile never changes the tile's arithmetic."""
    per_group = GROUP_M * n_blocks
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(m_blocks - first, GROUP_M)
    local = pid % per_group
    return first + local % size, local // size


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
    stride_ag, stride_am, stride_ak, stride_bg, stride_bk, stride_bn,
    stride_cg, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """One program: rows `[m0, m0 + BLOCK_M)` x columns `[n0, n0 + BLOCK_N)` of group
    `program_id(1)` of `c = a @ b (+ bias)`, the tile `grouped_tile` gives it. The whole K is walked by this program, from 0
    upwards in steps of BLOCK_K (no split-K), accumulating in fp32; rows past M and
    columns past K load zeros. The bias (fp32) is added once, after the last step; the
    result is rounded to c's dtype."""
    tile_m, tile_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                  GROUP_M)
    group = tl.program_id(1).to(tl.int64)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + group * stride_ag + rows.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + group * stride_bg + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        a = tl.load(a_rows + (k0 + kk)[None, :] * stride_ak,
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + kk)[:, None] * stride_bk,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
    dst = c_ptr + group * stride_cg + rows.to(tl.int64)[:, None] * stride_cm
    tl.store(dst + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])  # fmt: skip


@triton.jit
def rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, R, C, stride_x, stride_w, stride_out, eps,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program: rows `[r0, r0 + BLOCK_R)`, each reduced on its own (rows past R are
    masked). `out = x * rsqrt(sum(x^2) / C + eps) * (1 + w)` in fp32: a row's squares are
    summed in BLOCK_C lanes over the row in steps of BLOCK_C from column 0, then its lanes
    are reduced along axis 1 by one fixed tree (`tl.sum`), the same tree for every row of
    the block, so no row's bits depend on the others or on its place in the block."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    inv = row_inv_rms(x_ptr, rows, rmask, C, stride_x, eps, BLOCK_R, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        mask = rmask[:, None] & (c0 + cols < C)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + (c0 + cols)[None, :], mask=mask, other=0.0)
        w = tl.load(w_ptr + rows[:, None] * stride_w + (c0 + cols)[None, :], mask=mask, other=0.0)
        out = x.to(tl.float32) * inv[:, None] * (1.0 + w)
        tl.store(out_ptr + rows[:, None] * stride_out + (c0 + cols)[None, :], out, mask=mask)


@triton.jit
def rms_matmul_kernel(
    a_ptr, w_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_wm, stride_bk, stride_cm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: rows `[m0, m0 + BLOCK_M)` x columns `[n0, n0 + BLOCK_N)` of
    `RMSNorm(a; w) @ b` with the norm folded in: the K loop (from 0, steps of BLOCK_K, no
    split-K) accumulates `(a * (1 + w)) @ b` in fp32 (IEEE products) and each row's squares in
    BLOCK_K lanes; the epilogue scales row r by `rsqrt(sum / K + eps)` (lanes reduced by one
    fixed tree). w has one row per a row (stride_wm = 0: shared weights). fp32 out."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    rows = rows.to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        m2 = rmask[:, None] & kmask[None, :]
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + kk)[None, :], mask=m2, other=0.0)
        a = a.to(tl.float32)
        ss += a * a
        w = tl.load(w_ptr + rows[:, None] * stride_wm + (k0 + kk)[None, :], mask=m2, other=0.0)
        b = tl.load(b_ptr + (k0 + kk)[:, None] * stride_bk + cols[None, :],
                    mask=kmask[:, None] & cmask[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a * (1.0 + w), b, acc, input_precision="ieee")
    inv = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc * inv[:, None],
             mask=rmask[:, None] & cmask[None, :])  # fmt: skip


@triton.jit
def row_inv_rms(x_ptr, rows, rmask, C, stride_x, eps, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):  # fmt: skip
    """`rsqrt(sum(x^2) / C + eps)` `[BLOCK_R]` fp32 of the int64 `rows` of x: the squares
    summed in BLOCK_C lanes from column 0, the lanes reduced by one fixed tree (`tl.sum`),
    the same for every row (`rms_norm_kernel` and `rms_inv_kernel` both take it from here)."""
    cols = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        mask = rmask[:, None] & (c0 + cols < C)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + (c0 + cols)[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        acc += x * x
    return tl.rsqrt(tl.sum(acc, axis=1) / C + eps)


@triton.jit
def rms_inv_kernel(
    x_ptr, inv_ptr, R, C, stride_x, eps, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program: rows `[r0, r0 + BLOCK_R)`; inv[r] = `row_inv_rms` of row r (fp32)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    inv = row_inv_rms(x_ptr, rows.to(tl.int64), rmask, C, stride_x, eps, BLOCK_R, BLOCK_C)
    tl.store(inv_ptr + rows, inv, mask=rmask)


@triton.jit
def linear_kernel(
    a_ptr, idx_ptr, inv_ptr, nw_ptr, b_ptr, bias_ptr, add_ptr, c_ptr, M, N, K,
    stride_am, stride_bk, stride_bn, stride_sm, stride_dm, stride_cm,
    GATHER: tl.constexpr, NORM: tl.constexpr, SCALE_DIV: tl.constexpr, HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr, ADD: tl.constexpr,
    LIMIT: tl.constexpr, ALPHA: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M rows x BLOCK_N columns of `c[rows] = epilogue(prologue(a[rows])
    @ b)`, the tile `grouped_tile` gives it; the whole K from 0 in steps of BLOCK_K (no
    split-K), fp32 accumulation.

    rows: `idx[i]` (int64) for i in the tile with GATHER, else i. Prologue in registers:
    with NORM, `a * inv[row] * (1 + nw)` in fp32 (the RMSNorm as a per-row scale; inv_ptr,
    nw_ptr); with SCALE_DIV > 0, `a * s[row, k // SCALE_DIV]` in fp32 (a per-row,
    per-column-group scale such as the attention gate; s at inv_ptr, row stride
    stride_sm); then a is cast to b's dtype. Epilogue: the sum rounded to b's dtype and
    widened to fp32 (the `bi_linear(...).float()` of the layers), + the fp32 bias with
    HAS_BIAS; with SWIGLU the even / odd columns are gate / up and `min(g, LIMIT) *
    sigmoid(ALPHA * min(g, LIMIT)) * (clamp(u, -LIMIT, LIMIT) + 1)` lands in column n // 2;
    with ADD, + the fp32 `add[row]` (row stride stride_dm); stored in c's dtype."""
    tile_m, tile_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                  GROUP_M)
    local = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = local < M
    if GATHER:
        rows = tl.load(idx_ptr + local, mask=rmask, other=0)
    else:
        rows = local.to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    kk = tl.arange(0, BLOCK_K)
    if NORM:
        inv = tl.load(inv_ptr + rows, mask=rmask, other=0.0)
    a_rows = a_ptr + rows[:, None] * stride_am
    b_cols = b_ptr + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        a = tl.load(a_rows + (k0 + kk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            w = tl.load(nw_ptr + k0 + kk, mask=kmask, other=0.0)
            a = a.to(tl.float32) * inv[:, None] * (1.0 + w[None, :])
        if SCALE_DIV > 0:
            sc = tl.load(inv_ptr + rows[:, None] * stride_sm + ((k0 + kk) // SCALE_DIV)[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
            a = a.to(tl.float32) * sc
        b = tl.load(b_cols + (k0 + kk)[:, None] * stride_bk,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)
    y = acc.to(b_ptr.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
    if SWIGLU:
        g, u = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
        g = tl.minimum(g, LIMIT)
        s = 1.0 / (1.0 + tl.exp(-(g * ALPHA)))
        y = g * s * (tl.minimum(tl.maximum(u, -LIMIT), LIMIT) + 1.0)
        cols = tile_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        cmask = cols < N // 2
    if ADD:
        y += tl.load(add_ptr + rows[:, None] * stride_dm + cols[None, :],
                     mask=rmask[:, None] & cmask[None, :], other=0.0)
    dst = c_ptr + rows[:, None] * stride_cm + cols[None, :]
    tl.store(dst, y.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
