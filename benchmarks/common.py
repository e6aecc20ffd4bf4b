"""Generic timing helpers for multi-rank benchmarks (run inside `run_ranks` workers).

Noise on a shared machine is handled by interleaving: every repetition runs each method
once, in turn, so a slow moment hits all methods alike; reports use the median over
repetitions of the slowest rank's time.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_average() -> str:
    """The 1/5/15-minute load averages and the CPUs, for the report of a timed run (a figure
    measured on a loaded machine holds under that load only)."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} CPUs"


def min_median(times: list[float]) -> str:
    """`min / median` seconds of repeated timings, as printed by the benchmarks."""
    return f"{min(times):.3f} / {statistics.median(times):.3f}"


def timed(fn: Callable[[], Any], group: Any = None) -> float:
    """Seconds `fn()` takes on this rank, started and stopped in step with the other ranks
    (a barrier before and after, the second inside the measurement)."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t0


def interleaved(methods: dict[str, Callable[[], Any]], reps: int, warmup: int = 1,
                group: Any = None) -> dict[str, list[float]]:  # fmt: skip
    """Run every method once per repetition, in turn; return this rank's times (s)."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(warmup + reps):
        for name, fn in methods.items():
            t = timed(fn, group)
            if i >= warmup:
                times[name].append(t)
    return times


def slowest_rank_median(per_rank: list[list[float]]) -> float:
    """Median over repetitions of the slowest rank's time."""
    return statistics.median(max(ts) for ts in zip(*per_rank))


def paired_ratio(per_rank_a: list[list[float]], per_rank_b: list[list[float]]) -> float:
    """Median over repetitions of a/b, each the slowest rank's time of that repetition. The
    two methods ran back to back in every repetition, so the ratio cancels slow phases of
    a noisy machine better than a ratio of medians."""
    a = [max(ts) for ts in zip(*per_rank_a)]
    b = [max(ts) for ts in zip(*per_rank_b)]
    return statistics.median(x / y for x, y in zip(a, b))


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
