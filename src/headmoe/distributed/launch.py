"""The one launcher of local ranks (generate, serve, the test harness), or a torchrun world.

    results = launch_local(fn, nproc, args=(job,))   # fn(*args) on nproc spawned ranks

    with LocalRanks(fn, nproc, args) as ranks:        # the same, watched by the caller
        ranks.signal(0, signal.SIGTERM); ranks.deadline = time.monotonic() + 30
        results = ranks.wait()

- **Start**: ``nproc`` processes of the spawn start method, each running ``fn(*args)``; a
  rank dies with its launcher (`exit_with_parent`), so a ``kill -9`` of the launcher frees
  every port at once; once its outcome is recorded and multiprocessing has finalized, a
  rank leaves with `os._exit` (as that start method's fork sibling does), skipping seconds
  of interpreter teardown.
- **Rendezvous**: the launcher hosts the job's `TCPStore` on a free loopback port; each rank
  finds RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
  ``TORCHELASTIC_USE_AGENT_STORE=True`` in its environment exactly as under torchrun, so it
  joins with ``init_method="env://"`` as a client of that store (as torchrun's ranks join
  their agent's), and the same rank code serves both: `torchrun_env` reads them (None
  outside such a world). Under torchrun nothing here starts: torchrun is the launcher.
- **Error files**: each rank's outcome is one file in the launch's temp folder, written
  atomically (`headmoe.files.atomic_write`): ``rank<k>.result`` (its return value, pickled
  by value: never storage passed as file descriptors that outlive the rank) or
  ``rank<k>.error`` (JSON: time, exception type, one-line summary, traceback).
- **Failure report**: the first failure starts `FAILURE_GRACE_S` for the other ranks to
  record theirs; those still running then are killed and named (``hung``). `LaunchFailure`
  carries every failed rank's traceback, one-line summary and time; `failure_order` puts
  the root cause first (a rank killed by a signal, then one naming a hung peer, then the
  earliest, then the lowest rank).
- **Bounded waits**: every wait polls every `POLL_S` against a deadline; ``wait(timeout)``
  or `LocalRanks.deadline` passing kills what still runs and raises `LaunchTimeout`;
  leaving the ``with`` early (an exception, Ctrl-C, SIGTERM) sends the ranks SIGINT, the
  stop they all handle (`headmoe.distributed.watchdog.interrupt_once`: a clean unwind,
  temp files removed), then SIGKILL after the grace.
"""

from __future__ import annotations

import atexit
import json
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from headmoe.config import is_int
from headmoe.files import atomic_write

if TYPE_CHECKING:  # torch.distributed is imported where a rank starts, not at import
    from multiprocessing.process import BaseProcess

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

#: seconds the other ranks get to exit once one rank failed; those still running then are
#: killed and named (every launch: generate's ranks, serve's, the test harness's)
FAILURE_GRACE_S = 10.0
#: seconds between two looks at the ranks
POLL_S = 0.1
#: how a killed rank's failure reads (`failure_order` puts it first)
KILLED = "killed by signal"
#: how a rank that names a hung peer reads (`headmoe.distributed.watchdog`)
HUNG_PEER = "stopped responding"
#: how a rank that stopped with its peers for another rank's failure reads
#: (`headmoe.pipeline.stop.StopAtLayer`; `failure_order` puts it last)
PEER_STOPPED = "stopped with every rank"
#: prctl option: the signal a process receives when its parent dies (linux/prctl.h)
PR_SET_PDEATHSIG = 1
#: the loopback address the launcher's store listens on
LOOPBACK = "127.0.0.1"


def _write_text(path: str, text: str) -> None:
    Path(path).write_text(text)


def _write_bytes(path: str, data: bytes) -> None:
    Path(path).write_bytes(data)


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a torchrun-style world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


class LaunchFailure(RuntimeError):
    """One or more ranks failed. ``failures``: global rank -> message (its traceback, or
    the signal); ``summaries``: rank -> one line (``ExceptionType: message`` or the
    signal); ``times``: rank -> when it recorded its failure (where it did); ``hung``: the
    ranks still running when the others were killed after the grace."""

    def __init__(self, failures: dict[int, str], summaries: dict[int, str] | None = None, *,
                 times: dict[int, float] | None = None, hung: Sequence[int] = ()):
        self.failures = failures
        self.summaries = summaries or {r: m.strip().splitlines()[-1] if m.strip() else m
                                       for r, m in failures.items()}
        self.times = dict(times or {})
        self.hung = list(hung)
        parts = [f"--- rank {r} failed ---\n{msg}" for r, msg in sorted(failures.items())]
        if self.hung:
            parts.append(f"ranks still running when killed after the failure: {self.hung}")
        super().__init__(f"{len(failures)} rank(s) failed\n" + "\n".join(parts))

    @property
    def order(self) -> list[int]:
        """The failed ranks, the root cause first (`failure_order`)."""
        return failure_order(self.failures, self.times)


class LaunchTimeout(TimeoutError):
    """Ranks still ran when the launch's deadline passed; ``hung`` lists them (killed)."""

    def __init__(self, hung: list[int], timeout: float):
        self.hung = hung
        self.timeout = timeout
        names = ", ".join(f"rank {r}" for r in hung)
        super().__init__(f"timed out after {timeout:.0f} s waiting for {names} (killed)")


def failure_order(failures: Mapping[int, str],
                  times: Mapping[int, float] | None = None) -> list[int]:
    """The failed ranks, the root cause first: a rank killed by a signal (``KILLED`` in its
    text), then one naming a hung peer (``HUNG_PEER``), then the earliest recorded failure
    (``times``: rank -> when, where known), then the lowest rank; a rank that only stopped
    with the others (``PEER_STOPPED``) comes last; the others mostly report the collective
    the first one broke. The one home of "who failed first"."""
    times = times or {}

    def cause(rank: int) -> tuple[bool, bool, bool, float, int]:
        text = failures[rank]
        return (PEER_STOPPED in text, KILLED not in text, HUNG_PEER not in text,
                times.get(rank, math.inf), rank)

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
    """The world this process was started in by torchrun or `LocalRanks` (RANK, WORLD_SIZE
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


# ---------------------------------------------------------------------- the error files
def result_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.result"


def error_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.error"


def write_error(folder: Path, rank: int, exc: BaseException) -> None:
    """In a failing rank (inside its ``except``): ``rank<k>.error`` with the time, the
    exception's type, its one-line summary (``Type: message``) and the traceback."""
    kind = type(exc).__name__
    message = " ".join(str(exc).split())
    record = {"time": time.time(), "type": kind,
              "summary": f"{kind}: {message}" if message else kind,
              "traceback": traceback.format_exc()}
    atomic_write(error_path(folder, rank), lambda tmp: _write_text(tmp, json.dumps(record)))


@dataclass(frozen=True)
class RankError:
    """One rank's failure as its error file or exit code tells it: ``text`` (traceback, or
    ``killed by signal N``, or ``exited with code N``), one-line ``summary``, ``time``
    (when the rank recorded it; None without a record)."""

    text: str
    summary: str
    time: float | None = None


def read_error(folder: Path, rank: int, exitcode: int | None) -> RankError | None:
    """Rank ``rank``'s failure: killed by a signal (negative ``exitcode``, whatever it
    wrote), else its error file, else a non-zero exit code; None if it has not failed."""
    if exitcode is not None and exitcode < 0:
        text = f"{KILLED} {-exitcode}"
        return RankError(text, text)
    path = error_path(folder, rank)
    if path.exists():
        record = json.loads(path.read_text())
        return RankError(record["traceback"], record["summary"], float(record["time"]))
    if exitcode not in (None, 0):
        text = f"exited with code {exitcode}"
        return RankError(text, text)
    return None


def _rank_entry(fn: Callable[..., object], args: tuple[object, ...], rank: int, nproc: int, port: int,
                folder: str) -> None:
    """A spawned rank: join the launcher's world (see the module doc), run ``fn(*args)``,
    record the result or the failure, exit 0 or 1."""
    exit_with_parent()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE=str(True))
    out = Path(folder)
    code = 0
    try:
        data = pickle.dumps(fn(*args))  # by value
        atomic_write(result_path(out, rank), lambda tmp: _write_bytes(tmp, data))
    except BaseException as exc:  # noqa: BLE001 - the launcher reports it
        write_error(out, rank, exc)
        code = 1
    # Once multiprocessing has run its finalizers, joined the threads and flushed stdout and
    # stderr, leave as its fork start method does (`os._exit`): the interpreter's teardown
    # (seconds of garbage collection over a job's objects, triton's leak report) is skipped.
    atexit.register(os._exit, code)  # registered last: the first exit handler to run
    if code:
        sys.exit(code)


# ---------------------------------------------------------------------- the launcher
class LocalRanks:
    """``fn(*args)`` on ``nproc`` spawned local ranks (see the module doc). ``fn`` must be a
    picklable module-level function; it reads its rank from the environment (`torchrun_env`)
    and joins with ``init_method="env://"``. Use as a context manager: entering starts the
    ranks, leaving stops what still runs and removes the temp folder. ``deadline``: a
    `time.monotonic` time after which `wait` gives up (settable while waiting)."""

    def __init__(self, fn: Callable[..., object], nproc: int, args: tuple[object, ...] = (), *,
                 name: str = "headmoe-rank"):
        if not is_int(nproc) or nproc < 1:
            raise ValueError(f"nproc must be a positive int, got {nproc!r}")
        self.fn, self.nproc, self.args, self.name = fn, nproc, args, name
        self.deadline: float | None = None
        self.procs: list[BaseProcess] = []
        self.folder: Path | None = None
        self._store: TCPStore | None = None

    def __enter__(self) -> LocalRanks:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        self.folder = Path(tempfile.mkdtemp(prefix="headmoe-launch-"))
        try:
            self._store = TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
            ctx = mp.get_context("spawn")
            for r in range(self.nproc):
                p = ctx.Process(target=_rank_entry, name=f"{self.name}{r}",
                                args=(self.fn, self.args, r, self.nproc, self._store.port,
                                      str(self.folder)))
                p.start()
                self.procs.append(p)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop(signal.SIGINT)  # the stop every rank handles (Ctrl-C's), then killed
        self._store = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def signal(self, rank: int, signum: int) -> None:
        """Send ``signum`` to rank ``rank`` (if it still runs)."""
        p = self.procs[rank]
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signum)

    def alive(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.is_alive()]

    def _stop(self, first: int | None) -> None:
        """Send ``first`` (None: nothing) to what still runs, SIGKILL what is left after the
        grace, join every rank."""
        for p in self.procs:
            if first is not None and p.is_alive() and p.pid is not None:
                os.kill(p.pid, first)
        end = time.monotonic() + (FAILURE_GRACE_S if first != signal.SIGKILL else 0.0)
        while self.alive() and time.monotonic() < end:
            time.sleep(POLL_S)
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=FAILURE_GRACE_S)

    def _look(self, results: dict[int, object], errors: dict[int, RankError]) -> None:
        """Record every rank that finished since the last look."""
        assert self.folder is not None
        for r, p in enumerate(self.procs):
            if r in results or r in errors:
                continue
            code = p.exitcode
            error = read_error(self.folder, r, code)
            if error is not None:
                errors[r] = error
            elif result_path(self.folder, r).exists():
                results[r] = pickle.loads(result_path(self.folder, r).read_bytes())  # ours
            elif code == 0:
                errors[r] = RankError("exited with code 0 without a result",
                                      "exited with code 0 without a result")

    def wait(self, timeout: float | None = None) -> list[object]:
        """Every rank's return value in rank order, once all have finished. Raises
        `LaunchFailure` (the grace after the first failure, then the rest killed) or
        `LaunchTimeout` (``timeout`` seconds, or `deadline`, passed)."""
        if timeout is not None:
            self.deadline = time.monotonic() + timeout
        start = time.monotonic()
        results: dict[int, object] = {}
        errors: dict[int, RankError] = {}
        while True:
            self._look(results, errors)
            if len(results) == self.nproc:
                self._stop(None)  # they are exiting: the grace, then killed
                return [results[r] for r in range(self.nproc)]
            if errors:
                self._fail(results, errors)
            if self.deadline is not None and time.monotonic() > self.deadline:
                hung = [r for r in range(self.nproc) if r not in results]
                self._stop(signal.SIGKILL)
                raise LaunchTimeout(hung, time.monotonic() - start if timeout is None
                                    else timeout)
            time.sleep(POLL_S)

    def _fail(self, results: dict[int, object], errors: dict[int, RankError]) -> NoReturn:
        end = time.monotonic() + FAILURE_GRACE_S
        while len(results) + len(errors) < self.nproc and time.monotonic() < end:
            time.sleep(POLL_S)
            self._look(results, errors)
        hung = [r for r in range(self.nproc) if r not in results and r not in errors]
        self._stop(signal.SIGKILL)
        raise LaunchFailure({r: e.text for r, e in errors.items()},
                            {r: e.summary for r, e in errors.items()},
                            times={r: e.time for r, e in errors.items() if e.time is not None},
                            hung=hung)


def launch_local(fn: Callable[..., object], nproc: int, args: tuple[object, ...] = (), *,
                 timeout: float | None = None) -> list[object]:
    """Run ``fn(*args)`` on ``nproc`` spawned local ranks (`LocalRanks`); their return
    values in rank order. Raises `ValueError` for ``nproc < 1``, `LaunchFailure` if any
    rank fails, `LaunchTimeout` if ``timeout`` seconds pass first."""
    with LocalRanks(fn, nproc, args) as ranks:
        return ranks.wait(timeout)
