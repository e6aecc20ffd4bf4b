"""Triton kernels of the MoE GPU path (imported lazily by `headmoe.moe.triton_moe`).

Importing this module imports triton; `triton.jit` decides at import time whether the
kernels are compiled or interpreted (TRITON_INTERPRET). Shapes, dtypes and the invariance
argument are in `headmoe.moe.triton_moe` and docs/moe.md section 3. Every kernel computes
each output row from its own inputs only: tile shapes are compile-time constants, the
reduction dims are walked in one fixed order, masked rows load zeros and their results are
never read, and there are no atomics. Dense operands (weights, the padded
intermediates) go through TMA tensor descriptors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_kernel(
    z_ptr, gate_ptr, bias_ptr, ids_ptr, w_ptr, n_tokens, stride_zt, stride_zh,
    route_scale, eps,
    H: tl.constexpr, E: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M tokens of one head. Logits in fp32 (IEEE products), sigmoid,
    top-k of score + bias with ties to the lowest id and NaN above every number, ids stored ascending with their
    unbiased scores L1-normalised (ascending-order sum) times route_scale."""
    head = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tmask = tok < n_tokens
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    kk = tl.arange(0, BLOCK_K)
    z_rows = z_ptr + tok.to(tl.int64) * stride_zt + head * stride_zh
    g_rows = gate_ptr + (head * E + cols).to(tl.int64) * D
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kmask = (k0 + kk) < D
        a = tl.load(z_rows[:, None] + (k0 + kk)[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        b = tl.load(g_rows[None, :] + (k0 + kk)[:, None],
                    mask=cmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    scores = 1.0 / (1.0 + tl.exp(-acc))
    bias = tl.load(bias_ptr + head * E + cols, mask=cmask, other=0.0)
    sel = tl.where(cmask[None, :], scores + bias[None, :], float("-inf"))
    # NaN scores (a NaN input row) select first, like torch.sort's descending order in
    # `route`: a NaN row gets experts 0..TOP_K-1, never the out-of-range id BLOCK_E
    sel = tl.where(sel != sel, float("inf"), sel)
    free = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.int32) + cmask[None, :].to(tl.int32)
    for _ in tl.static_range(TOP_K):  # biased selection, ties to the lowest id
        best = tl.max(tl.where(free != 0, sel, float("-inf")), axis=1)
        cand = (free != 0) & (sel == best[:, None])
        pick = tl.min(tl.where(cand, cols[None, :], BLOCK_E), axis=1)
        free = tl.where(cols[None, :] == pick[:, None], 0, free)
    chosen = cmask[None, :] & (free == 0)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    left = chosen
    for _ in tl.static_range(TOP_K):  # the chosen scores summed in ascending id order
        pick = tl.min(tl.where(left, cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == pick[:, None]
        total += tl.sum(tl.where(hit, scores, 0.0), axis=1)
        left = left & (~hit)
    denom = tl.maximum(total, eps)
    out = (tok.to(tl.int64) * H + head) * TOP_K
    left = chosen
    for j in tl.static_range(TOP_K):
        pick = tl.min(tl.where(left, cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == pick[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        tl.store(ids_ptr + out + j, pick.to(tl.int64), mask=tmask)
        tl.store(w_ptr + out + j, w / denom * route_scale, mask=tmask)
        left = left & (~hit)


@triton.jit
def gate_up_kernel(
    z_ptr, src_ptr, tile_group_ptr, tile_rows_ptr, wg_desc, wu_desc, h_desc, groups, experts,
    stride_zt, stride_zh,
    D: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr, PRECISION: tl.constexpr,
    ROW_GATHER: tl.constexpr, N_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: tile `program_id(0) // N_BLOCKS` (BLOCK_M padded rows of one (head,
    expert) group) x columns block `program_id(0) % N_BLOCKS` (BLOCK_N of d_expert); a 1-d
    grid, so the blocks of one tile run next to each other and share its rows in L2. Gathers
    the tile's z rows (rows past the tile's `tile_rows` load zeros): with ROW_GATHER, `src`
    holds each row's token and its address is `z + head * stride_zh + token * stride_zt`
    (head = group // experts; triton specialises strides divisible by 16, so it knows the
    rows' alignment and issues 16-byte loads); without, `src` holds element offsets. h = SwiGLU7(z W_gate, z W_up) accumulated in
    fp32, rounded to h's dtype, stored at the tile's rows of h. Weights are read through
    `[G*D, F]` descriptors (D a multiple of BLOCK_K, so a block never crosses groups)."""
    tile = tl.program_id(0) // N_BLOCKS
    group = tl.load(tile_group_ptr + tile)
    if group >= groups:  # beyond the last tile of the schedule's upper bound
        return
    local = tl.arange(0, BLOCK_M)
    rmask = local < tl.load(tile_rows_ptr + tile)
    row0 = tile * BLOCK_M
    src = tl.load(src_ptr + row0 + local, mask=rmask, other=0)
    if ROW_GATHER:
        z_rows = z_ptr + (group // experts).to(tl.int64) * stride_zh + src * stride_zt
    else:
        z_rows = z_ptr + src
    n0 = (tl.program_id(0) % N_BLOCKS) * BLOCK_N
    kk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a = tl.load(z_rows[:, None] + (k0 + kk)[None, :], mask=rmask[:, None], other=0.0)
        bg = wg_desc.load([group * D + k0, n0])
        bu = wu_desc.load([group * D + k0, n0])
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
    g = tl.minimum(acc_g, LIMIT)
    s = 1.0 / (1.0 + tl.exp(-(g * ALPHA)))
    u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT) + 1.0
    act = g * s * u
    h_desc.store([row0, n0], act.to(h_desc.dtype))


@triton.jit
def down_kernel(
    h_desc, wd_desc, y_desc, tile_group_ptr, groups,
    F: tl.constexpr, PRECISION: tl.constexpr, N_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: tile `program_id(0) // N_BLOCKS` x columns block `program_id(0) %
    N_BLOCKS` (BLOCK_N of d). y = h W_down accumulated in fp32 over d_expert in steps of
    BLOCK_K, stored fp32 at the tile's rows of y."""
    tile = tl.program_id(0) // N_BLOCKS
    group = tl.load(tile_group_ptr + tile)
    if group >= groups:
        return
    row0 = tile * BLOCK_M
    n0 = (tl.program_id(0) % N_BLOCKS) * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        a = h_desc.load([row0, k0])
        b = wd_desc.load([group * F + k0, n0])
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    y_desc.store([row0, n0], acc)


@triton.jit
def combine_kernel(
    y_ptr, pos_ptr, w_ptr, out_ptr, n_rows,
    D: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[r] = sum_j w[r, j] * y[pos[r, j]] over the k routes in their stored (ascending
    expert) order, fp32, rounded to out's dtype. y: `[P, D]` fp32 padded route rows; pos,
    w: `[rows, k]` int64 row of each route in y / fp32 weight."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (cols < D)[None, :]
    route = rows.to(tl.int64) * TOP_K
    w = tl.load(w_ptr + route, mask=rmask, other=0.0)
    src = tl.load(pos_ptr + route, mask=rmask, other=0)
    out = tl.load(y_ptr + src[:, None] * D + cols[None, :], mask=mask, other=0.0) * w[:, None]
    for j in tl.static_range(1, TOP_K):
        w = tl.load(w_ptr + route + j, mask=rmask, other=0.0)
        src = tl.load(pos_ptr + route + j, mask=rmask, other=0)
        y = tl.load(y_ptr + src[:, None] * D + cols[None, :], mask=mask, other=0.0)
        out = out + y * w[:, None]
    dst = out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def expert_tile_kernel(
    z_ptr, src_ptr, tile_group_ptr, tile_rows_ptr, wg_desc, wu_desc, wd_desc, y_desc, groups,
    experts, stride_zt, stride_zh,
    D: tl.constexpr, F: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    PRECISION: tl.constexpr, ROW_GATHER: tl.constexpr, N_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The fused expert tile: one program computes tile `program_id(0) // N_BLOCKS` (BLOCK_M
    padded rows of one (head, expert) group) x output columns block `program_id(0) %
    N_BLOCKS` (BLOCK_N of d) of `y = SwiGLU7(z W_gate, z W_up) W_down` without writing the
    hidden rows: d_expert is walked in chunks of BLOCK_F from 0; per chunk the gate / up
    sums run over d in steps of BLOCK_K from 0 (fp32), SwiGLU7 in fp32, the chunk rounded to
    z's dtype and multiplied into the fp32 output accumulator. The z rows are gathered as
    in `gate_up_kernel` (rows past `tile_rows` load zeros). With BLOCK_F equal to the
    two-kernel path's `down_k`, every element sees the same sums in the same order as
    `gate_up_kernel` + `down_kernel`. y: fp32 padded rows, stored at the tile's rows."""
    tile = tl.program_id(0) // N_BLOCKS
    group = tl.load(tile_group_ptr + tile)
    if group >= groups:  # beyond the last tile of the schedule's upper bound
        return
    local = tl.arange(0, BLOCK_M)
    rmask = local < tl.load(tile_rows_ptr + tile)
    row0 = tile * BLOCK_M
    src = tl.load(src_ptr + row0 + local, mask=rmask, other=0)
    if ROW_GATHER:
        z_rows = z_ptr + (group // experts).to(tl.int64) * stride_zh + src * stride_zt
    else:
        z_rows = z_ptr + src
    n0 = (tl.program_id(0) % N_BLOCKS) * BLOCK_N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        acc_g = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            a = tl.load(z_rows[:, None] + (k0 + kk)[None, :], mask=rmask[:, None], other=0.0)
            acc_g = tl.dot(a, wg_desc.load([group * D + k0, f0]), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, wu_desc.load([group * D + k0, f0]), acc_u, input_precision=PRECISION)
        g = tl.minimum(acc_g, LIMIT)
        s = 1.0 / (1.0 + tl.exp(-(g * ALPHA)))
        act = (g * s * (tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT) + 1.0)).to(z_ptr.dtype.element_ty)
        acc = tl.dot(act, wd_desc.load([group * F + f0, n0]), acc, input_precision=PRECISION)
    y_desc.store([row0, n0], acc)
