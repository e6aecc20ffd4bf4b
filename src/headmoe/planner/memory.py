"""Per-rank memory estimate of one `generate` run, and the limit it must fit.

    est = estimate_memory(model, request, parallel, dtype, rank_count=world)
    limit = memory_limit(local_ranks, cuda=False)        # or --max-memory-gib
    check_fits(est, limit, ...)                          # ValueError with both numbers

The estimate is deliberately simple and on the high side (a bound, not a prediction):

- weights: `weight_bytes` of the busiest EP rank (exact: the modules as built), plus the
  loader's host batch (at most 1 GiB) while the checkpoint streams in;
- activations of one layer at the request's size: the state `[T_local, n, C]` with its mHC
  copies, the dense/MoE MLP intermediates of the local rows, and attention over the full
  sequence for this rank's heads (q, k, v widened to fp32 plus their head-major copies);
- workspace: the Ulysses / MoE exchange send and receive buffers (SP > 1);
- decode (the writer rank, on the host): the fp32 pixels, their permuted copy and the uint8
  frames, plus the audio waveform.

Attention itself runs through SDPA's fused kernels (no `[L, L]` score matrix), so the
estimate has no quadratic term.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from headmoe.config import ParallelConfig
from headmoe.models.magi2.config import Magi2Config
from headmoe.planner.predict import sequence_counts, weight_bytes
from headmoe.planner.request import RequestShape

GIB = 1 << 30
LOAD_BATCH_BYTES = 1 << 30
#: live copies of the state / MLP activations / attention tensors in one layer (bounds)
STATE_COPIES, MLP_COPIES, ATTENTION_COPIES = 6, 3, 6


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs (the busiest), by part."""

    weights: int
    activations: int
    workspace: int
    decode: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.workspace + self.decode

    def describe(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / GIB:.2f}"
                          for k in ("weights", "activations", "workspace", "decode"))
        return f"{self.total / GIB:.2f} GiB per rank ({parts})"


def _activation_bytes(model: Magi2Config, local: int, full: int, heads: int) -> int:
    state = local * model.mhc_width * 4 * STATE_COPIES
    widest = max(2 * model.dense_intermediate_size, model.hidden_size * 2,
                 2 * model.shared_expert_intermediate_size
                 + 2 * model.modality_shared_expert_intermediate_size
                 + model.moe_top_k * 2 * model.moe_expert_intermediate_size)
    mlp = local * widest * 4 * MLP_COPIES
    attention = full * heads * model.head_dim * 4 * 3 * ATTENTION_COPIES
    return state + mlp + attention


def estimate_memory(
    model: Magi2Config, request: RequestShape, parallel: ParallelConfig, dtype: torch.dtype,
    frames: tuple[int, int, int] = (0, 0, 0), audio_samples: int = 0,
) -> MemoryEstimate:
    """The busiest rank's `MemoryEstimate` for `request` under `parallel` (`frames`:
    (num_frames, height, width) of the decoded clip; `audio_samples` of the waveform)."""
    ep = parallel.resolved_expert_parallel_size()
    weights = max(weight_bytes(model, ep, r, dtype)[1] for r in range(ep))
    load = min(LOAD_BATCH_BYTES, weights)
    sp = parallel.ulysses_degree
    acts = work = 0
    for cfg_rank in range(parallel.cfg_parallel_size):
        counts = sequence_counts(request, parallel, cfg_rank)
        full, local = sum(counts), max(counts)
        heads = math.ceil(model.num_attention_heads / sp)
        acts = max(acts, _activation_bytes(model, local, full, heads))
        if sp > 1:
            nbytes = torch.empty((), dtype=dtype).element_size()
            qkv = full * heads * 3 * model.head_dim * nbytes
            moe = local * model.moe_hidden_size * nbytes * sp
            work = max(work, 2 * (qkv + moe))
    f, h, w = frames
    decode = f * h * w * 3 * (4 + 4 + 1) + audio_samples * 4 * 3
    return MemoryEstimate(weights + load, acts, work, decode)


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def memory_limit(local_ranks: int, cuda: bool) -> tuple[int | None, str]:
    """(bytes one rank may use, where that number comes from): the free memory of the
    current CUDA device, or the host's available memory shared by `local_ranks` ranks."""
    if cuda:
        try:
            free, _ = torch.cuda.mem_get_info()
        except (RuntimeError, AssertionError):  # no usable device: not checked
            return None, "unknown"
        return free, "free memory of the CUDA device"
    avail = host_available_bytes()
    if avail is None:
        return None, "unknown"
    where = "available host memory" + (f" / {local_ranks} local ranks" if local_ranks > 1 else "")
    return avail // max(local_ranks, 1), where


def check_fits(est: MemoryEstimate, limit: int | None, source: str, what: str) -> None:
    """Raise `ValueError` when `est` exceeds `limit` bytes (None: unknown, not checked)."""
    if limit is None or est.total <= limit:
        return
    raise ValueError(
        f"{what} needs an estimated {est.describe()}, more than the {limit / GIB:.2f} GiB "
        f"limit ({source}), use a smaller request, more ranks, or --max-memory-gib to "
        "override the limit"
    )
