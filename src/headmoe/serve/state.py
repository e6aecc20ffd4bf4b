"""`JobStore`: rank 0's table of video jobs, its bounded queue and its metrics.

Two threads share it: the HTTP server's (submit, look up, cancel) and the rank loop's (take
the next job, record steps, finish). Every method takes one lock briefly; nothing blocks
while holding it.

Job ids are server-generated, ``video_<32 hex digits>`` (`ID_PATTERN`); a job's files are
``<output_dir>/<id>.mp4`` and ``<id>.json``, and `JobStore.output_path` refuses anything
that is not such an id, so no client string ever becomes a path.

With a `headmoe.serve.store.JobDatabase` (``--state-dir``) every change of a job is
written through to it inside the method that makes it, under the store's lock, before the
change is visible in memory: submission, start, progress, a cancel request, the end
(completed only once its mp4 is in place: `finish` comes after the rename) and `forget`.
`restore` fills a restarted server's store from the database (`recover`).
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from headmoe.pipeline.request import GenerateRequest
from headmoe.serve.metrics import ServerMetrics

STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
ID_PATTERN = re.compile(r"video_[0-9a-f]{32}")


#: an absolute path's folders (POSIX or a drive letter), up to its last component
_FOLDERS = re.compile(r"(?<![\w.:/])(?:[A-Za-z]:)?[/\\](?:[^\s'\"/\\:,;()\[\]<>]+[/\\])+")


def redact_paths(text: str) -> str:
    """``text`` with every absolute path cut to its last component (what a client may see
    of a failure: ``'/srv/out/video_1.mp4'`` -> ``'video_1.mp4'``)."""
    return _FOLDERS.sub("", text)


class QueueFull(RuntimeError):
    """The queue holds ``max_queue`` jobs already (HTTP 429)."""


class Draining(RuntimeError):
    """The server is shutting down and takes no new jobs (HTTP 503)."""


@dataclass
class Job:
    """One request's life: ``status`` in `STATUSES`; ``steps_done`` of
    `total_steps`; ``result`` the sidecar once completed."""

    id: str
    request: GenerateRequest
    created_at: int
    status: str = "queued"
    steps_done: int = 0
    cancel_requested: bool = False
    error: str | None = None
    started_at: float | None = None
    completed_at: int | None = None
    result: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    admission: dict[str, Any] = field(default_factory=dict)
    """`Admitted.describe()`: where each field came from (recorded in the sidecar)."""
    image: Any = None
    """Image-to-video: the request's `headmoe.pipeline.image.ReferenceImage` (with pixels)."""
    refiner: Any = None
    """1080p: the admitted `headmoe.pipeline.refine.RefinerStage` (None: the preview only)."""
    replica: int | None = None
    """The data-parallel replica that runs or ran it (None while queued)."""

    @property
    def total_steps(self) -> int:
        """Sampler steps of both stages (the preview's, then the refiner's)."""
        return self.request.num_inference_steps + (self.refiner.steps if self.refiner else 0)


#: what `JobStore.replica_view` says of a replica: its model still loading, waiting for a
#: job, running one, stopped after the drain, or lost (its leader stopped answering)
REPLICA_STATES = ("loading", "idle", "busy", "stopped", "lost")


class JobLog(Protocol):
    """Where `JobStore` writes every change of a job through to: the methods of
    `headmoe.serve.store.JobDatabase` (which imports this module, hence a protocol)."""

    def add(self, job: Job) -> None: ...
    def readmit(self, job: Job) -> None: ...
    def start(self, job_id: str, replica: int, started_at: float | None = None) -> None: ...
    def progress(self, job_id: str, steps_done: int) -> None: ...
    def request_cancel(self, job_id: str) -> None: ...
    def complete(self, job_id: str, file: Path, sidecar: dict[str, Any],
                 completed_at: int | None = None) -> None: ...
    def end(self, job_id: str, status: str, error: str,
            completed_at: int | None = None) -> None: ...
    def delete(self, job_id: str) -> None: ...


class JobStore:
    """Jobs by id (insertion order), the queue of queued ids (at most ``max_queue``), the
    draining flag, the replicas' states (`set_replicas`) and ``metrics``, the
    `ServerMetrics` behind ``/metrics``; ``db`` (optional) the database every change is written through
    to (module docstring)."""

    def __init__(self, output_dir: str | Path, max_queue: int, db: JobLog | None = None):
        self.output_dir = Path(output_dir).resolve()
        self.max_queue = max_queue
        self.db = db
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._jobs: dict[str, Job] = {}
        self._queue: deque[str] = deque()
        self.draining = False
        self.signalled = False
        """Set by rank 0's signal handler without the lock: draining, from that moment."""
        self.ready = False
        self.model_loads = 0
        self.model_load_s: float | None = None
        self.model_loaded_at: float | None = None
        self.metrics = ServerMetrics()
        self._replicas: list[dict[str, Any]] = [{"replica": 0, "ranks": [0], "state": "loading",
                                                 "job": None}]

    # ------------------------------------------------------------------ HTTP side
    def submit(self, request: GenerateRequest, admission: dict[str, Any] | None = None,
               image: Any = None, refiner: Any = None) -> Job:
        """Queue ``request`` (with its I2V ``image`` and 1080p ``refiner`` stage) as a new
        job (``admission``: what its sidecar records of its admission); raises `Draining` or
        `QueueFull`."""
        with self._lock:
            if self.draining or self.signalled:
                raise Draining("the server is shutting down and takes no new jobs")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} jobs waiting)")
            job = Job(f"video_{uuid.uuid4().hex}", request, int(time.time()),
                      admission=admission or {}, image=image, refiner=refiner)
            if self.db is not None:
                self.db.add(job)
            self._jobs[job.id] = job
            self._queue.append(job.id)
            self.metrics.job_queued()
            self._gauges()
            self._wake.notify_all()
            return job

    def get(self, job_id: str) -> Job | None:
        """The job of ``job_id``, None for an unknown or malformed id."""
        if not ID_PATTERN.fullmatch(job_id):
            return None
        with self._lock:
            return self._jobs.get(job_id)

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def cancel(self, job: Job) -> None:
        """Cancel a queued job now; ask an in-progress one to stop at its next step."""
        with self._lock:
            if job.status == "queued":
                self._queue.remove(job.id)
                self._end(job, "cancelled", "cancelled by request")
            elif job.status == "in_progress" and not job.cancel_requested:
                if self.db is not None:
                    self.db.request_cancel(job.id)
                job.cancel_requested = True

    def forget(self, job: Job) -> None:
        """Drop a finished job (its row first) and delete its files."""
        with self._lock:
            if self.db is not None and job.id in self._jobs:
                self.db.delete(job.id)
            self._jobs.pop(job.id, None)
        try:
            mp4 = self.output_path(job.id)
        except ValueError:  # the output folder was replaced by a link: delete nothing there
            return
        for path in (mp4, mp4.with_suffix(".json")):
            path.unlink(missing_ok=True)

    def reject(self, code: int) -> None:
        """Count a request refused before queueing with HTTP status ``code``."""
        self.metrics.job_rejected(code)

    def model_loaded(self, seconds: float) -> None:
        """The ranks built and loaded the model in ``seconds``: counted (``model_loads``,
        ``model_load_s``, ``model_loaded_at``, the metrics) and the server ready."""
        with self._lock:
            self.model_loads += 1
            self.model_load_s, self.model_loaded_at = seconds, time.time()
            self.metrics.model_loaded(seconds)
            self.ready = True

    def rank_memory(self, outcomes: list[dict[str, Any]]) -> None:
        """Record each rank's ``"memory"`` (a `resident_memory` pair or None) of
        ``outcomes`` (one dict per rank, all-gathered), labelled with its ``"rank"``: the
        one place the rank label is formed (a global rank, given by the rank itself)."""
        for outcome in outcomes:
            if outcome.get("memory") is not None:
                kind, nbytes = outcome["memory"]
                self.metrics.rank_memory(int(outcome["rank"]), kind, int(nbytes))

    def output_path(self, job_id: str) -> Path:
        """``<output_dir>/<job_id>.mp4``; `ValueError` unless ``job_id`` is a server id."""
        if not ID_PATTERN.fullmatch(job_id):
            raise ValueError(f"job id must match {ID_PATTERN.pattern}, got {job_id!r}")
        path = (self.output_dir / f"{job_id}.mp4").resolve()
        if path.parent != self.output_dir:
            raise ValueError(f"job id {job_id!r} escapes the output folder")
        return path

    # ------------------------------------------------------------------ rank-0 loop side
    def next_job(self, timeout: float, replica: int = 0) -> Job | None:
        """Take the oldest queued job (now in progress on data-parallel replica
        ``replica``), waiting up to ``timeout`` s."""
        with self._wake:
            if not self._queue:
                self._wake.wait(timeout)
            if not self._queue or self.draining:
                return None
            job = self._jobs[self._queue[0]]
            started = time.time()
            if self.db is not None:
                self.db.start(job.id, replica=replica, started_at=started)
            self._queue.popleft()
            job.status, job.started_at, job.replica = "in_progress", started, replica
            self._replicas[replica].update(state="busy", job=job.id)
            self._gauges()
            return job

    def record_step(self, job: Job, done: int, seconds: float) -> bool:
        """Note step ``done`` of ``job`` (``seconds`` long); True if it must stop now."""
        with self._lock:
            if self.db is not None:
                self.db.progress(job.id, done)
            job.steps_done = done
            self.metrics.step_done(seconds)
            return job.cancel_requested

    def finish(self, job: Job, status: str, error: str | None, result: dict | None) -> None:
        """End an in-progress job with ``status`` (a terminal one)."""
        with self._lock:
            job.result = result
            self._end(job, status, error)

    def start_drain(self) -> list[Job]:
        """Take no new jobs; cancel the queued ones. Returns the job in progress, if any."""
        with self._lock:
            self.draining = True
            while self._queue:
                self._end(self._jobs[self._queue.popleft()], "cancelled", "server shutting down")
            self._wake.notify_all()
            return [j for j in self._jobs.values() if j.status == "in_progress"]

    def _end(self, job: Job, status: str, error: str | None) -> None:
        now = int(time.time())
        if self.db is not None and status == "completed":
            self.db.complete(job.id, self.output_path(job.id), job.result or {}, now)
        elif self.db is not None:
            self.db.end(job.id, status, error or status, now)
        job.status, job.error, job.completed_at = status, error, now
        if job.replica is not None and self._replicas[job.replica]["job"] == job.id:
            self._replicas[job.replica].update(state="idle", job=None)
        self.metrics.job_finished(status, max(0.0, time.time() - job.created_at))
        self._gauges()
        job.done.set()

    def _gauges(self) -> None:
        """Set the queue-length and busy-replica gauges (under the lock)."""
        busy = sum(j.status == "in_progress" for j in self._jobs.values())
        self.metrics.set_queue(len(self._queue), busy)

    def restore(self, jobs: list[Job], readmit: Callable[[Job], Job]) -> list[Job]:
        """Fill an empty store with a restarted server's jobs (its database's rows as
        `Job` objects in submission order, after `JobDatabase.recover`): every job listed;
        each queued one passed to
        ``readmit(job)`` (a `Job` -> the job admitted again, or `ValueError` whose text
        fails it) and queued again in its order (past ``max_queue``: they were accepted
        before). Returns the jobs queued again."""
        queued = []
        for job in jobs:
            if job.status == "queued":
                try:
                    job = readmit(job)
                except ValueError as exc:
                    if self.db is not None:
                        self.db.end(job.id, "failed", str(exc))
                    job.status, job.error = "failed", str(exc)
                    job.completed_at = int(time.time())
                    self.metrics.job_finished("failed", max(0.0, time.time() - job.created_at))
                    job.done.set()
                else:
                    if self.db is not None:
                        self.db.readmit(job)
                    queued.append(job)
            with self._lock:
                self._jobs[job.id] = job
        with self._lock:
            self._queue.extend(j.id for j in queued)
            for _ in queued:  # queued again in this server: counted as queued here
                self.metrics.job_queued()
            self._gauges()
            self._wake.notify_all()
        return queued

    # ------------------------------------------------------------------ views
    def view(self, job: Job) -> dict[str, Any]:
        """The JSON object of ``job`` (``GET /v1/videos/{id}``)."""
        with self._lock:
            req = job.request
            out: dict[str, Any] = {
                "id": job.id,
                "object": "video",
                "status": job.status,
                "created_at": job.created_at,
                "completed_at": job.completed_at,
                "progress": round(100 * job.steps_done / job.total_steps),
                "steps_completed": job.steps_done,
                "num_inference_steps": req.num_inference_steps,
                "refiner": None if job.refiner is None else job.refiner.to_dict(),
                "cancel_requested": job.cancel_requested,
                "error": None if job.error is None else {"message": job.error},
                "request": req.to_dict(),
                "image": None if job.image is None else job.image.describe(),
                "size": f"{req.width}x{req.height}",
                "seconds": req.duration_s,
                "replica": job.replica,
            }
            if job.result is not None:
                keep = ("video_sha256", "audio_sha256", "seed", "step_times_s", "total_s",
                        "media", "layout", "server", "refiner")
                out.update({k: job.result.get(k) for k in keep})
            return out

    # ------------------------------------------------------------------ replicas
    def set_replicas(self, ranks: list[list[int]]) -> None:
        """The server has one replica per entry of ``ranks`` (each its global ranks), all
        loading."""
        with self._lock:
            self._replicas = [{"replica": k, "ranks": list(r), "state": "loading", "job": None}
                              for k, r in enumerate(ranks)]
            self.metrics.set_replicas(len(ranks))

    def replica_state(self, replica: int, state: str) -> None:
        """Replica ``replica`` is now ``state`` (`REPLICA_STATES`; a busy one is set by
        `next_job`, its return to idle by the job's end)."""
        if state not in REPLICA_STATES:
            raise ValueError(f"state must be one of {REPLICA_STATES}, got {state!r}")
        with self._lock:
            self._replicas[replica]["state"] = state

    def replica_view(self) -> list[dict[str, Any]]:
        """``/health``'s ``replicas``: each replica's index, global ranks, state and job."""
        with self._lock:
            return [dict(r, ranks=list(r["ranks"])) for r in self._replicas]
