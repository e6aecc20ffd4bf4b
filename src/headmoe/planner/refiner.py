"""Per-rank work and memory of the 1080p refiner stage (REFINER.md section 10), from the
refiner's own rules (its config, `BlockGrid`, the MLP chunking, the Ulysses split).

Attention pairs are counted without building the mask: a block's rows and its visible
video keys are products of per-axis sizes (blocks are boxes and visibility is a box of
blocks), so the video-video pairs are the product over t, h, w of
`sum_b size_b * sum_{b' within radius of b} size_b'`; text adds `2 Nv Lt + Lt^2`. At
1080p (63 x 68 x 120 latents) that is 6,200,193,024 video pairs, 12,060.8 video keys per
video query, 6.727e9 pairs with 512 text tokens (golden `release.p1080`, which ran the
release's own range builder).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from headmoe.config import ParallelConfig
from headmoe.distributed.sharding import sp_heads, sp_kv_heads, sp_token_counts
from headmoe.models.refiner import MLP_CHUNK_ROWS, Magi2RefinerConfig, refiner_weight_bytes
from headmoe.pipeline.latents import frame_count
from headmoe.planner.memory import MemoryEstimate, decoded_video_bytes

#: live fp32 copies of the residual-width tensors in one layer (residual, norm output,
#: attention branch, gated output) and of one MLP chunk's [rows, 2I] (up_gate output, its
#: gate / linear halves, the activation): bounds
RESIDUAL_COPIES, MLP_CHUNK_COPIES = 4, 3


def axis_pairs(size: int, block: int, radius: int) -> int:
    """`sum_b n_b * sum_{|b' - b| <= radius} n_b'` over the blocks of one axis (n_b the
    block's length: `block`, the last one cut short)."""
    n = [min(block, size - s) for s in range(0, size, block)]
    return sum(nb * sum(n[max(0, b - radius) : b + radius + 1]) for b, nb in enumerate(n))


@dataclass(frozen=True)
class RefinerWork:
    """One refiner forward: `tokens` = video + text rows; attended (query, key) `pairs` per
    head and layer; `video_keys_per_query` (mean); FLOP per forward of the linears and of
    attention (all heads and layers)."""

    video_tokens: int
    text_tokens: int
    video_pairs: int
    pairs: int
    linear_flop: float
    attention_flop: float

    @property
    def tokens(self) -> int:
        return self.video_tokens + self.text_tokens

    @property
    def video_keys_per_query(self) -> float:
        return self.video_pairs / self.video_tokens

    @property
    def flop(self) -> float:
        return self.linear_flop + self.attention_flop

    @property
    def dense_fraction(self) -> float:
        """Attended pairs over the pairs of dense attention."""
        return self.pairs / self.tokens ** 2


def refiner_work(config: Magi2RefinerConfig, thw: tuple[int, int, int],
                 text_tokens: int) -> RefinerWork:
    """`RefinerWork` of one forward over a `thw` latent and `text_tokens` text rows."""
    video = math.prod(thw)
    vv = math.prod(axis_pairs(n, b, r) for n, b, r in zip(thw, config.block_size, config.radius))
    pairs = vv + 2 * video * text_tokens + text_tokens ** 2
    c, d, hq = config.hidden_size, config.head_dim, config.num_attention_heads
    macs = c * (config.qkv_width + hq + c + 2 * config.intermediate_size) \
        + config.intermediate_size * c  # qkv, gate, proj, up_gate, down per token and layer
    tokens = video + text_tokens
    return RefinerWork(video, text_tokens, vv, pairs, 2.0 * macs * tokens * config.num_layers,
                       4.0 * d * hq * pairs * config.num_layers)


@dataclass(frozen=True)
class RefinerMemory:
    """Bytes of the refiner stage on the busiest rank: weights (0 while offloaded to the
    host), activations of one layer (the local rows' residual-width fp32 tensors, q/k/v of
    every row for this rank's heads in the model dtype with the Ulysses buffers, one MLP
    chunk's fp32 temporaries)."""

    weights: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.activations

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def refiner_memory(config: Magi2RefinerConfig, thw: tuple[int, int, int], text_tokens: int,
                   parallel: ParallelConfig, dtype: torch.dtype,
                   chunk_rows: int = MLP_CHUNK_ROWS) -> RefinerMemory:
    """`RefinerMemory` of one forward under `parallel` (its SP degree splits the rows)."""
    sp = parallel.ulysses_degree
    n = math.prod(thw) + text_tokens
    local = max(sp_token_counts(n, sp))
    c, d = config.hidden_size, config.head_dim
    size = torch.empty((), dtype=dtype).element_size()
    residual = local * (c + config.qkv_width) * 4 * RESIDUAL_COPIES
    heads = sp_heads(config.num_attention_heads, sp)[1]
    kv = sp_kv_heads(config.num_attention_heads, config.num_query_groups, sp)
    attention = n * (heads + 2 * kv) * d * size * (3 if sp > 1 else 1) + n * heads * d * size
    mlp = min(local, chunk_rows) * 2 * config.intermediate_size * 4 * MLP_CHUNK_COPIES
    return RefinerMemory(refiner_weight_bytes(config, dtype), residual + attention + mlp)


@dataclass(frozen=True)
class RefinerPlan:
    """The refiner stage of one layout: its SP and CFG degrees, the busiest rank's memory,
    the forwards each rank runs per clip (2 per step, split over CFG) and their FLOP."""

    ulysses_degree: int
    cfg_parallel_size: int
    memory: RefinerMemory
    forwards_per_rank: int
    flop_per_rank: float

    def to_dict(self) -> dict[str, object]:
        return {"ulysses_degree": self.ulysses_degree,
                "cfg_parallel_size": self.cfg_parallel_size, "memory": self.memory.to_dict(),
                "forwards_per_rank": self.forwards_per_rank, "flop_per_rank": self.flop_per_rank}


def plan_refiner(config: Magi2RefinerConfig, thw: tuple[int, int, int], text_tokens: int,
                 layouts: list[ParallelConfig], dtype: torch.dtype, steps: int
                 ) -> tuple[RefinerWork, list[RefinerPlan]]:
    """The work of one forward and one `RefinerPlan` per distinct (SP, CFG) of `layouts`
    (layouts whose SP degree does not divide the refiner's query heads are left out)."""
    work = refiner_work(config, thw, text_tokens)
    plans, seen = [], set()
    for p in layouts:
        key = (p.ulysses_degree, p.cfg_parallel_size)
        if key in seen or config.num_attention_heads % p.ulysses_degree:
            continue
        seen.add(key)
        forwards = 2 * steps // p.cfg_parallel_size
        plans.append(RefinerPlan(*key, refiner_memory(config, thw, text_tokens, p, dtype),
                                 forwards, forwards * work.flop / p.ulysses_degree))
    return work, plans


def stage_estimate(config: Magi2RefinerConfig, stage: Any, thw: tuple[int, int, int],
                   text_tokens: int, parallel: ParallelConfig, dtype: torch.dtype,
                   preview: MemoryEstimate, offload: bool) -> MemoryEstimate:
    """The busiest phase of a request with a refiner `stage` (a `RefinerStage`), per rank:
    the preview (`preview`, its estimate) with the refiner's weights beside it, or the
    refiner stage with the preview's weights and the decode of the refined clip (fp32
    pixels, their permuted copy, uint8 frames). With `offload` the idle stage's weights live
    on the host."""
    ref = refiner_memory(config, thw, text_tokens, parallel, dtype)
    idle = 0 if offload else 1
    frames = decoded_video_bytes(frame_count(thw[0]), stage.height, stage.width)
    return max(
        MemoryEstimate(preview.weights + idle * ref.weights, preview.activations,
                       preview.workspace, preview.decode),
        MemoryEstimate(ref.weights + idle * preview.weights, ref.activations, 0, frames),
        key=lambda e: e.total)
