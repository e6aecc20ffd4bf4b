"""Triton kernel of the sink attention GPU path (imported lazily by
`headmoe.layers.triton_attention`, which documents shapes and the invariance argument).
Importing this module imports triton; TRITON_INTERPRET is read at import."""

from __future__ import annotations

import triton
import triton.language as tl

#: log2(e): the kernel works with exp2 (a constexpr, so the kernel can read it; the host
#: side reads `LOG2E.value`)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _key_block(q, k_desc, v_desc, n0, col, len_k, qk_scale, m_i, l_i, acc,
               PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One online-softmax step over keys `[n0, n0 + BLOCK_N)` (`col` = kv head * D): returns
    the new running max, denominator and accumulator. MASKED: keys past `len_k` get -inf
    (only the last, partial block needs it). The accumulator is rescaled only when some
    row's max moved: otherwise every factor is exp2(0) = 1 and the product would give the
    same bits."""
    k = k_desc.load([n0, col])
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        s = tl.where((n0 + tl.arange(0, BLOCK_N) < len_k)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if tl.max(m_new - m_i, axis=0) > 0:
        acc = acc * alpha[:, None]
    v = v_desc.load([n0, col])
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def sink_attention_kernel(
    q_desc, k_desc, v_desc, o_desc, sinks_ptr, len_k, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of query head `program_id(1)` against every key of the
    segment (KV head = query head // GROUP), in key blocks of BLOCK_N from key 0 upwards
    (`_key_block`; the key mask on the last, partial block only). q/k/v/o are `[L, heads*D]`
    descriptors (blocks `[rows, D]` at column head*D; rows past the end load zeros and are
    not stored). Online softmax in fp32 in base 2 (qk_scale = scale * log2 e); the sink
    logit joins the running max and the denominator at the end with a zero value."""
    hq = tl.program_id(1)
    col = (hq // GROUP) * HEAD_DIM
    m0 = tl.program_id(0) * BLOCK_M
    q = q_desc.load([m0, hq * HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full = (len_k // BLOCK_N) * BLOCK_N
    for n0 in range(0, full, BLOCK_N):
        m_i, l_i, acc = _key_block(q, k_desc, v_desc, n0, col, len_k, qk_scale, m_i, l_i,
                                   acc, PRECISION, BLOCK_N, False)
    if full < len_k:
        m_i, l_i, acc = _key_block(q, k_desc, v_desc, full, col, len_k, qk_scale, m_i, l_i,
                                   acc, PRECISION, BLOCK_N, True)
    sink = tl.load(sinks_ptr + hq) * LOG2E
    m_f = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_f)
    denom = l_i * alpha + tl.exp2(sink - m_f)
    out = acc * (alpha / denom)[:, None]
    o_desc.store([m0, hq * HEAD_DIM], out.to(o_desc.dtype))
