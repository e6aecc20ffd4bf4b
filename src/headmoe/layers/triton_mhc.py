"""Fused mHC on the GPU (issue 30): the coefficients of a branch (sigmoids and the whole
Sinkhorn loop) in one kernel, `mhc_input` and `mhc_update` one kernel each.

Why: the torch definition (`headmoe.layers.mhc`) issues about 200 launches per Sinkhorn
call and 36 elementwise ops per update, each reading and writing a full `[T, C]` fp32
tensor; `benchmarks/gpu_proxy.py` counts them.

Maths: the torch definition's, in fp32, sums in the same index order (the Sinkhorn column /
row sums use `tl.sum`'s tree over 4 values instead of the left-to-right chain: equal within
rounding, not bit for bit). Invariance: a program owns `BLOCK_T` whole tokens (and, for
the streams, a fixed channel block); every token is computed from its own values with the
same code, masked rows load zeros, so a token's bits do not depend on the other rows nor on
its place in the call. The n streams are a constexpr (the released n = 4; a power of two).
"""

from __future__ import annotations

import torch

from headmoe.layers.triton_runtime import check_tensors, kernels

#: the module of the kernels (imported at the first call)
KERNELS = "headmoe.layers.triton_mhc_kernels"
#: tokens per program of the coefficient kernel; tokens x channels of the stream kernels
COEFF_ROWS, STREAM_ROWS, STREAM_COLS = 32, 16, 128


def mhc_coeffs(
    logits: torch.Tensor, alpha: tuple[torch.Tensor, ...], bias: tuple[torch.Tensor, ...],
    n: int, scale: float, iters: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits `[T, 2n + n*n]` fp32; alpha: three fp32 `[1]`; bias: fp32 `[n]`, `[n]`,
    `[n*n]`. Returns h_pre `[T, n]`, h_post `[T, n]`, h_res `[T, n, n]` fp32."""
    t = logits.shape[0]
    if logits.dtype != torch.float32 or tuple(logits.shape[1:]) != (2 * n + n * n,):
        raise ValueError(f"logits must be fp32 [T, {2 * n + n * n}], got "
                         f"{tuple(logits.shape)} {logits.dtype}")  # fmt: skip
    kern = kernels(KERNELS).mhc_coeffs_kernel
    check_tensors(kern, logits=logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    a = torch.cat([x.reshape(1).float() for x in alpha])
    b = [x.reshape(-1).float().contiguous() for x in bias]
    pre = torch.empty((t, n), dtype=torch.float32, device=logits.device)
    post, res = torch.empty_like(pre), pre.new_empty((t, n, n))
    if t:
        kern[(-(-t // COEFF_ROWS),)](
            logits, a, *b, pre, post, res, t, logits.stride(0), float(scale), int(iters),
            float(eps), N=n, BLOCK_T=COEFF_ROWS, num_warps=4,
        )  # fmt: skip
    return pre, post, res


def _streams(state: torch.Tensor) -> torch.Tensor:
    return state if state.stride(2) == 1 else state.contiguous()


def mhc_input(state: torch.Tensor, h_pre: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`u = sum_i h_pre[i] S[i]`: state `[T, n, C]` (fp32/fp16/bf16), h_pre fp32 `[T, n]` ->
    `[T, C]` in out_dtype (accumulated in fp32)."""
    state = _streams(state)
    t, n, c = state.shape
    kern = kernels(KERNELS).mhc_input_kernel
    check_tensors(kern, state=state, h_pre=h_pre)
    out = torch.empty((t, c), dtype=out_dtype, device=state.device)
    if t and c:
        grid = (-(-t // STREAM_ROWS), -(-c // STREAM_COLS))
        kern[grid](state, h_pre.float().contiguous(), out, t, c, state.stride(0),
                   state.stride(1), out.stride(0), N=n, BLOCK_T=STREAM_ROWS,
                   BLOCK_C=STREAM_COLS, num_warps=4)  # fmt: skip
    return out


def mhc_update(
    state: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """`S <- H_res S + h_post (outer) y`: state `[T, n, C]`, h_res fp32 `[T, n, n]`, h_post
    fp32 `[T, n]`, y `[T, C]` -> `[T, n, C]` in out_dtype (accumulated in fp32)."""
    state = _streams(state)
    y = y if y.stride(1) == 1 else y.contiguous()
    t, n, c = state.shape
    kern = kernels(KERNELS).mhc_update_kernel
    check_tensors(kern, state=state, h_res=h_res, h_post=h_post, y=y)
    out = torch.empty((t, n, c), dtype=out_dtype, device=state.device)
    if t and c:
        grid = (-(-t // STREAM_ROWS), -(-c // STREAM_COLS))
        kern[grid](state, h_res.float().contiguous(), h_post.float().contiguous(), y, out, t, c,
                   state.stride(0), state.stride(1), y.stride(0), out.stride(0), out.stride(1),
                   N=n, BLOCK_T=STREAM_ROWS, BLOCK_C=STREAM_COLS, num_warps=4)  # fmt: skip
    return out
