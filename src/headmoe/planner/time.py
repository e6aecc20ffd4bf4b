"""The time estimate of a request (`admission.admit` prints it and checks ``--max-time``).

A step is two transformer forwards (the CFG branches) over the request's tokens. Per
forward: ``2 x active parameters x tokens`` for the linears (a token uses ``top_k`` of each
MoE head's experts) plus ``4 x tokens^2 x hidden`` per layer for attention; a layout
divides it over SP x CFG (every rank of a DP group does its share). The rate is a FLOP
rate per rank: ``CPU_FLOPS_PER_THREAD`` x the rank's torch threads on a CPU, ``CUDA_FLOPS``
on a GPU, plus a fixed cost per step (exchanges, sampler, Python). The refiner stage adds
its own forwards (`headmoe.planner.refiner.refiner_work`). Rough by design (within a few
x): it says "hours" before a rank starts, it is no benchmark (docs/benchmarks.md section 12
compares it with measured steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from headmoe.config import ParallelConfig
from headmoe.models.magi2.loading import MOE_MARKER, checkpoint_spec
from headmoe.moe.weights import Bf16Experts

#: effective fp32 GEMM rate of one CPU thread (AVX2/AVX-512 server core, batch-invariant
#: kernels), FLOP/s
CPU_FLOPS_PER_THREAD = 2.0e10
#: effective bf16 rate of one GPU (about 40% of an H100's dense peak), FLOP/s
CUDA_FLOPS = 4.0e14
#: fixed cost of a step beyond its FLOPs (exchanges, sampler, Python), s: CPU (the tiny
#: release's step on one core) and GPU
STEP_OVERHEAD_S = {"cpu": 0.3, "cuda": 0.05}
#: checkpoint name endings of the routed experts' weights (a token uses top_k of each
#: head's experts): the released format's tensors under the MoE module
_EXPERT_WEIGHTS = tuple(MOE_MARKER + n for n in Bf16Experts.NAMES)


@lru_cache(maxsize=16)
def active_parameters(config) -> int:
    """Parameters one token's forward multiplies by: all but the routed experts it skips."""
    total = experts = 0
    for name, (shape, _) in checkpoint_spec(config).items():
        n = torch.Size(shape).numel()
        total += n
        experts += n if name.endswith(tuple(w + s for w in _EXPERT_WEIGHTS
                                           for s in ("", ".weight"))) else 0
    return int(total - experts * (1 - config.moe_top_k / config.moe_num_experts))


def forward_flop(config, tokens: int) -> float:
    """FLOPs of one forward over ``tokens`` tokens (one branch)."""
    return (2.0 * active_parameters(config) * tokens
            + 4.0 * tokens * tokens * config.hidden_size * config.num_layers)


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds of the denoising (and refiner) steps on the busiest rank, and the rate."""

    seconds: float
    flop_per_rank: float
    rate: float
    device: str

    def describe(self) -> str:
        """``~22 h 10 min`` style."""
        return f"~{format_seconds(self.seconds)}"


def format_seconds(s: float) -> str:
    """``45 s``, ``12 min``, ``3 h 05 min``."""
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def rank_rate(device: str, threads: int) -> float:
    """FLOP/s of one rank on ``device`` ("cpu": ``threads`` torch threads)."""
    return CUDA_FLOPS if device == "cuda" else CPU_FLOPS_PER_THREAD * max(1, threads)


def estimate_time(config, branch_tokens: tuple[int, int], parallel: ParallelConfig,
                  steps: int, device: str, threads: int, extra_flop: float = 0.0,
                  extra_steps: int = 0) -> TimeEstimate:
    """The estimate of ``steps`` steps over branches of ``branch_tokens`` tokens, on ranks
    of ``parallel`` (``extra_flop``: the refiner stage's FLOPs, over ``extra_steps``)."""
    share = parallel.ulysses_degree * parallel.cfg_parallel_size
    flop = steps * sum(forward_flop(config, t) for t in branch_tokens) / share
    flop += extra_flop / share
    rate = rank_rate(device, threads)
    seconds = flop / rate + (steps + extra_steps) * STEP_OVERHEAD_S.get(device, 0.3)
    return TimeEstimate(seconds, flop, rate, device)
