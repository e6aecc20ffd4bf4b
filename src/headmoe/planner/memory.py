"""Per-rank memory estimate of one `generate` run, and the limit it must fit.

    est = estimate_memory(model, request, parallel, dtype, rank_count=world)
    limit = memory_limit(local_ranks, cuda=False)        # or --max-memory-gib
    check_fits(est, limit, ...)                          # ValueError with both numbers

The estimate is deliberately simple and on the high side (a bound, not a prediction):

- weights: `weight_bytes` of the busiest EP rank (exact: the modules as built), plus the
  loader's host batch (at most 1 GiB) while the checkpoint streams in; with layer streaming
  (`StreamSettings`, `--offload-layers`) the weights outside the layers, the resident layers
  and the slots instead (`stream_estimate`; `stream_host_bytes` for the host side);
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

from headmoe.config import GIB, ParallelConfig
from headmoe.distributed.sharding import head_shard
from headmoe.distributed.topology import Topology
from headmoe.models.magi2.config import Magi2Config
from headmoe.models.magi2.loading import LOAD_BATCH_BYTES
from headmoe.models.streaming import DEFAULT_SLOTS, check_slots, split_layers
from headmoe.moe.formats import DEFAULT_EXPERT_FORMAT
from headmoe.planner.predict import (
    expert_bytes_per_head,
    layer_bytes,
    layout_topology,
    sequence_counts,
    weight_bytes,
)
from headmoe.planner.request import RequestShape

#: live copies of the state / MLP activations / attention tensors in one layer (bounds)
STATE_COPIES, MLP_COPIES, ATTENTION_COPIES = 6, 3, 6


#: host-to-device bandwidth per GPU the streaming step-time bound assumes by default, GB/s
#: (about what pinned copies reach over PCIe Gen5 x16, of 64 GB/s theoretical)
DEFAULT_H2D_GBPS = 25.0


@dataclass(frozen=True)
class StreamSettings:
    """`--offload-layers`: the first `resident_layers` layers stay on the device, the others
    stream through `slots` slot buffers (`headmoe.models.streaming`)."""

    resident_layers: int = 0
    slots: int = DEFAULT_SLOTS

    def __post_init__(self) -> None:
        check_slots(self.slots)


@dataclass(frozen=True)
class StreamEstimate:
    """Layer streaming on one rank: device bytes of the weights outside the layers, of the
    resident layers and of the slots (weights in flight); bytes moved per denoising step
    (one forward); pinned host staging (CUDA: one host slot per device slot)."""

    slots: int
    resident_layers: int
    streamed_layers: int
    non_layer_bytes: int
    resident_bytes: int
    in_flight_bytes: int
    bytes_per_step: int
    pinned_bytes: int

    @property
    def device_weight_bytes(self) -> int:
        return self.non_layer_bytes + self.resident_bytes + self.in_flight_bytes

    def step_time_s(self, h2d_gbps: float) -> float:
        """Lower bound of one step's time: its bytes at `h2d_gbps` GB/s."""
        return self.bytes_per_step / (h2d_gbps * 1e9)


def stream_estimate(model: Magi2Config, ep_size: int, ep_rank: int, dtype: torch.dtype,
                    settings: StreamSettings, experts: str = DEFAULT_EXPERT_FORMAT
                    ) -> StreamEstimate:
    """`StreamEstimate` of EP rank `ep_rank` of `ep_size`, the routed experts in format
    `experts` (exact: the modules as built and the streamer's slot rule). Raises
    `ValueError` naming `resident_layers`."""
    resident, streamed = split_layers(model.num_layers, settings.resident_layers)
    per_layer = layer_bytes(model, ep_size, ep_rank, dtype, experts)
    layers = sum(b for b, _ in per_layer)
    slot = max((per_layer[i][1] for i in streamed), default=0)
    slots = min(settings.slots, len(streamed)) * slot
    moved = sum(per_layer[i][0] for i in streamed) if len(streamed) > settings.slots else 0
    return StreamEstimate(
        settings.slots, len(resident), len(streamed),
        weight_bytes(model, ep_size, ep_rank, dtype, experts)[1] - layers,
        sum(per_layer[i][0] for i in resident), slots, moved, slots)


def streamed_counts(model: Magi2Config, ep_size: int, ep_rank: int, dtype: torch.dtype,
                    settings: StreamSettings, forwards: int,
                    experts: str = DEFAULT_EXPERT_FORMAT) -> list[int]:
    """The bytes `Counters.record_stream` records on EP rank `ep_rank` over `forwards`
    forwards, one entry per streamed layer run on a fresh fill: every streamed layer every
    forward, or the first forward only when the slots hold every streamed layer."""
    _, streamed = split_layers(model.num_layers, settings.resident_layers)
    per_layer = layer_bytes(model, ep_size, ep_rank, dtype, experts)
    once = [per_layer[i][0] for i in streamed]
    return once * (forwards if len(streamed) > settings.slots else min(forwards, 1))


def busiest_stream(model: Magi2Config, parallel: ParallelConfig, dtype: torch.dtype,
                   settings: StreamSettings, experts: str = DEFAULT_EXPERT_FORMAT
                   ) -> StreamEstimate:
    """The `StreamEstimate` of the EP rank with the most device weight bytes."""
    ep = parallel.resolved_expert_parallel_size()
    return max((stream_estimate(model, ep, r, dtype, settings, experts) for r in range(ep)),
               key=lambda s: (s.device_weight_bytes, s.bytes_per_step))


def stream_host_bytes(model: Magi2Config, parallel: ParallelConfig, dtype: torch.dtype,
                      settings: StreamSettings, ranks_per_node: int,
                      experts: str = DEFAULT_EXPERT_FORMAT) -> int:
    """Host bytes the busiest node needs to stream without reading the disk each step: the
    streamed layers' checkpoint bytes its ranks read, once (the page cache of the mapped
    files is shared by the node's ranks: dense weights once, the expert rows of every head
    any of its ranks holds once), plus each rank's pinned host slots. `experts`: the
    routed experts' format, stored so in the checkpoint (streaming FP8 experts reads an FP8
    checkpoint, `headmoe.deployment.check_expert_stream`)."""
    topo = layout_topology(model, parallel)
    stored = model.torch_params_dtype
    _, streamed = split_layers(model.num_layers, settings.resident_layers)
    per_layer = layer_bytes(model, 1, 0, stored, experts)
    per_head = expert_bytes_per_head(model, stored, experts)
    heads = model.moe_num_heads
    dense = sum(per_layer[i][0] for i in streamed) - per_head * heads * sum(
        i in model.moe_layer_ids for i in streamed)
    moe_streamed = sum(i in model.moe_layer_ids for i in streamed)
    pinned = busiest_stream(model, parallel, dtype, settings, experts).pinned_bytes
    worst = 0
    for first in range(0, topo.world_size, ranks_per_node):
        ranks = range(first, min(first + ranks_per_node, topo.world_size))
        held = _node_heads(model, topo, ranks)
        worst = max(worst, dense + per_head * held * moe_streamed + pinned * len(ranks))
    return worst


def _node_heads(model: Magi2Config, topo: Topology, ranks: range) -> int:
    """Real MoE heads held by at least one of `ranks`."""
    e = topo.expert_parallel_size
    held = set()
    for r in ranks:
        shard = head_shard(model.moe_num_heads, e, topo.coords(r).ep)
        held.update(range(shard.first, shard.stop))
    return len(held)


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
    stream: StreamSettings | None = None, experts: str = DEFAULT_EXPERT_FORMAT,
) -> MemoryEstimate:
    """The busiest rank's `MemoryEstimate` for `request` under `parallel` (`frames`:
    (num_frames, height, width) of the decoded clip; `audio_samples` of the waveform;
    `stream`: the layers stream, weights = `busiest_stream(...).device_weight_bytes`;
    `experts`: the routed experts' format, `headmoe.moe.formats.EXPERT_FORMATS`)."""
    ep = parallel.resolved_expert_parallel_size()
    if stream is not None:
        weights = busiest_stream(model, parallel, dtype, stream, experts).device_weight_bytes
    else:
        weights = max(weight_bytes(model, ep, r, dtype, experts)[1] for r in range(ep))
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
    decode = decoded_video_bytes(*frames) + audio_samples * 4 * 3
    return MemoryEstimate(weights + load, acts, work, decode)


def decoded_video_bytes(frames: int, height: int, width: int) -> int:
    """Bytes of decoding a clip of ``frames`` x ``height`` x ``width`` RGB pixels on its
    writer: the fp32 pixels, their permuted fp32 copy and the uint8 frames (9 bytes per
    pixel channel). The preview's and the refiner's decode estimates both use it."""
    return frames * height * width * 3 * (4 + 4 + 1)


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
