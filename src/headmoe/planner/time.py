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

Where a denoising step of the same cost was measured before, the estimate uses it instead
(``source`` "measured"): every finished `generate` run and served job records the median
of its steps (the first left out when there are more than two) in `STEP_TIMES_FILE` under
the cache dir, written atomically, keyed by what sets a step's cost (`step_key`: the model
config, the layout, the device, the CPU threads, the dtype, the tokens of each branch,
layer streaming). The refiner stage is always the FLOP-rate part.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from headmoe.config import ParallelConfig
from headmoe.files import atomic_write
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
#: the measured step times' file under the cache dir, and the most entries it keeps
STEP_TIMES_FILE = "step_times.json"
MAX_STEP_ENTRIES = 256
#: how the estimate's source reads (the start-up line, the refusal, the sidecar)
MEASURED, FLOP_RATE = "measured", "FLOP rate"
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
    source: str = FLOP_RATE
    """`MEASURED` (a step of the same cost measured before) or `FLOP_RATE`."""
    key: str = ""
    """The request's `step_key` (where its measured steps are recorded)."""

    def describe(self) -> str:
        """``~22 h 10 min (measured steps)`` style."""
        how = "measured steps" if self.source == MEASURED else "FLOP-rate estimate"
        return f"~{format_seconds(self.seconds)} ({how})"


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
                  extra_steps: int = 0, measured_s: float | None = None,
                  key: str = "") -> TimeEstimate:
    """The estimate of ``steps`` steps over branches of ``branch_tokens`` tokens, on ranks
    of ``parallel`` (``extra_flop``: the refiner stage's FLOPs, over ``extra_steps``;
    ``measured_s``: a measured denoising step, used for the ``steps`` instead; ``key``:
    the request's `step_key`, kept on the estimate)."""
    share = parallel.ulysses_degree * parallel.cfg_parallel_size
    flop = steps * sum(forward_flop(config, t) for t in branch_tokens) / share
    flop += extra_flop / share
    rate = rank_rate(device, threads)
    overhead = STEP_OVERHEAD_S.get(device, 0.3)
    if measured_s is not None:
        seconds = steps * measured_s + extra_flop / share / rate + extra_steps * overhead
        return TimeEstimate(seconds, flop, rate, device, MEASURED, key)
    seconds = flop / rate + (steps + extra_steps) * overhead
    return TimeEstimate(seconds, flop, rate, device, FLOP_RATE, key)


def step_key(config, parallel: ParallelConfig, device: str, threads: int, dtype: str,
             branch_tokens: tuple[int, int], offload_layers: bool) -> str:
    """The key of a step's measured time: a digest of what sets its cost."""
    facts = {"model": dataclasses.asdict(config), "layout": parallel.to_dict(),
             "device": device, "threads": threads if device == "cpu" else None,
             "dtype": dtype, "branch_tokens": list(branch_tokens),
             "offload_layers": offload_layers}
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _entries(path: Path) -> dict[str, dict[str, float]]:
    """The file's entries; {} for a missing, unreadable or malformed file (a cache)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)
            and isinstance(v.get("s_per_step"), int | float)
            and math.isfinite(v["s_per_step"]) and v["s_per_step"] > 0}


def measured_step(cache_file: str, key: str) -> float | None:
    """The measured seconds of a step under ``key`` in ``cache_file`` ("" or none: None)."""
    if not cache_file:
        return None
    entry = _entries(Path(cache_file)).get(key)
    return None if entry is None else float(entry["s_per_step"])


def record_steps(cache_file: str, key: str, step_times: list[float]) -> float | None:
    """Record the median of ``step_times`` (s; the first left out past two) under ``key``
    in ``cache_file`` (atomic write; the oldest entries dropped past `MAX_STEP_ENTRIES`);
    returns it. Nothing for "" or no steps; a write that fails is left (a cache)."""
    times = [t for t in step_times if math.isfinite(t) and t > 0]
    if not cache_file or not key or not times:
        return None
    per_step = statistics.median(times[1:] if len(times) > 2 else times)
    path = Path(cache_file)
    entries = _entries(path)
    entries[key] = {"s_per_step": per_step, "steps": len(times), "at": time.time()}
    newest = sorted(entries, key=lambda k: entries[k].get("at", 0.0))[-MAX_STEP_ENTRIES:]
    text = json.dumps({k: entries[k] for k in newest}, indent=1, sort_keys=True)
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    except OSError:
        return None
    return per_step
