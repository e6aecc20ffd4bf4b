"""Data-parallel replicas of ``headmoe serve``: rank 0's queue feeds every replica through
the launch's c10d store.

Each replica is its own world (`headmoe.distributed.replicas`: S ranks, DP 1) running one
job at a time in lockstep (`headmoe.serve.worker.serve_loop`), led by its local rank 0.
Replica 0's leader is rank 0's `headmoe.serve.worker.Leader`, beside the HTTP front end and
the `JobStore`; replica k > 0 is led by a `RemoteLeader` on its own local rank 0, and rank 0
runs one `ReplicaProxy` thread for it. A proxy takes the next queued job when its replica
is free (`JobStore.next_job`, the queue every replica takes from), so a job goes to the
first free replica; its result is the same bytes as ``generate``'s (a replica's DP index is
0 in its own world: it never enters the seed).

Keys, under `headmoe.distributed.replicas.SERVE_PREFIX`, for replica k and its n-th command
(every value JSON unless said; nothing is ever unpickled):

    =====================  =========  ===================================================
    key                    written by what
    =====================  =========  ===================================================
    ``r<k>/loaded``        replica    the model's load seconds, once it is in
    ``r<k>/beat``          replica    a counter its leader's beat thread bumps every tick
    ``r<k>/front``         rank 0     a counter the proxy bumps every poll
    ``r<k>/cmd/<n>``       rank 0     the command: ``run`` (`run_command`) or ``stop``
    ``r<k>/pixels/<n>``    rank 0     an image job's preprocessed pixels (raw bytes)
    ``r<k>/steps/<n>``     replica    the step times (s) done so far, a list
    ``r<k>/cancel/<n>``    rank 0     present: stop before the next layer
    ``r<k>/mp4/<n>``       replica    the finished mp4 (raw bytes)
    ``r<k>/result/<n>``    replica    ``{"outcomes": [...], "sidecar": text | null}``, last
    ``r<k>/stopped``       replica    present once its leader left the loop
    =====================  =========  ===================================================

Rank 0 writes a remote replica's mp4 and sidecar into ``--output-dir`` itself (atomically),
so replicas on other nodes need no shared folder. Waits poll `Store.check` every `POLL_S`;
a counter that has not moved for the deployment's collective timeout (judged on the
reader's own clock) means the other side stopped: a proxy then fails its replica's job and
marks it ``lost``, a remote leader raises (its ranks exit; the launcher stops the server).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from headmoe.distributed.launch import HUNG_PEER
from headmoe.distributed.replicas import ReplicaPlace
from headmoe.errors import RankUnresponsive
from headmoe.files import atomic_write
from headmoe.pipeline.image import ReferenceImage
from headmoe.pipeline.media import sidecar_path
from headmoe.planner.time import record_steps
from headmoe.serve.spec import ServeSpec
from headmoe.serve.state import Job, JobStore, redact_paths

#: seconds between two looks at a key another process writes
POLL_S = 0.02


class Store(Protocol):
    """What the replicas need of a c10d store (`torch.distributed.Store`)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, value: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...


class Front(Protocol):
    """What a proxy needs of rank 0's `headmoe.serve.worker.Leader`."""

    spec: ServeSpec
    store: JobStore

    def drain_late(self) -> bool: ...


# ---------------------------------------------------------------------- shared pieces
def run_command(job: Job) -> dict[str, Any]:
    """The ``run`` command of ``job`` every rank of its replica follows (JSON: the image
    as its description, never its pixels)."""
    return {"op": "run", "id": job.id, "request": job.request.to_dict(),
            "admission": job.admission,
            "image": None if job.image is None else job.image.describe(),
            "refiner": None if job.refiner is None else job.refiner.to_dict()}


def conclude(store: JobStore, spec: ServeSpec, job: Job, outcomes: list[dict[str, Any]],
             sidecar: dict[str, Any] | None) -> None:
    """End ``job`` from every rank's outcome (``{"rank", "status", "message"}``, global
    ranks) and, when all completed, its ``sidecar`` (its mp4 already in place); each
    rank's ``"memory"`` goes to the metrics."""
    store.rank_memory(outcomes)
    failed = [o for o in outcomes if o["status"] == "failed"]
    if failed:  # clients never see the server's paths
        message = redact_paths(f"rank {failed[0]['rank']}: {failed[0]['message']}")
        store.finish(job, "failed", message, None)
    elif any(o["status"] == "cancelled" for o in outcomes) or sidecar is None:
        why = "cancelled by request" if job.cancel_requested else "server shutting down"
        store.finish(job, "cancelled", why, None)
    else:
        store.finish(job, "completed", None, sidecar)
        record_steps(spec.deployment.step_cache, job.admission.get("step_key") or "",
                     sidecar["step_times_s"]["max"])  # later estimates of this cost


class Channel:
    """Replica ``replica``'s keys in ``store`` (the module's table)."""

    def __init__(self, store: Store, replica: int):
        self.store, self.replica = store, replica

    def key(self, name: str, n: int | None = None) -> str:
        return f"r{self.replica}/{name}" if n is None else f"r{self.replica}/{name}/{n}"

    def put(self, name: str, n: int | None, value: Any) -> None:
        self.store.set(self.key(name, n), json.dumps(value))

    def peek(self, name: str, n: int | None = None) -> Any:
        """The JSON value of a key, None while it is absent (never blocks)."""
        key = self.key(name, n)
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def has(self, name: str, n: int | None = None) -> bool:
        return self.store.check([self.key(name, n)])

    def bump(self, name: str) -> None:
        self.store.add(self.key(name), 1)

    def count(self, name: str) -> int:
        return self.store.add(self.key(name), 0)

    def forget(self, n: int) -> None:
        """Drop command ``n``'s keys (the mp4 bytes above all) once it is concluded."""
        for name in ("cmd", "pixels", "steps", "cancel", "mp4", "result"):
            self.store.delete_key(self.key(name, n))


class Liveness:
    """Whether a counter another process bumps still moves: `stale` once it has not for
    ``limit_s`` (this process's clock: no two clocks compared)."""

    def __init__(self, read: Callable[[], int], limit_s: float):
        self.read, self.limit_s = read, limit_s
        self._last, self._since = -1, time.monotonic()

    def stale(self) -> bool:
        value, now = self.read(), time.monotonic()
        if value != self._last:
            self._last, self._since = value, now
        return now - self._since > self.limit_s


class _Beat:
    """A daemon thread bumping ``channel``'s ``name`` counter every ``interval`` s."""

    def __init__(self, channel: Channel, name: str, interval: float):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(channel, name, interval),
                                        name=f"beat-{name}", daemon=True)
        self._thread.start()

    def _run(self, channel: Channel, name: str, interval: float) -> None:
        while not self._stop.is_set():
            try:
                channel.bump(name)
            except Exception:  # noqa: BLE001 - the store went away: the server is ending
                return
            self._stop.wait(interval)

    def stop(self) -> None:
        self._stop.set()


# ---------------------------------------------------------------------- replica side
@dataclass
class RemoteJob:
    """The job a remote replica runs now: its id, command number and image (with pixels)."""

    id: str
    n: int
    image: ReferenceImage | None


class RemoteLeader:
    """Local rank 0 of replica k > 0: the serve loop's leader interface (as
    `headmoe.serve.worker.Leader`'s) over `Channel`, its results sent to rank 0."""

    def __init__(self, channel: Channel, spec: ServeSpec, place: ReplicaPlace):
        self.channel, self.spec, self.place = channel, spec, place
        self.output_dir = tempfile.mkdtemp(prefix=f"headmoe-replica{place.replica}-")
        self.current: RemoteJob | None = None
        self._n = 0
        self._steps: list[float] = []
        self._last_step = 0.0
        self._cancel_checked = 0.0
        self._cancelled = False
        self._load: dict[str, Any] = {}
        self._front = Liveness(lambda: channel.count("front"), spec.deployment.timeout_s)
        self._beat = _Beat(channel, "beat", min(1.0, spec.tick_s))

    def loaded(self, seconds: float) -> None:
        """The model is in (``seconds`` to load): rank 0 may send jobs."""
        self._load = {"model_loads": 1, "model_loaded_at": time.time(), "model_load_s": seconds}
        self.channel.put("loaded", None, seconds)

    def next_command(self) -> dict[str, Any]:
        """Rank 0's next command for this replica, or ``idle`` after a tick without one."""
        deadline = time.monotonic() + self.spec.tick_s
        while not self.channel.has("cmd", self._n):
            if self._front.stale():
                raise RankUnresponsive(
                    f"replica {self.place.replica}: rank 0 (the HTTP front end) "
                    f"{HUNG_PEER} for {self.spec.deployment.timeout_s:g} s")
            if time.monotonic() >= deadline:
                return {"op": "idle"}
            time.sleep(POLL_S)
        cmd: dict[str, Any] = self.channel.peek("cmd", self._n)
        if cmd["op"] == "run":
            self.current = RemoteJob(cmd["id"], self._n, self._image(cmd))
            self._steps, self._cancelled = [], False
            self._last_step = time.perf_counter()
        elif cmd["op"] == "stop":
            self._beat.stop()
            self.channel.put("stopped", None, True)
        self._n += 1
        return cmd

    def _image(self, cmd: dict[str, Any]) -> ReferenceImage | None:
        if cmd.get("image") is None:
            return None
        pixels = self.channel.store.get(self.channel.key("pixels", self._n))
        return replace(ReferenceImage.from_dict(cmd["image"]), pixels=bytes(pixels))

    def stop_now(self) -> bool:
        """Between two layers: has rank 0 asked for a stop? (a store look at most every
        `POLL_S`)"""
        now = time.monotonic()
        if not self._cancelled and now - self._cancel_checked >= POLL_S:
            self._cancel_checked = now
            self._cancelled = self.channel.has("cancel", self.current.n) if self.current else False
        return self._cancelled

    def must_stop(self, done: int) -> bool:
        """After step ``done``: its time to rank 0; stop now?"""
        now = time.perf_counter()
        self._steps.append(now - self._last_step)
        self._last_step = now
        assert self.current is not None
        self.channel.put("steps", self.current.n, self._steps)
        self._cancel_checked = 0.0
        return self.stop_now()

    def server_facts(self) -> dict[str, Any]:
        """The sidecar's ``server`` field: this replica's load, its leader's pid."""
        return {**self._load, "pid": os.getpid()}

    def finish(self, outcomes: list[dict[str, Any]], result: dict[str, Any] | None) -> None:
        """Send the current job's outcomes (global ranks), sidecar and mp4 to rank 0."""
        job, self.current = self.current, None
        assert job is not None
        ranks = [dict(o, rank=self.place.global_rank(o["rank"])) for o in outcomes]
        sidecar = None
        if result is not None and result.get("sidecar") and all(
                o["status"] == "completed" for o in outcomes):
            side, mp4 = Path(result["sidecar"]), Path(result["output"])
            sidecar = side.read_text()
            self.channel.store.set(self.channel.key("mp4", job.n), mp4.read_bytes())
            side.unlink(missing_ok=True)
            mp4.unlink(missing_ok=True)
        self.channel.put("result", job.n, {"outcomes": ranks, "sidecar": sidecar})


# ---------------------------------------------------------------------- rank-0 side
class ReplicaLost(RuntimeError):
    """A remote replica's leader stopped answering."""


class ReplicaProxy:
    """Rank 0's thread for remote replica ``channel.replica``: it waits for the model, then
    takes queued jobs while the replica is free, follows each to its end, and sends the
    replica ``stop`` once the drain leaves nothing to run."""

    def __init__(self, front: Front, channel: Channel):
        self.front, self.channel, self.k = front, channel, channel.replica
        self.limit_s = front.spec.deployment.timeout_s
        self._beat = Liveness(lambda: channel.count("beat"), self.limit_s)
        self._n = 0
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"replica{self.k}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        store = self.front.store
        try:
            self._wait_loaded()
            while not store.draining:
                self.channel.bump("front")
                job = store.next_job(self.front.spec.tick_s, replica=self.k)
                if job is not None:
                    self._run_job(job)
                elif self._beat.stale():
                    raise ReplicaLost(f"replica {self.k} {HUNG_PEER}")
            self._stop()
        except BaseException as exc:  # noqa: BLE001 - reported on /health and stderr
            self.failure = exc
            store.replica_state(self.k, "lost")
            print(f"headmoe serve: replica {self.k}: {type(exc).__name__}: {exc}; no more "
                  "jobs go to it", file=sys.stderr, flush=True)

    def _wait_loaded(self) -> None:
        while not self.channel.has("loaded"):
            self.channel.bump("front")
            if self.front.store.draining:
                return
            time.sleep(POLL_S)
        self.front.store.replica_state(self.k, "idle")

    def _stop(self) -> None:
        self.channel.put("cmd", self._n, {"op": "stop"})
        self._n += 1
        deadline = time.monotonic() + self.limit_s
        while not self.channel.has("stopped"):
            self.channel.bump("front")
            if time.monotonic() > deadline:
                raise ReplicaLost(f"replica {self.k} did not stop within {self.limit_s:g} s")
            time.sleep(POLL_S)
        self.front.store.replica_state(self.k, "stopped")

    def _run_job(self, job: Job) -> None:
        n, self._n = self._n, self._n + 1
        if job.image is not None:
            self.channel.store.set(self.channel.key("pixels", n), job.image.pixels)
        self.channel.put("cmd", n, run_command(job))
        try:
            result = self._follow(job, n)
        except ReplicaLost as exc:
            self.front.store.finish(job, "failed", str(exc), None)
            raise
        text = result["sidecar"]
        if text is not None:
            self._write(job, n, text)
        sidecar = None if text is None else json.loads(text)
        conclude(self.front.store, self.front.spec, job, result["outcomes"], sidecar)
        self.channel.forget(n)

    def _follow(self, job: Job, n: int) -> dict[str, Any]:
        """Relay the replica's steps and rank 0's cancel until the result is in."""
        recorded, cancel_sent = 0, False
        while True:
            self.channel.bump("front")
            steps = self.channel.peek("steps", n) or []
            stop = False
            for done, seconds in enumerate(steps[recorded:], start=recorded + 1):
                stop = self.front.store.record_step(job, done, seconds) or stop
            recorded = max(recorded, len(steps))
            if not cancel_sent and (stop or job.cancel_requested or self.front.drain_late()):
                self.channel.put("cancel", n, True)
                cancel_sent = True
            result = self.channel.peek("result", n)
            if result is not None:
                return dict(result)
            if self._beat.stale():
                raise ReplicaLost(f"replica {self.k} {HUNG_PEER} while running {job.id}")
            time.sleep(POLL_S)

    def _write(self, job: Job, n: int, text: str) -> None:
        """The replica's mp4 and sidecar (``text``, as the replica wrote it) into the
        output folder, each atomically."""
        path = self.front.store.output_path(job.id)
        data = self.channel.store.get(self.channel.key("mp4", n))
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))
        atomic_write(sidecar_path(path), lambda tmp: Path(tmp).write_text(text))
