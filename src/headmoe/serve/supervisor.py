"""Local ranks of ``headmoe serve``, started and watched by the launching process.

`run_local` starts ``world_size`` ranks through the one launcher,
`headmoe.distributed.launch.LocalRanks` (spawn, the launcher's store, per-rank error
files; on CPU `set_rank_threads` gives each its share of the cores), each running
`headmoe.serve.worker.serve_rank`, and waits for them:

- every rank exited 0 (a drained stop): return 0;
- a rank died or failed: after the launcher's grace the rest are stopped; print one line
  naming the rank that went first (`failure_order`: killed by a signal, or the earliest
  recorded exception, whose traceback goes to stderr above it) and any rank still running
  then (a hung rank: its peers failed on the collective timeout), and return 1;
- SIGTERM or SIGINT here: forwarded once to rank 0, which drains; if the ranks are not all
  gone ``drain_timeout_s + 30`` s later they are killed and the return is 1.
"""

from __future__ import annotations

import signal
import sys
import time

from headmoe.distributed.launch import KILLED, LaunchFailure, LaunchTimeout, LocalRanks
from headmoe.serve.spec import ServeSpec

#: seconds past the drain bound the ranks get to exit after a forwarded signal
DRAIN_MARGIN_S = 30


def rank_main(spec: ServeSpec) -> None:
    """A launched rank: its place from the environment (`torchrun_env`), its CPU threads,
    then `serve_rank` until a drained exit (rank 0 stops if the supervisor disappears)."""
    from headmoe.distributed.context import set_rank_threads
    from headmoe.distributed.launch import torchrun_env
    from headmoe.serve.worker import serve_rank

    env = torchrun_env()
    assert env is not None  # started by `LocalRanks`
    set_rank_threads(env.local_world_size)
    serve_rank(spec, env.rank, env.world_size, supervised=True)


def _culprit(failure: LaunchFailure) -> tuple[int, str, str]:
    """(rank, one-line reason, traceback) of the rank that failed first
    (`LaunchFailure.order`); the traceback is empty when the rank recorded none."""
    rank = failure.order[0]
    text = failure.failures[rank]
    if rank not in failure.times:  # killed, or gone without a recorded exception
        return rank, f"died ({text})" if text.startswith(KILLED) else text, ""
    last = text.strip().splitlines()[-1] if text.strip() else "an exception"
    return rank, f"failed: {last}", text


def run_local(spec: ServeSpec, world_size: int) -> int:
    """Run the server's ranks here; the exit code (0 after a drain, 1 on a failure)."""
    old: dict = {}
    # a signal before the handlers: the ranks are stopped as the launcher leaves
    with LocalRanks(rank_main, world_size, (spec,), name="headmoe-serve-rank") as ranks:

        def forward(signum: int, frame: object) -> None:
            if ranks.deadline is None:
                ranks.deadline = time.monotonic() + spec.drain_timeout_s + DRAIN_MARGIN_S
                ranks.signal(0, signal.SIGTERM)

        try:
            old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
            ranks.wait()
            return 0
        except LaunchFailure as failure:
            rank, reason, text = _culprit(failure)
            if text:
                sys.stderr.write(text)
            also = (f" (rank(s) {failure.hung} still running, killed: hung?)"
                    if failure.hung else "")
            print(f"headmoe serve: rank {rank} {reason}{also}; the server stopped",
                  file=sys.stderr, flush=True)
            return 1
        except LaunchTimeout as late:
            print(f"headmoe serve: ranks {late.hung} did not stop after the drain; killed",
                  file=sys.stderr, flush=True)
            return 1
        finally:
            for s, h in old.items():
                signal.signal(s, h)
