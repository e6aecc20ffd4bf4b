"""Manifold-constrained hyper-connections (mHC): n residual streams mixed per token.

For a branch F with fused projection Phi `[n*C, 2n + n*n]`: x = RMSNorm(vec S);
l = x Phi; h_pre = sigmoid(a_pre s l_pre + b_pre); u = sum_i h_pre[i] S[i];
h_post = 2 sigmoid(a_post s l_post + b_post); H_res = Sinkhorn(a_res s l_res + b_res);
S <- H_res S + h_post (outer) F(u), with s = 1 / sqrt(n C). Every sum runs in a fixed
index order on `[T, ...]` slices, so a token's bits do not depend on the other tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from headmoe.layers import triton_dense, triton_mhc, triton_runtime
from headmoe.layers.activations import sigmoid
from headmoe.layers.matmul import bi_matmul
from headmoe.layers.norms import rms_norm


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`[T, n, n]` fp32 logits -> `[T, n, n]` fp32, approximately doubly stochastic.

    Exponentiates after subtracting each token's max, then alternately normalises columns and
    rows `iters` times (divisor `sum + eps`)."""
    p = torch.exp(logits - logits.amax(dim=(1, 2), keepdim=True))
    n = p.shape[1]
    for _ in range(iters):
        col = p[:, 0:1, :]
        for i in range(1, n):
            col = col + p[:, i : i + 1, :]
        p = p / (col + eps)
        row = p[:, :, 0:1]
        for j in range(1, n):
            row = row + p[:, :, j : j + 1]
        p = p / (row + eps)
    return p


@dataclass
class MHCMix:
    """One branch's per-token mixing coefficients: h_pre, h_post `[T, n]`, h_res `[T, n, n]`."""

    h_pre: torch.Tensor
    h_post: torch.Tensor
    h_res: torch.Tensor


def mhc_mix(
    state: torch.Tensor, norm_weight: torch.Tensor, phi: torch.Tensor,
    alpha: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *, iters: int, eps: float, norm_eps: float,
) -> MHCMix:
    """Coefficients of one branch.

    state `[T, n, C]` fp32; norm_weight `[n*C]`; phi `[n*C, 2n + n*n]`; alpha = (a_pre, a_post,
    a_res) scalars `[1]`; bias = (b_pre `[n]`, b_post `[n]`, b_res `[n*n]`); all fp32."""
    t, n, c = state.shape
    if triton_runtime.use_triton(state):  # CUDA: the RMSNorm as a per-row scale of the GEMM
        weight = norm_weight.reshape(-1, n * c) if norm_weight.dim() > 1 else norm_weight
        logits = triton_dense.rms_norm_matmul(state.reshape(t, n * c), weight, phi, norm_eps)
    else:
        logits = bi_matmul(rms_norm(state.reshape(t, n * c), norm_weight, norm_eps), phi)
    s = 1.0 / math.sqrt(n * c)
    if triton_runtime.use_triton(logits):  # CUDA: one fused kernel (headmoe.layers.triton_mhc)
        return MHCMix(*triton_mhc.mhc_coeffs(logits, alpha, bias, n, s, iters, eps))
    l_pre, l_post, l_res = logits[:, :n], logits[:, n : 2 * n], logits[:, 2 * n :]
    h_pre = sigmoid(alpha[0] * s * l_pre + bias[0])
    h_post = 2.0 * sigmoid(alpha[1] * s * l_post + bias[1])
    h_res = sinkhorn((alpha[2] * s * l_res + bias[2]).reshape(t, n, n), iters, eps)
    return MHCMix(h_pre, h_post, h_res)


def mhc_input(state: torch.Tensor, mix: MHCMix, out_dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:  # fmt: skip
    """Branch input `u = sum_i h_pre[i] S[i]` (fp32): state `[T, n, C]` -> `[T, C]` in
    out_dtype. CUDA: one kernel (`headmoe.layers.triton_mhc`)."""
    if triton_runtime.use_triton(state):
        return triton_mhc.mhc_input(state, mix.h_pre, out_dtype)
    u = mix.h_pre[:, 0:1] * state[:, 0]
    for i in range(1, state.shape[1]):
        u = u + mix.h_pre[:, i : i + 1] * state[:, i]
    return u.to(out_dtype)


def mhc_update(state: torch.Tensor, mix: MHCMix, y: torch.Tensor,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """`S <- H_res S + h_post (outer) y` (fp32): state `[T, n, C]`, y `[T, C]` ->
    `[T, n, C]` in out_dtype. CUDA: one kernel (`headmoe.layers.triton_mhc`)."""
    if triton_runtime.use_triton(state):
        return triton_mhc.mhc_update(state, mix.h_res, mix.h_post, y, out_dtype)
    n = state.shape[1]
    rows = []
    for i in range(n):
        acc = mix.h_res[:, i, 0:1] * state[:, 0]
        for j in range(1, n):
            acc = acc + mix.h_res[:, i, j : j + 1] * state[:, j]
        rows.append(acc + mix.h_post[:, i : i + 1] * y)
    return torch.stack(rows, dim=1).to(out_dtype)
