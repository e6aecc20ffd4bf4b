"""Local ranks of ``headmoe serve`` in spawned processes, watched by the launching process.

`run_local` starts ``world_size`` processes (spawn start method; a file rendezvous in a
fresh temp folder; on CPU `set_rank_threads` gives each its share of the cores) that run
`headmoe.serve.worker.serve_rank`, then watches them every 0.1 s:

- every rank exited 0 (a drained stop): return 0;
- a rank died or failed: wait a moment for the others to notice, stop the rest, print one
  line naming the rank that went first (killed by a signal, or the earliest recorded
  exception, whose traceback goes to stderr above it) and any rank still running then (a
  hung rank: its peers failed on the collective timeout), and return 1;
- SIGTERM or SIGINT here: forwarded once to rank 0, which drains; if the ranks are not all
  gone ``drain_timeout_s + 30`` s later they are killed and the return is 1.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from headmoe.distributed.launch import FAILURE_GRACE_S, KILLED, failure_order
from headmoe.serve.spec import ServeSpec

#: seconds between looks at the ranks
POLL_S = 0.1


def rank_main(spec: ServeSpec, rank: int, world_size: int, init_method: str, errors: str) -> None:
    """Spawned rank: run `serve_rank`; on an exception write ``<errors>/rank<k>.txt``
    (time, traceback) and exit 1 (the supervisor prints the traceback of the rank that
    failed first, not the cascade of peers that lost it)."""

    from headmoe.distributed.context import set_rank_threads
    from headmoe.distributed.launch import exit_with_parent
    from headmoe.serve.worker import serve_rank

    exit_with_parent()  # a kill -9 of the supervisor ends every rank at once (port freed)
    os.environ["LOCAL_RANK"] = str(rank)
    set_rank_threads(world_size)
    try:
        serve_rank(spec, rank, world_size, init_method, supervised=True)
    except BaseException:  # noqa: BLE001 - the supervisor prints the first failure's
        text = traceback.format_exc()
        Path(errors, f"rank{rank}.txt").write_text(f"{time.time()!r}\n{text}")
        sys.exit(1)


def _culprit(procs: list, errors: Path) -> tuple[int, str, str]:
    """(rank, one-line reason, traceback) of the rank that failed first (`failure_order`:
    killed by a signal, then naming a hung peer, then the earliest recorded exception)."""
    texts: dict[int, str] = {}
    times: dict[int, float] = {}
    for f in errors.glob("rank*.txt"):
        when, _, text = f.read_text().partition("\n")
        rank = int(f.stem[4:])
        texts[rank], times[rank] = text, float(when)
    for r, p in enumerate(procs):
        if p.exitcode is not None and p.exitcode < 0:
            texts[r] = f"{KILLED} {-p.exitcode}"
            times.pop(r, None)
        elif p.exitcode not in (None, 0) and r not in texts:
            texts[r] = f"exited with code {p.exitcode}"
    r = failure_order(texts, times)[0]
    text = texts[r]
    if r not in times:  # killed, or gone without a recorded exception
        return r, f"died ({text})" if text.startswith(KILLED) else text, ""
    last = text.strip().splitlines()[-1] if text.strip() else "an exception"
    return r, f"failed: {last}", text


def run_local(spec: ServeSpec, world_size: int) -> int:
    """Run the server's ranks here; the exit code (0 after a drain, 1 on a failure)."""
    tmp = Path(tempfile.mkdtemp(prefix="headmoe-serve-"))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, name=f"headmoe-serve-rank{r}",
                         args=(spec, r, world_size, f"file://{tmp}/rendezvous", str(tmp)))
             for r in range(world_size)]
    stop_by: list[float] = []

    def forward(signum: int, frame: object) -> None:
        if not stop_by:
            stop_by.append(time.monotonic() + spec.drain_timeout_s + 30)
            os.kill(procs[0].pid, signal.SIGTERM)

    old: dict = {}
    try:
        for p in procs:
            p.start()  # a signal before the handler: rank 0 sees its parent gone and stops
        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        return _watch(procs, tmp, stop_by)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def _watch(procs: list, errors: Path, stop_by: list[float]) -> int:
    while True:
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return 0
        if any(c not in (None, 0) for c in codes):
            deadline = time.monotonic() + FAILURE_GRACE_S
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            rank, reason, text = _culprit(procs, errors)
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            if text:
                sys.stderr.write(text)
            also = f" (rank(s) {hung} still running, killed: hung?)" if hung else ""
            print(f"headmoe serve: rank {rank} {reason}{also}; the server stopped",
                  file=sys.stderr, flush=True)
            return 1
        if stop_by and time.monotonic() > stop_by[0]:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            print(f"headmoe serve: ranks {alive} did not stop after the drain; killed",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(POLL_S)
