"""Block-sparse range attention on the GPU: a Triton flash-attention kernel over the
query tiles and key ranges of a `headmoe.layers.range_plan.RangePlan`, GQA by index.

Maths (same as `range_attention_reference`): for query head j and KV head
`j // (Hq / Hkv)`, each query row of tile r gets `softmax(q.k * scale) v` over the keys of
the tile's ranges. Online softmax in fp32 (exp2 of logits pre-scaled by log2 e), operands
in q's dtype (bf16/fp16, or fp32 with IEEE products), probabilities rounded to v's dtype
for the PV product, output in q's dtype. Agrees with the CPU path within rounding, not bit
for bit. One program per (tile, query head); a tile holds at most `block_m` rows (the
refiner's 8x4x4 video blocks are 128 rows: one block per program).

What is invariant (bits):
- a query row's output does not depend on the other rows of its tile or the other tiles
  (each program owns its rows; keys are visited range by range in the listed order, each
  range in blocks of `block_n` from its first key);
- nor on which other heads share the call (one program per head), so Ulysses head shards
  give the same rows as one rank;
- nor on the tile's place in the sequence beyond its key ranges.
What is not: the result changes with the plan (ranges, their order), the dtype, the tile
constants, the GPU architecture and triton/CUDA versions; it is not bit-equal to the CPU
path.
"""

from __future__ import annotations

import dataclasses

import torch

from headmoe.layers import triton_attention
from headmoe.layers.range_plan import RangePlan
from headmoe.layers.triton_runtime import KERNEL_FLOATS, check_tensors, check_tile_sizes, kernels


@dataclasses.dataclass(frozen=True)
class RangeTiles:
    """block_m: the most query rows of one tile (a plan's tiles must not be longer);
    block_n: keys per step; num_warps/num_stages: CUDA launch options."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        check_tile_sizes(self, ("block_m", "block_n"))


DEFAULT_RANGE_TILES = RangeTiles()


#: whether the kernel takes a head dim: the same rule as the sink attention kernel's
supported = triton_attention.supported


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RangePlan,
                tiles: RangeTiles) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in KERNEL_FLOATS:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(f"{name} must be a float [N, heads, D] tensor, got {got}")
    n, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d:
        raise ValueError(f"k and v must both be [{n}, Hkv, {d}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must be {q.dtype} like q, got {k.dtype} and {v.dtype}")
    if hq % k.shape[1]:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({k.shape[1]})")
    if not supported(d):
        raise ValueError(f"head dim D must be a power of two >= 16, got {d}")
    if plan.num_tokens != n:
        raise ValueError(f"plan.num_tokens={plan.num_tokens} must equal q rows {n}")
    longest = int((plan.q_tiles[:, 1] - plan.q_tiles[:, 0]).max()) if len(plan.q_tiles) else 0
    if longest > tiles.block_m:
        raise ValueError(f"plan has a query tile of {longest} rows, more than "
                         f"tiles.block_m={tiles.block_m}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when each head's D values are contiguous, else a contiguous copy."""
    return t if t.stride(2) == 1 else t.contiguous()


def triton_range_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RangePlan, scale: float,
    tiles: RangeTiles = DEFAULT_RANGE_TILES,
) -> torch.Tensor:  # fmt: skip
    """q `[N, Hq, D]`, k/v `[N, Hkv, D]` (Hkv dividing Hq), same dtype, D a power of two
    >= 16; `plan` with tiles of at most `tiles.block_m` rows. Returns `[N, Hq, D]` in q's
    dtype. Raises `ValueError` naming the bad argument."""
    kern = kernels("headmoe.layers.triton_range_attention_kernels")
    log2e = kernels(triton_attention.KERNELS).LOG2E.value
    _check_args(q, k, v, plan, tiles)
    check_tensors(kern.range_attention_kernel, q=q, k=k, v=v)
    q, k, v = _rows(q), _rows(k), _rows(v)
    n, hq, d = q.shape
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0 or len(plan.q_tiles) == 0:
        return out
    dev = q.device
    q_tiles = plan.q_tiles.to(dev, torch.int64).contiguous()
    k_offsets = plan.k_offsets.to(dev, torch.int64).contiguous()
    k_ranges = plan.k_ranges.to(dev, torch.int64).contiguous()
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    kern.range_attention_kernel[(len(plan.q_tiles), hq)](
        q, k, v, out, q_tiles, k_offsets, k_ranges,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), float(scale) * log2e,
        GROUP=hq // k.shape[1], HEAD_DIM=d, PRECISION=prec, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
