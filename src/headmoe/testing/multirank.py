"""Run a function on N CPU Gloo ranks in spawned processes (tests and benchmarks).

    results = run_ranks(fn, 4, args=(x,), timeout=120)

`fn(rank, world_size, *args, **kwargs)` runs in a fresh *spawned* process per rank, with
one torch thread and the default Gloo group already initialised over a temp-file
rendezvous; its (picklable) return value lands in `results[rank]`. `fn` must be a
module-level function of an importable module.

Failures: if any rank raises, `RankFailure` carries every failed rank's traceback (ranks
still blocked in a collective are killed after a short grace period and named). If the
ranks do not all finish within `timeout` seconds, `RankTimeout` names the ranks that did
not, after killing them.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from headmoe.config import is_int
from headmoe.distributed.launch import FAILURE_GRACE_S


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failed rank's traceback."""

    def __init__(self, failures: dict[int, str], hung: list[int]):
        self.failures = failures
        self.hung = hung
        parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items())]
        if hung:
            parts.append(f"ranks still running when killed after the failure: {hung}")
        super().__init__(f"{len(failures)} rank(s) failed\n" + "\n".join(parts))


class RankTimeout(TimeoutError):
    """Some ranks did not finish in time; `hung` lists them."""

    def __init__(self, hung: list[int], timeout: float):
        self.hung = hung
        names = ", ".join(f"rank {r}" for r in hung)
        super().__init__(f"timed out after {timeout:.0f} s waiting for {names} (killed)")


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    timeout_s: float,
    init_group: bool,
    args: tuple,
    kwargs: dict,
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            # every rank's mesh is complete before any rank may fail and close its pairs
            dist.barrier()
        out = fn(rank, world_size, *args, **kwargs)
        # By value: torch's queue pickler would pass tensor storage as file descriptors that
        # the parent fetches from this process later, which fails once this rank has exited.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put(("err", rank, traceback.format_exc()))
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

    Returns the per-rank return values in rank order. Raises `RankFailure` or `RankTimeout`
    (see the module docstring). `init_group=False` leaves process-group creation to `fn`.
    """
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="headmoe-rdzv-")
    init_file = os.path.join(tmpdir, "rendezvous")
    procs = []
    for rank in range(world_size):
        p = ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, init_file, timeout, init_group, args, kwargs or {},
                  results),
            daemon=True,
        )
        p.start()
        procs.append(p)
    try:
        outputs, failures = _collect(results, procs, timeout)
        pending = sorted(set(range(world_size)) - set(outputs) - set(failures))
    finally:
        _reap(procs, init_file, tmpdir)
    if failures:
        raise RankFailure(failures, pending)
    if pending:
        raise RankTimeout(pending, timeout)
    return [outputs[r] for r in range(world_size)]


def _collect(results: Any, procs: list, timeout: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Every rank's result or failure until all reported, `timeout` passed, or
    `FAILURE_GRACE_S` after the first failure."""
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) + len(failures) < len(procs):
        now = time.monotonic()
        if failures:
            deadline = min(deadline, now + FAILURE_GRACE_S)
        if now >= deadline:
            break
        try:
            status, rank, payload = results.get(timeout=min(0.2, deadline - now))
        except queue_mod.Empty:
            # A process that died without reporting (segfault, os._exit) is a failure.
            for rank, p in enumerate(procs):
                if (not p.is_alive() and rank not in outputs and rank not in failures
                        and p.exitcode not in (None, 0)):
                    failures[rank] = f"process exited with code {p.exitcode} without a result"
            continue
        if status == "ok":
            outputs[rank] = pickle.loads(payload)  # our own spawned rank's bytes
        else:
            failures[rank] = payload
    return outputs, failures


def _reap(procs: list, init_file: str, tmpdir: str) -> None:
    """Kill what still runs, join everything, remove the rendezvous files."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
    for remove, path in ((os.remove, init_file), (os.rmdir, tmpdir)):
        try:
            remove(path)
        except OSError:
            pass


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
