"""Start local ranks through torch's elastic launcher, or join a torchrun world.

    results = launch_local(fn, nproc=4, args=(job,))   # fn(*args) on 4 spawned ranks

`launch_local` runs one single-node elastic job (spawn start method, `max_restarts=0`, c10d
rendezvous on a free loopback port). Each rank finds RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment exactly as under torchrun,
so the same rank function serves both: `torchrun_env()` reads them (None outside such a
world). If any rank fails, the launcher stops the others and `launch_local` raises
`LaunchFailure` with every failed rank's message (its exception's traceback, recorded by
torch's error-file mechanism, or the signal that killed it).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from headmoe.config import is_int

#: seconds the other ranks get to exit once one rank failed; those still running then are
#: killed and named (every launcher: `launch_local`'s callers, serve's supervisor, the test
#: harness `headmoe.testing.run_ranks`)
FAILURE_GRACE_S = 10.0
#: how a killed rank's failure reads (`failure_order` puts it first)
KILLED = "killed by signal"
#: how a rank that names a hung peer reads (`headmoe.distributed.watchdog`)
HUNG_PEER = "stopped responding"
#: prctl option: the signal a process receives when its parent dies (linux/prctl.h)
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a torchrun-style world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


class LaunchFailure(RuntimeError):
    """One or more ranks failed; ``failures`` maps global rank -> message (traceback),
    ``summaries`` rank -> one line (``ExceptionType: message`` or the signal)."""

    def __init__(self, failures: dict[int, str], summaries: dict[int, str] | None = None):
        self.failures = failures
        self.summaries = summaries or {r: m.strip().splitlines()[-1] if m.strip() else m
                                       for r, m in failures.items()}
        parts = [f"--- rank {r} failed ---\n{msg}" for r, msg in sorted(failures.items())]
        super().__init__(f"{len(failures)} rank(s) failed\n" + "\n".join(parts))


def failure_order(failures: Mapping[int, str],
                  times: Mapping[int, float] | None = None) -> list[int]:
    """The failed ranks, the root cause first: a rank killed by a signal (``KILLED`` in its
    text), then one naming a hung peer (``HUNG_PEER``), then the earliest recorded failure
    (``times``: rank -> when, where known), then the lowest rank; the others mostly report
    the collective the first one broke. The one home of "who failed first"."""
    times = times or {}

    def cause(rank: int) -> tuple[bool, bool, float, int]:
        text = failures[rank]
        return (KILLED not in text, HUNG_PEER not in text, times.get(rank, math.inf), rank)

    return sorted(failures, key=cause)


def exit_with_parent() -> None:
    """Have the kernel kill this process (SIGKILL) as soon as its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; nothing elsewhere): ranks orphaned by a ``kill -9`` of
    their launcher exit at once and free their ports instead of finishing their job."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getppid()
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def torchrun_env() -> RankEnv | None:
    """The world this process was started in by torchrun or `launch_local` (RANK, WORLD_SIZE
    and LOCAL_RANK all set), else None. Raises `ValueError` naming a variable that is set but
    not an int."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(n in os.environ for n in names):
        return None
    values = {}
    for n in (*names, "LOCAL_WORLD_SIZE"):
        raw = os.environ.get(n, os.environ["WORLD_SIZE"])
        try:
            values[n] = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {n} must be an int, got {raw!r}") from None
    return RankEnv(
        values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]
    )


def launch_local(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    run_id: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` spawned local ranks; return their results in rank order.

    ``fn`` must be a picklable module-level function that reads its rank from the environment (`torchrun_env`) and initialises its process
    group with ``init_method="env://"``. Raises `ValueError` for ``nproc < 1`` and
    `LaunchFailure` if any rank fails (the others are then stopped).
    """
    if not is_int(nproc) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id or uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        start_method="spawn",
        monitor_interval=0.1,
    )
    try:
        results = elastic_launch(config, fn)(*args)
    except ChildFailedError as exc:
        raise LaunchFailure(
            {rank: _failure_message(f) for rank, f in exc.failures.items()},
            {rank: _failure_summary(f) for rank, f in exc.failures.items()},
        ) from None
    return [results[r] for r in range(nproc)]


def _failure_message(failure: Any) -> str:
    data = getattr(failure, "error_file_data", None) or {}
    inner = data.get("message", {}) if isinstance(data, dict) else {}
    text = ""
    if isinstance(inner, dict):
        text = inner.get("extraInfo", {}).get("py_callstack") or inner.get("message", "")
    text = str(text or failure.message or "").strip()
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"{KILLED} {-failure.exitcode}"
    return text or f"exited with code {failure.exitcode}"


def _failure_summary(failure: Any) -> str:
    """One line: the exception as ``Type: message`` (the error file's own summary), or the
    signal that killed the rank."""
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"{KILLED} {-failure.exitcode}"
    data = getattr(failure, "error_file_data", None) or {}
    inner = data.get("message", {}) if isinstance(data, dict) else {}
    text = inner.get("message", "") if isinstance(inner, dict) else str(inner)
    text = str(text or "").strip()
    if not text:
        lines = _failure_message(failure).splitlines()
        text = lines[-1] if lines else ""
    return " ".join(text.split()) or f"exited with code {failure.exitcode}"
