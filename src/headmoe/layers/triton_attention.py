"""Sink attention on the GPU: a Triton flash-attention kernel with the sink logit folded into
the softmax denominator, GQA, one launch per packed segment.

Maths (same as `headmoe.layers.attention.sink_attention`): for query head j and KV head
`j // (Hq / Hkv)`, `out = sum_t softmax([q.k_t * scale for t in segment] + [sink_j])_t v_t`
(the sink is one more logit with a zero value). Computed as an online softmax over key
blocks in fp32 (exp2 of logits pre-scaled by log2 e), operands in q's dtype (bf16/fp16, or
fp32 with IEEE products), probabilities rounded to v's dtype for the PV product, output in
q's dtype. Agrees with the torch path within rounding, not bit for bit.

What is invariant (bits):
- a query row's output does not depend on which or how many other query rows share the
  call (each program owns its rows; keys are visited in blocks of `tiles.block_n` from the
  segment's first key, whatever the query count), so query shards and sub-batches of a
  segment give the same rows;
- nor on the segment's place in a packed sequence (pointers start at the segment), so
  CFG packing of cond+uncond equals separate calls;
- nor on which other heads share the call (one program per head, no cross-head state).
What is not: the result changes with the segment's keys (their number, order or values),
the dtype, the tile constants, the GPU architecture, triton/CUDA versions; and it is not
bit-equal to the CPU (SDPA) path.
"""

from __future__ import annotations

import dataclasses

import torch

from headmoe.layers.triton_runtime import (
    KERNEL_FLOATS,
    check_tensors,
    check_tile_sizes,
    descriptor,
    kernels,
)


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
    """Fixed tiles of the attention kernel: block_m query rows per program and block_n keys
    per step (powers of two >= 16); num_warps/num_stages: CUDA launch options (ignored by
    the interpreter). Rows compared for bits must come from calls with the same tiles."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_tile_sizes(self, ("block_m", "block_n"))


#: the production tiles (bf16, D=128, Hopper): 128 keys per step (half the steps of 64, so
#: half the per-step max / rescale work) and 2 stages; `benchmarks/compile_check.py` for
#: sm_90a: 186 registers, no spills, 163,904 of 232,448 shared bytes (3 stages: 229,464).
#: Timed against other tiles on a device by `benchmarks/gpu_check.py` section d.
DEFAULT_ATTENTION_TILES = AttentionTiles()


def supported(head_dim: int) -> bool:
    """Whether the kernel takes this head dim (a power of two >= 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


#: the module of the kernel (imported at the first call)
KERNELS = "headmoe.layers.triton_attention_kernels"


def _packed_heads(t: torch.Tensor) -> torch.Tensor:
    """t `[L, heads, D]` itself when every row holds its heads side by side (strides
    `(s, D, 1)`, s a multiple of 16 bytes: contiguous tensors and the q/k/v slices of a
    packed qkv), else a contiguous copy."""
    ok = t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0
    return t if ok and (t.stride(0) * t.element_size()) % 16 == 0 else t.contiguous()


def _head_desc(t: torch.Tensor, rows: int) -> object:
    """A TMA descriptor of t `[L, heads, D]` viewed `[L, heads*D]`, blocks `[rows, D]`."""
    length, heads, d = t.shape
    return descriptor(t, [rows, d], shape=[max(length, 1), heads * d], strides=[t.stride(0), 1])


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> None:
    """ValueError naming the first bad argument of `triton_sink_attention`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in KERNEL_FLOATS:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(f"{name} must be a float [L, heads, D] tensor, got {got}")
    lq, hq, d = q.shape
    if k.shape[1:] != v.shape[1:] or k.shape[0] != v.shape[0] or k.shape[2] != d:
        raise ValueError(f"k and v must both be [Lk, Hkv, {d}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")  # fmt: skip
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must be {q.dtype} like q, got {k.dtype} and {v.dtype}")
    if hq % k.shape[1]:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({k.shape[1]})")
    if not supported(d):
        raise ValueError(f"head dim D must be a power of two >= 16, got {d}")
    if sinks.dtype != torch.float32 or tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be fp32 [{hq}], got {tuple(sinks.shape)} {sinks.dtype}")


def triton_sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
    out: torch.Tensor | None = None, tiles: AttentionTiles = DEFAULT_ATTENTION_TILES,
) -> torch.Tensor:  # fmt: skip
    """Full (non-causal) attention of one segment with sink logits and GQA.

    q: `[Lq, Hq, D]`; k, v: `[Lk, Hkv, D]` with Hkv dividing Hq (query head j reads KV head
    `j // (Hq / Hkv)`), same dtype (bf16, fp16 or fp32); tensors whose rows do not hold
    their heads side by side are copied first (`_packed_heads`);
    sinks: `[Hq]` fp32; D a power of two >= 16. Returns `[Lq, Hq, D]` in q's dtype, written
    into `out` when given (that shape and dtype, strides `(s, D, 1)`)."""
    _check_args(q, k, v, sinks)
    kern = kernels(KERNELS)
    check_tensors(kern.sink_attention_kernel, q=q, k=k, v=v, sinks=sinks)
    q, k, v = (_packed_heads(t) for t in (q, k, v))
    lq, hq, d = q.shape
    if out is None:
        out = torch.empty((lq, hq, d), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1 or out.stride(1) != d:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with heads packed in each "
                         f"row, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")  # fmt: skip
    if lq == 0:
        return out
    if k.shape[0] == 0:
        return out.zero_()
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    bm, bn = tiles.block_m, tiles.block_n
    kern.sink_attention_kernel[(-(-lq // bm), hq)](
        _head_desc(q, bm), _head_desc(k, bn), _head_desc(v, bn), _head_desc(out, bm), sinks.contiguous(),
        k.shape[0], float(scale) * kern.LOG2E.value, GROUP=hq // k.shape[1], HEAD_DIM=d,
        PRECISION=prec, BLOCK_M=bm, BLOCK_N=bn, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


def triton_segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[tuple[int, int]],
    sinks: torch.Tensor,
    scale: float,
    tiles: AttentionTiles = DEFAULT_ATTENTION_TILES,
) -> torch.Tensor:
    """Each packed segment attends within itself: one kernel launch per segment.

    q: `[L, Hq, D]`, k, v: `[L, Hkv, D]` (packed sequence order); segments: `(start, stop)`
    host ints covering `[0, L)` in order; sinks `[Hq]` fp32. Returns `[L, Hq, D]`."""
    length = q.shape[0] if isinstance(q, torch.Tensor) else -1
    pos = 0
    for seg in segments:
        if len(seg) != 2 or seg[0] != pos or seg[1] < seg[0]:
            raise ValueError(f"segments must cover [0, {length}) in order, got {segments!r}")
        pos = seg[1]
    if pos != length:
        raise ValueError(f"segments must cover [0, {length}) in order, got {segments!r}")
    out = torch.empty((length, q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
    for a, b in segments:
        if b > a:
            triton_sink_attention(q[a:b], k[a:b], v[a:b], sinks, scale, out=out[a:b], tiles=tiles)
    return out
