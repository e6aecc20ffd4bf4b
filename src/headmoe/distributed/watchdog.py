"""Name the rank that stopped responding.

Each rank of a multi-rank job runs a `Heartbeat`: a daemon thread that writes
``"<step> <beat>"`` to the job's c10d store every `interval` seconds (the step comes from
`note_step`, called at the top of every denoising step). A stopped or killed process stops
beating. When a collective fails on a rank (Gloo/NCCL raise after ``--timeout``),
`Heartbeat.explain` reads every rank's beat twice, `interval * 2.5` apart, and turns the
failure into `RankUnresponsive` naming the ranks whose beat did not move (else the ranks
furthest behind in steps), with the step each one last reached.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Protocol

from headmoe.distributed.launch import HUNG_PEER
from headmoe.errors import RankUnresponsive, RuntimeFault

_state = {"step": -1}


def note_step(step: int) -> None:
    """Record the denoising step this process is in (read by its heartbeat thread)."""
    _state["step"] = step


class BeatStore(Protocol):
    """What the heartbeats need of a c10d store (`torch.distributed.TCPStore`)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


class Heartbeat:
    """Beats of this rank into ``store`` under ``prefix`` (see module doc)."""

    def __init__(self, store: BeatStore, rank: int, world_size: int, interval: float = 1.0,
                 prefix: str = "headmoe/heartbeat"):
        self.store, self.rank, self.world, self.interval = store, rank, world_size, interval
        self.prefix = prefix
        self._stop = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._run, name="headmoe-heartbeat", daemon=True)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(self._key(self.rank), f"{_state['step']} {self._beats}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def __enter__(self) -> Heartbeat:
        note_step(-1)
        self._beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _read(self) -> dict[int, tuple[int, int] | None]:
        out: dict[int, tuple[int, int] | None] = {}
        for r in range(self.world):
            try:
                if not self.store.check([self._key(r)]):
                    out[r] = None
                    continue
                step, beat = self.store.get(self._key(r)).decode().split()
                out[r] = (int(step), int(beat))
            except Exception:  # noqa: BLE001 - unreadable: treat as silent
                out[r] = None
        return out

    def stalled(self) -> dict[int, int]:
        """Ranks whose beat did not move over ``2.5 * interval`` (else those furthest behind
        in steps) -> the last step each reached (-1: before the first step)."""
        first = self._read()
        time.sleep(2.5 * self.interval)
        second = self._read()
        silent = {r: (first[r] or (-1, 0))[0] for r in range(self.world)
                  if r != self.rank and (second[r] is None or second[r] == first[r])}
        if silent:
            return silent
        steps = {r: v[0] for r, v in second.items() if v is not None}
        if steps and min(steps.values()) < max(steps.values()):
            low = min(steps.values())
            return {r: s for r, s in steps.items() if s == low}
        return {}

    def explain(self, exc: BaseException, timeout_s: float, steps: int) -> BaseException:
        """`RankUnresponsive` naming the stalled ranks for a failed collective, else ``exc``."""
        if isinstance(exc, RuntimeFault | ValueError | KeyboardInterrupt):
            return exc
        stalled = self.stalled()
        if not stalled:
            return exc
        where = ", ".join(
            f"rank {r} (last at step {s + 1}/{steps})" if s >= 0 else f"rank {r} (before step 1)"
            for r, s in sorted(stalled.items()))
        return RankUnresponsive(
            f"{where} {HUNG_PEER}: rank {self.rank} waited --timeout {timeout_s:g} s "
            f"for it in a collective ({type(exc).__name__}), check that process and its host, "
            "or raise --timeout if a step legitimately takes longer"
        )


def interrupt_once() -> None:
    """In this process's main thread: the first SIGINT raises `KeyboardInterrupt` (at the
    next Python line, i.e. between two layers at the latest); later ones (the launcher
    forwards Ctrl-C to its ranks while they unwind) are ignored, so no rank prints a second
    traceback."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
