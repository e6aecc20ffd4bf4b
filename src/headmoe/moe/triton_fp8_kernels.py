"""Triton kernels of the W8A16 MoE experts (imported lazily by `headmoe.moe.triton_fp8`).

The gate/up and down kernels of `headmoe.moe.triton_moe_kernels` with FP8 E4M3 weights:
each weight tile is loaded through its TMA descriptor and converted in registers to the
activations' dtype (exact: every E4M3 value is a bf16, fp16 and fp32 value), by the
hardware's conversion (NATIVE: float8_e4m3fn tiles; triton takes that type on sm_89 and
later only) or by integer bit operations on uint8 tiles (any GPU; `_e4m3_bits`); both
give the same values, so the same bits. The product accumulates in fp32, and the per-output-channel fp32 scale
(`headmoe.moe.fp8`) multiplies the accumulator once after the reduction (the scale is
constant along it). The routing, group schedule and combine are the bf16 path's
(`triton_moe_kernels.combine_kernel`). The invariance argument is the same: fixed tiles,
one reduction order, masked rows load zeros, no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3_bits(b, dtype: tl.constexpr):
    """uint8 E4M3 bytes -> their values in `dtype`, exactly, with integer ops and one fp32
    product: (m + 8 [normal]) * 2**(max(e, 1) - 10), the power of two built from its bits
    (never a denormal), sign from bit 7 (-0 kept). NaN bytes (0x7f, 0xff) would widen to
    +-3840: `quantize` never writes them and loaders refuse them (`fp8.check_fp8_bytes`)."""
    bits = b.to(tl.int32)
    e = (bits >> 3) & 15
    m = bits & 7
    mant = tl.where(e > 0, m + 8, m).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)
    v = mant * pow2
    return tl.where((bits & 128) != 0, -v, v).to(dtype)


@triton.jit
def _widen(b, dtype: tl.constexpr, NATIVE: tl.constexpr):
    """A weight tile (float8_e4m3fn if NATIVE, else its uint8 bytes) as `dtype` values."""
    if NATIVE:  # a constexpr branch: only the taken one is compiled
        out = b.to(dtype)
    else:
        out = _e4m3_bits(b, dtype)
    return out


@triton.jit
def _channel_scale(scale_ptr, group, n0, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fp32 scales of output channels `[n0, n0 + BLOCK_N)` of `group` (zeros past N)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    return tl.load(scale_ptr + group.to(tl.int64) * N + cols, mask=cols < N, other=0.0)


@triton.jit
def gate_up_fp8_kernel(
    z_ptr, src_ptr, tile_group_ptr, tile_rows_ptr, wg_desc, wu_desc, sg_ptr, su_ptr, h_desc,
    groups, experts, stride_zt, stride_zh,
    D: tl.constexpr, F: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    PRECISION: tl.constexpr, NATIVE: tl.constexpr, N_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: tile `program_id(0) // N_BLOCKS` x d_expert columns block
    `program_id(0) % N_BLOCKS`, as `gate_up_kernel` with its row gather (`src` holds each
    row's token; head = group // experts). Weights: `[G*D, F]` float8_e4m3fn (NATIVE) or
    uint8 descriptors, scales sg/su `[G, F]` fp32. h = SwiGLU7(sg * (z Q_gate), su * (z Q_up)), fp32, rounded
    to h's dtype."""
    tile = tl.program_id(0) // N_BLOCKS
    group = tl.load(tile_group_ptr + tile)
    if group >= groups:  # beyond the last tile of the schedule's upper bound
        return
    local = tl.arange(0, BLOCK_M)
    rmask = local < tl.load(tile_rows_ptr + tile)
    row0 = tile * BLOCK_M
    src = tl.load(src_ptr + row0 + local, mask=rmask, other=0)
    z_rows = z_ptr + (group // experts).to(tl.int64) * stride_zh + src * stride_zt
    n0 = (tl.program_id(0) % N_BLOCKS) * BLOCK_N
    kk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a = tl.load(z_rows[:, None] + (k0 + kk)[None, :], mask=rmask[:, None], other=0.0)
        bg = _widen(wg_desc.load([group * D + k0, n0]), a.dtype, NATIVE)
        bu = _widen(wu_desc.load([group * D + k0, n0]), a.dtype, NATIVE)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
    acc_g = acc_g * _channel_scale(sg_ptr, group, n0, F, BLOCK_N)[None, :]
    acc_u = acc_u * _channel_scale(su_ptr, group, n0, F, BLOCK_N)[None, :]
    g = tl.minimum(acc_g, LIMIT)
    s = 1.0 / (1.0 + tl.exp(-(g * ALPHA)))
    u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT) + 1.0
    act = g * s * u
    h_desc.store([row0, n0], act.to(h_desc.dtype))


@triton.jit
def down_fp8_kernel(
    h_desc, wd_desc, sd_ptr, y_desc, tile_group_ptr, groups,
    F: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr,
    N_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: tile `program_id(0) // N_BLOCKS` x d columns block `program_id(0) %
    N_BLOCKS`. y = sd * (h Q_down), Q_down through a `[G*F, D]` float8_e4m3fn (NATIVE) or
    uint8 descriptor converted to h's dtype, accumulated in fp32 over d_expert in steps of BLOCK_K, scaled
    by sd `[G, D]` fp32, stored fp32 at the tile's rows of y."""
    tile = tl.program_id(0) // N_BLOCKS
    group = tl.load(tile_group_ptr + tile)
    if group >= groups:
        return
    row0 = tile * BLOCK_M
    n0 = (tl.program_id(0) % N_BLOCKS) * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        a = h_desc.load([row0, k0])
        b = _widen(wd_desc.load([group * F + k0, n0]), a.dtype, NATIVE)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    y_desc.store([row0, n0], acc * _channel_scale(sd_ptr, group, n0, D, BLOCK_N)[None, :])
