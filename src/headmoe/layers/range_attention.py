"""Block-sparse attention given as query tiles and key ranges, never a dense mask.

A `RangePlan` (`headmoe.layers.range_plan`, shared with the Triton path) lists query tiles (row ranges of the sequence) and, for each tile, the key
row ranges it attends to (the union of the ranges, in the listed order). Every query row
lies in exactly one tile. The MAGI-2 refiner's block-grid rule (REFINER.md section 6)
becomes one tile per video block (keys: the runs of visible neighbour blocks plus the
text) and the text rows in tiles of `tile_rows` (keys: everything); see
`headmoe.models.refiner.attention_plan`.

Two paths compute the same function:
- CPU (and CUDA without triton): per tile, the listed keys are gathered (in the listed
  order) and one fp32 `scaled_dot_product_attention` runs over them, KV heads repeated for
  GQA. Memory is O(tile x keys), not O(N^2).
- CUDA with triton: `headmoe.layers.triton_range_attention` (one program per tile and
  query head; fp32 online softmax; GQA by index).

Layout independence: the calls depend only on the plan (the packing), never on the
layout; Ulysses SP changes only which heads a rank holds, and an SDPA call over a subset
of heads gives the same bits as over all heads (measured with torch 2.13, see
`headmoe.layers.attention`), so every layout computes the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headmoe.layers import triton_range_attention, triton_runtime
from headmoe.layers.range_plan import RangePlan


def _gather_index(ranges: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)


def range_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RangePlan, scale: float
) -> torch.Tensor:
    """The CPU path. q `[N, Hq, D]`, k/v `[N, Hkv, D]` (Hkv divides Hq; query head j reads
    KV head `j // (Hq / Hkv)`), same float dtype -> `[N, Hq, D]` in q's dtype; scores,
    softmax and the weighted sum in fp32."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    for r, (a, b) in enumerate(plan.q_tiles.tolist()):
        ranges = plan.keys_of(r)
        if len(ranges) == 1:
            kk, vv = k[ranges[0][0]:ranges[0][1]], v[ranges[0][0]:ranges[0][1]]
        else:
            idx = _gather_index(ranges, k.device)
            kk, vv = k.index_select(0, idx), v.index_select(0, idx)
        qh = q[a:b].float().transpose(0, 1)
        kh = kk.float().repeat_interleave(group, 1).transpose(0, 1)
        vh = vv.float().repeat_interleave(group, 1).transpose(0, 1)
        o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out


def range_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RangePlan, scale: float
) -> torch.Tensor:
    """Attention of every query row over its tile's key ranges (see `RangePlan`).

    q `[N, Hq, D]`, k/v `[N, Hkv, D]`, Hkv dividing Hq, same dtype (fp32 or bf16) ->
    `[N, Hq, D]` in q's dtype. On CUDA with triton: the Triton kernel (bf16 operands, fp32
    softmax; its own invariance contract); otherwise `range_attention_reference`."""
    if triton_runtime.use_triton(q) and triton_range_attention.supported(q.shape[2]):
        return triton_range_attention.triton_range_attention(q, k, v, plan, scale)
    return range_attention_reference(q, k, v, plan, scale)
