"""Run a function on N CPU Gloo ranks in spawned processes (tests and benchmarks).

    results = run_ranks(fn, 4, args=(x,), timeout=120)

`fn(rank, world_size, *args, **kwargs)` runs in a fresh *spawned* process per rank, with
one torch thread and the default Gloo group already initialised (``env://`` over the
launcher's store: `headmoe.distributed.launch`, the launcher of generate and serve too);
its (picklable) return value lands in `results[rank]`, by value. `fn` must be a
module-level function of an importable module.

Failures: if any rank raises, `RankFailure` carries every failed rank's traceback (ranks
still blocked in a collective are killed after the launcher's grace period and named in
``hung``). If the ranks do not all finish within `timeout` seconds, `RankTimeout` names the
ranks that did not, after killing them.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from headmoe.config import is_int
from headmoe.distributed.launch import LaunchFailure, LaunchTimeout, launch_local, torchrun_env

#: one or more ranks raised: ``failures`` rank -> traceback, ``hung`` the ranks killed
RankFailure = LaunchFailure
#: some ranks did not finish in time: ``hung`` lists them (killed)
RankTimeout = LaunchTimeout


def _harness_rank(fn: Callable[..., Any], timeout_s: float, init_group: bool, args: tuple,
                  kwargs: dict) -> Any:
    """One spawned rank: one torch thread, the default Gloo group (every rank's mesh
    complete before any rank may fail and close its pairs), ``fn``, the group destroyed."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    env = torchrun_env()
    assert env is not None  # started by the launcher
    try:
        if init_group:
            dist.init_process_group("gloo", init_method="env://",
                                    timeout=timedelta(seconds=timeout_s))
            dist.barrier()
        return fn(env.rank, env.world_size, *args, **kwargs)
    finally:
        if init_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float = 120.0,
    init_group: bool = True,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` spawned Gloo ranks.

    Returns the per-rank return values in rank order. Raises `ValueError` for a bad
    ``world_size``, `RankFailure` or `RankTimeout` (see the module docstring).
    `init_group=False` leaves process-group creation to `fn`.
    """
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return launch_local(_harness_rank, world_size,
                        (fn, timeout, init_group, args, kwargs or {}), timeout=timeout)


def spawned_rank_pids(parent: int) -> list[int]:
    """The spawned rank processes directly under process `parent` (a launcher), sorted by
    pid (start order); Linux only (reads /proc). For tests that stop or kill one rank."""
    kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    pids = []
    for pid in kids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            pids.append(int(pid))
    return sorted(pids)
