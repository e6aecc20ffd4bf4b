"""Triton kernel of the sink attention GPU path (imported lazily by
`headmoe.layers.triton_attention`, which documents shapes and the invariance argument).
Importing this module imports triton; TRITON_INTERPRET is read at import."""

from __future__ import annotations

import triton
import triton.language as tl

#: log2(e): the kernel works with exp2
LOG2E = 1.4426950408889634


@triton.jit
def sink_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, sinks_ptr, len_q, len_k, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
    so_t, so_h, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of query head `program_id(1)` against every key of the
    segment (KV head = query head // GROUP), in key blocks of BLOCK_N from key 0 upwards.
    Online softmax in fp32 in base 2 (qk_scale = scale * log2 e); the sink logit joins the
    running max and the denominator at the end with a zero value."""
    hq = tl.program_id(1)
    hk = hq // GROUP
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < len_q
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * sq_t + hq * sq_h + dims[None, :],
                mask=rmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(0, len_k, BLOCK_N):
        keys = n0 + cols
        kmask = keys < len_k
        kt = tl.load(k_ptr + keys.to(tl.int64)[None, :] * sk_t + hk * sk_h + dims[:, None],
                     mask=kmask[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + keys.to(tl.int64)[:, None] * sv_t + hk * sv_h + dims[None, :],
                    mask=kmask[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    sink = tl.load(sinks_ptr + hq) * 1.4426950408889634
    m_f = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_f)
    denom = l_i * alpha + tl.exp2(sink - m_f)
    out = acc * (alpha / denom)[:, None]
    dst = o_ptr + rows.to(tl.int64)[:, None] * so_t + hq * so_h + dims[None, :]
    tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
