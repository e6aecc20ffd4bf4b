"""Attention with a learned per-head sink logit, one call per packed segment.

The sink acts as one extra key with logit `sigma_h` and a zero value: the output equals
softmax attention rescaled by `exp(lse - logaddexp(lse, sigma_h))`. It is computed inside
`scaled_dot_product_attention` by appending a zero key/value and giving that key an additive
fp32 mask equal to `sigma_h` (q . 0 = 0, so its logit is exactly sigma_h). Measured with
torch 2.13: SDPA over a subset of heads gives the same bits as over all heads, but a packed
sequence under a block-diagonal mask does not equal per-segment calls, so every segment is
its own call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headmoe.layers import flash_attention, triton_attention, triton_runtime
from headmoe.layers.flash_attention import apply_sink

__all__ = ["apply_sink", "segment_attention", "sink_attention"]


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Full (non-causal) attention of one segment with sink logits.

    q, k, v: `[L, h, D]` (fp32 or bf16, same dtype); sinks: `[h]` fp32 sink logits of these
    heads; returns `[L, h, D]` in q's dtype. Scores, softmax and the weighted sum are
    computed in fp32 (bf16 inputs are widened exactly). On CUDA with triton installed: the
    Triton kernel (`headmoe.layers.triton_attention`: bf16 operands with fp32 accumulation
    and softmax, its own invariance contract).
    """
    if triton_runtime.use_triton(q) and triton_attention.supported(q.shape[2]):
        return triton_attention.triton_sink_attention(q, k, v, sinks, scale)
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    length, h, d = q.shape
    zeros = k.new_zeros((h, 1, d))
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()
    kh = torch.cat([k.transpose(0, 1), zeros], dim=1).unsqueeze(0).contiguous()
    vh = torch.cat([v.transpose(0, 1), zeros], dim=1).unsqueeze(0).contiguous()
    mask = torch.zeros((1, h, 1, length + 1), dtype=torch.float32, device=q.device)
    mask[0, :, 0, -1] = sinks.float()
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).to(dtype)


def segment_attention(
    qkv: torch.Tensor, segments: list[tuple[int, int]], sinks: torch.Tensor, scale: float,
    path: str = "triton",
) -> torch.Tensor:
    """Attention of each packed segment on its own.

    qkv: `[L, 3, h, D]` (q, k, v of every token of the packed sequence, in sequence order);
    segments: `(start, stop)` row ranges that cover `[0, L)` in order; sinks `[h]` fp32.
    path: "triton" (`sink_attention` per segment: the Triton kernel on CUDA, the torch
    definition on CPU) or "flash" (`headmoe.layers.flash_attention`, one varlen call with the
    sink from the LSE, where `flash_supported`; otherwise the "triton" path).
    Returns `[L, h, D]` in qkv's dtype.
    """
    if path == "flash" and flash_attention.flash_supported(qkv):
        return flash_attention.flash_segment_attention(qkv, segments, sinks, scale)
    outs = [
        sink_attention(qkv[a:b, 0], qkv[a:b, 1], qkv[a:b, 2], sinks, scale)
        for a, b in segments
        if b > a
    ]
    return torch.cat(outs, dim=0) if outs else qkv.new_zeros((0, *qkv.shape[2:]))
