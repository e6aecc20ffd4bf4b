"""Triton kernel of the block-sparse range attention (imported lazily by
`headmoe.layers.triton_range_attention`, which documents shapes and the invariance
argument). Importing this module imports triton; TRITON_INTERPRET is read at import."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def range_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, q_tiles_ptr, k_offsets_ptr, k_ranges_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program: query tile `program_id(0)` (at most BLOCK_M rows) of query head
    `program_id(1)` (KV head = query head // GROUP) against the tile's key ranges in their
    listed order, each walked in blocks of BLOCK_N keys from its first key. Online softmax
    in fp32 in base 2 (qk_scale = scale * log2 e); masked rows and keys load zeros."""
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // GROUP
    q_start = tl.load(q_tiles_ptr + 2 * tile)
    q_end = tl.load(q_tiles_ptr + 2 * tile + 1)
    rows = q_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + hq * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    r_first = tl.load(k_offsets_ptr + tile)
    r_last = tl.load(k_offsets_ptr + tile + 1)
    for r in range(r_first, r_last):
        k_start = tl.load(k_ranges_ptr + 2 * r)
        k_end = tl.load(k_ranges_ptr + 2 * r + 1)
        for n0 in range(k_start, k_end, BLOCK_N):
            keys = n0 + cols
            key_ok = keys < k_end
            k = tl.load(k_ptr + keys[:, None] * stride_kt + hk * stride_kh + dims[None, :],
                        mask=key_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + keys[:, None] * stride_vt + hk * stride_vh + dims[None, :],
                        mask=key_ok[:, None], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + hq * stride_oh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
