"""Triton kernels of fused mHC (imported lazily by `headmoe.layers.triton_mhc`, which
documents shapes and the invariance argument). Importing this module imports triton;
TRITON_INTERPRET is read at import."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mhc_coeffs_kernel(
    logits_ptr, alpha_ptr, b_pre_ptr, b_post_ptr, b_res_ptr, pre_ptr, post_ptr, res_ptr,
    T, stride_l, scale, iters, eps, N: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """One program: tokens `[t0, t0 + BLOCK_T)` (rows past T masked). From a token's logits
    `[2N + N*N]`: h_pre = sigmoid(a_pre s l_pre + b_pre), h_post = 2 sigmoid(a_post s l_post
    + b_post), h_res = Sinkhorn(a_res s l_res + b_res) (exp after subtracting the token's
    max, then `iters` column / row normalisations, divisor sum + eps). Every reduction runs
    over one token's own N x N values, the same tree for every token."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    rows = rows.to(tl.int64)
    i = tl.arange(0, N)
    base = logits_ptr + rows[:, None] * stride_l
    a_pre = tl.load(alpha_ptr)
    a_post = tl.load(alpha_ptr + 1)
    a_res = tl.load(alpha_ptr + 2)
    l_pre = tl.load(base + i[None, :], mask=rmask[:, None], other=0.0)
    l_post = tl.load(base + N + i[None, :], mask=rmask[:, None], other=0.0)
    h_pre = 1.0 / (1.0 + tl.exp(-(a_pre * scale * l_pre + tl.load(b_pre_ptr + i)[None, :])))
    h_post = 2.0 * (1.0 / (1.0 + tl.exp(-(a_post * scale * l_post
                                          + tl.load(b_post_ptr + i)[None, :]))))
    out2 = rows[:, None] * N + i[None, :]
    tl.store(pre_ptr + out2, h_pre, mask=rmask[:, None])
    tl.store(post_ptr + out2, h_post, mask=rmask[:, None])
    ij = i[:, None] * N + i[None, :]
    m3 = rmask[:, None, None]
    l_res = tl.load(base[:, :, None] + 2 * N + ij[None, :, :], mask=m3, other=0.0)
    x = a_res * scale * l_res + tl.load(b_res_ptr + ij)[None, :, :]
    p = tl.exp(x - tl.max(tl.max(x, axis=2), axis=1)[:, None, None])
    for _ in range(iters):
        p = p / (tl.sum(p, axis=1)[:, None, :] + eps)
        p = p / (tl.sum(p, axis=2)[:, :, None] + eps)
    tl.store(res_ptr + rows[:, None, None] * (N * N) + ij[None, :, :], p, mask=m3)


@triton.jit
def mhc_input_kernel(
    state_ptr, pre_ptr, out_ptr, T, C, stride_t, stride_s, stride_o,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program: tokens `[t0, t0 + BLOCK_T)` x channels `[c0, c0 + BLOCK_C)` of
    `u = sum_i h_pre[i] S[i]` in fp32, streams added in index order, stored in out's dtype."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < T)[:, None] & (cols < C)[None, :]
    rows = rows.to(tl.int64)
    src = state_ptr + rows[:, None] * stride_t + cols[None, :]
    h = tl.load(pre_ptr + rows * N, mask=rows < T, other=0.0)
    acc = h[:, None] * tl.load(src, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(1, N):
        h = tl.load(pre_ptr + rows * N + i, mask=rows < T, other=0.0)
        acc = acc + h[:, None] * tl.load(src + i * stride_s, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + rows[:, None] * stride_o + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def mhc_update_kernel(
    state_ptr, res_ptr, post_ptr, y_ptr, out_ptr, T, C, stride_t, stride_s, stride_y,
    stride_ot, stride_os, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program: tokens `[t0, t0 + BLOCK_T)` x channels `[c0, c0 + BLOCK_C)` of every
    stream i of `S'[i] = sum_j H_res[i, j] S[j] + h_post[i] y` in fp32 (j in index order,
    then the y term), reading S and y once and storing S' in out's dtype."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < T
    mask = rmask[:, None] & (cols < C)[None, :]
    rows = rows.to(tl.int64)
    i = tl.arange(0, N)
    src = state_ptr + rows[:, None] * stride_t + cols[None, :]
    hres = res_ptr + rows[:, None] * (N * N) + i[None, :] * N
    s = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(hres, mask=rmask[:, None], other=0.0)[:, :, None] * s[:, None, :]
    for j in tl.static_range(1, N):
        s = tl.load(src + j * stride_s, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(hres + j, mask=rmask[:, None], other=0.0)
        acc = acc + h[:, :, None] * s[:, None, :]
    y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0)
    hp = tl.load(post_ptr + rows[:, None] * N + i[None, :], mask=rmask[:, None], other=0.0)
    acc = acc + hp[:, :, None] * y.to(tl.float32)[:, None, :]
    dst = out_ptr + rows[:, None, None] * stride_ot + i[None, :, None] * stride_os
    tl.store(dst + cols[None, None, :], acc.to(out_ptr.dtype.element_ty), mask=mask[:, None, :])
