"""The per-rank loop of ``headmoe serve``: the model built once, requests one after another.

The model is the preview transformer and the release's components, with its refiner
(``refiner/``) when the release has one, so 1080p requests run on the same resident ranks.

Every rank runs `serve_rank`. Rank 0 also owns the `JobStore` and runs uvicorn in a thread
(`Leader`). The ranks stay in lockstep through rank 0's commands, one broadcast per tick
(`headmoe.serve.wire`, JSON only):

- ``{"op": "idle"}``: nothing queued (sent every ``tick_s``, so an idle rank's wait is
  always far below the collective timeout and a dead peer is noticed within a tick);
- ``{"op": "run", "id", "request", "admission", "image", "refiner"}``: every rank runs the request through `run_request`
  with the components built at start; after each step rank 0 broadcasts one flag (cancel
  requested, or the drain bound passed) and every rank stops at that same step, and before
  each transformer layer the ranks agree on a stop (`headmoe.pipeline.stop.LayerGate`: rank
  0's cancel, or a rank whose streamed layer read failed) and stop before that same layer;
- ``{"op": "stop"}``: drain finished; every rank leaves the loop and exits 0.

After a request every rank's outcome is all-gathered: an exception on the ranks fails that
job with the rank's message and the server goes on. A peer that dies or hangs makes a
collective fail (Gloo notices a closed connection at once; a hang hits the timeout), the
rank exits non-zero and the supervisor stops the server.

SIGTERM / SIGINT on rank 0 start the drain: no new jobs, the queued ones cancelled, the
current one runs at most ``drain_timeout_s`` more, then ``stop``. Other ranks ignore both
signals and follow rank 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from headmoe.distributed.context import ParallelContext, rank_device
from headmoe.pipeline.image import ReferenceImage
from headmoe.pipeline.job import Components, build_components, run_request
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.request import GenerateRequest
from headmoe.pipeline.stop import CANCEL, GO_ON, LayerGate, StopAtLayer
from headmoe.planner.time import record_steps
from headmoe.serve import wire
from headmoe.serve.http import bound_logs, uvicorn_options
from headmoe.serve.metrics import resident_memory
from headmoe.serve.spec import ServeSpec
from headmoe.serve.state import ID_PATTERN, Job, JobStore, redact_paths
from headmoe.serve.store import INTERRUPTED, JobDatabase, check_output_dir
from headmoe.serve.validate import readmit


class JobCancelled(Exception):
    """Raised on every rank at the same step boundary when rank 0 says stop."""


class Leader:
    """Rank 0's half of the loop: the store, the HTTP thread, signals and the drain."""

    def __init__(self, spec: ServeSpec, sock: socket.socket, *, watch_parent: bool = False):
        self.spec, self.sock = spec, sock
        self.store = open_store(spec)
        self.drain_requested = False
        self.drain_deadline: float | None = None
        self.current: Job | None = None
        self._last_step = 0.0
        self._parent = os.getppid() if watch_parent else None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def on_signal(self, signum: int, frame: Any) -> None:
        # only flags: the handler runs in the main thread, maybe inside a store method
        # holding its lock; /health and POST read ``signalled`` at once, the drain bound
        # counts from now, and the ranks see it at the next layer (`LayerGate`)
        self.store.signalled = True
        self.drain_requested = True
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.spec.drain_timeout_s

    def stop_now(self) -> bool:
        """Between two layers of the current job: cancel it now? (a cancel request, or the
        drain bound passed; read without the store's lock)"""
        late = self.drain_deadline is not None and time.monotonic() >= self.drain_deadline
        return late or (self.current is not None and self.current.cancel_requested)

    def start_http(self) -> None:
        """Serve the API on ``self.sock`` from a daemon thread."""
        import uvicorn

        from headmoe.serve.app import create_app

        config = uvicorn.Config(create_app(self.store, self.spec), log_level=self.spec.log_level,
                                access_log=False, timeout_graceful_shutdown=5,
                                **uvicorn_options())
        bound_logs()
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    def stop_http(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    def next_command(self) -> dict[str, Any]:
        """What every rank does next (see the module docstring)."""
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("the HTTP server thread stopped")
        if self._parent is not None and os.getppid() != self._parent:
            self.drain_requested = True  # the supervisor is gone: stop now
            self.drain_deadline = time.monotonic()
        if self.drain_requested and not self.store.draining:
            self._start_drain()
            self.drain_deadline = self.drain_deadline or time.monotonic() + self.spec.drain_timeout_s
        if self.store.draining:
            return {"op": "stop"}
        job = self.store.next_job(self.spec.tick_s)
        if job is None:
            return {"op": "idle"}
        self.current, self._last_step = job, time.perf_counter()
        return {"op": "run", "id": job.id, "request": job.request.to_dict(),
                "admission": job.admission,
                "image": None if job.image is None else job.image.describe(),
                "refiner": None if job.refiner is None else job.refiner.to_dict()}

    def _start_drain(self) -> None:
        self.store.start_drain()
        running = "" if self.current is None else (
            f"; the current job gets up to {self.spec.drain_timeout_s:g} s more")
        print(f"headmoe serve: stopping: no new jobs, queued ones cancelled{running}",
              file=sys.stderr, flush=True)

    def must_stop(self, done: int) -> bool:
        """After step ``done`` of the current job: cancel it now?"""
        now = time.perf_counter()
        cancel = self.store.record_step(self.current, done, now - self._last_step)
        self._last_step = now
        if self.drain_requested and not self.store.draining:
            self._start_drain()
            self.drain_deadline = self.drain_deadline or time.monotonic() + self.spec.drain_timeout_s
        late = self.drain_deadline is not None and time.monotonic() >= self.drain_deadline
        return cancel or late

    def server_facts(self) -> dict[str, Any]:
        """What the sidecar's ``server`` field records: proof the model loaded once."""
        s = self.store
        return {"model_loads": s.model_loads, "model_loaded_at": s.model_loaded_at,
                "model_load_s": s.model_load_s, "pid": os.getpid()}

    def finish(self, outcomes: list[dict[str, Any]], result: dict[str, Any] | None) -> None:
        """End the current job from every rank's outcome (``{"rank", "status", "message"}``)."""
        job, self.current = self.current, None
        self.store.rank_memory(outcomes)
        failed = [o for o in outcomes if o["status"] == "failed"]
        if failed:  # clients never see the server's paths
            message = redact_paths(f"rank {failed[0]['rank']}: {failed[0]['message']}")
            self.store.finish(job, "failed", message, None)
        elif any(o["status"] == "cancelled" for o in outcomes):
            why = "cancelled by request" if job.cancel_requested else "server shutting down"
            self.store.finish(job, "cancelled", why, None)
        else:
            side = json.loads(Path(result["sidecar"]).read_text())
            self.store.finish(job, "completed", None, side)
            record_steps(self.spec.deployment.step_cache, job.admission.get("step_key") or "",
                         side["step_times_s"]["max"])  # later estimates of this cost


def open_store(spec: ServeSpec) -> JobStore:
    """Rank 0's `JobStore`; with ``spec.state_dir`` over its `JobDatabase`, restored from
    it (`JobDatabase.recover`, then `JobStore.restore` with every queued job admitted again
    on this server: `readmit`). Runs before the model loads; `UserError` for a database
    that cannot be used."""
    if spec.state_dir is None:
        return JobStore(spec.output_dir, spec.max_queue)
    db = JobDatabase(spec.state_dir)
    try:
        check_output_dir(db, spec.output_dir)
        recovery = db.recover()
        store = JobStore(spec.output_dir, spec.max_queue, db)
        store.restore([row.to_job() for row in db.jobs()],
                      lambda job: readmit(job, spec))
    except BaseException:
        db.close()
        raise
    if recovery.interrupted or recovery.requeue or recovery.lost:
        print(f"headmoe serve: {db.path}: {len(recovery.requeue)} queued job(s) queued "
              f"again, {len(recovery.interrupted)} interrupted one(s) failed "
              f"({INTERRUPTED!r}), {len(recovery.lost)} completed one(s) without their file "
              "failed", file=sys.stderr, flush=True)
    return store


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); `OSError` if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def run_one(ctx: ParallelContext, parts: Components, spec: ServeSpec, cmd: dict[str, Any],
            leader: Leader | None) -> None:
    """Run command ``cmd`` (op "run") on this rank; rank 0 records the outcome."""
    job_id = cmd["id"]
    if not ID_PATTERN.fullmatch(job_id):
        raise ValueError(f"bad job id from rank 0: {job_id!r}")
    request = GenerateRequest(**cmd["request"])
    extra = {"server": {"job_id": job_id, **(leader.server_facts() if leader else {})},
             "admission": cmd.get("admission", {})}
    image = None  # rank 0 (the image encoder's) holds the pixels; the others its description
    if cmd.get("image") is not None:
        image = leader.current.image if leader else ReferenceImage.from_dict(cmd["image"])
    refiner = None if cmd.get("refiner") is None else RefinerStage.from_dict(cmd["refiner"])
    job = spec.job(request, str(Path(spec.output_dir) / f"{job_id}.mp4"), extra, image,
                   refiner)
    device = ctx.device

    def on_step(done: int, total: int) -> None:
        stop = leader.must_stop(done) if leader is not None else False
        if wire.broadcast_flag(stop, device=device):
            raise JobCancelled

    ctx.counters.reset()
    result, outcome = None, {"rank": ctx.rank, "status": "completed", "message": None}
    outcome["memory"] = resident_memory(device)
    local = (lambda: CANCEL if leader.stop_now() else GO_ON) if leader else (lambda: GO_ON)
    try:
        with LayerGate(parts, device, local):
            result = run_request(ctx, job, parts, on_step=on_step)
    except (JobCancelled, StopAtLayer):  # at the same layer on every rank; a rank whose
        outcome["status"] = "cancelled"  # read failed raised its own error: the job's
    except Exception as exc:  # noqa: BLE001 - the job fails, the server goes on
        outcome.update(status="failed", message=f"{type(exc).__name__}: {exc}")
        print(f"headmoe serve: rank {ctx.rank}: {job_id} failed: {outcome['message']}",
              file=sys.stderr, flush=True)
    outcomes = wire.all_gather_json(outcome, device=device)
    if leader is not None:
        leader.finish(outcomes, result)


def serve_loop(ctx: ParallelContext, parts: Components, spec: ServeSpec,
               leader: Leader | None) -> None:
    """Follow rank 0's commands until ``stop`` (every rank calls it together)."""
    while True:
        cmd = leader.next_command() if leader is not None else None
        cmd = wire.broadcast_json(cmd, device=ctx.device)
        if cmd["op"] == "stop":
            return
        if cmd["op"] == "run":
            run_one(ctx, parts, spec, cmd, leader)


def watch_signals(leader: Leader) -> None:
    """Note a signal at once, even while the main thread is inside a long torch call (where
    Python runs no handler until the call returns): the C handler writes the signal to a
    wakeup pipe and a daemon thread starts the drain (`Leader.on_signal`, the queued jobs
    cancelled)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        while os.read(read, 64):
            leader.on_signal(0, None)
            if not leader.store.draining:  # a thread, not a handler: it may take the lock
                leader._start_drain()  # queued jobs cancelled now

    threading.Thread(target=watch, name="signals", daemon=True).start()


def serve_rank(spec: ServeSpec, rank: int, world_size: int, init_method: str | None, *,
               supervised: bool = False) -> None:
    """One rank of the server, from joining the world to a drained exit (returns normally).

    ``init_method`` None with ``world_size > 1`` joins from torchrun's environment.
    ``supervised``: started by `headmoe.serve.supervisor`, so rank 0 stops if that parent
    process disappears."""
    leader = None
    if rank == 0:
        leader = Leader(spec, bind(spec.host, spec.port), watch_parent=supervised)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, leader.on_signal)
        watch_signals(leader)
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    if world_size == 1:  # where launched ranks run (CUDA when available), as generate
        ctx = ParallelContext.single(spec.deployment.parallel, device=rank_device())
    else:
        dep = spec.deployment
        ctx = ParallelContext.initialize(dep.parallel, rank=rank, world_size=world_size,
                                         init_method=init_method,
                                         timeout=timedelta(seconds=dep.timeout_s))
    # with the release's refiner/ the template carries a stage, so the refiner loads now
    template = spec.job(GenerateRequest(prompt="", dtype=spec.deployment.dtype), None, {},
                        refiner=RefinerStage() if spec.deployment.has_refiner else None)
    try:
        if leader is not None:
            Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
            leader.start_http()  # /health says "loading" until the model is in
        t0 = time.perf_counter()
        if leader is not None:
            print(f"headmoe serve: loading the model on {world_size} rank(s); /health says "
                  "loading until it is in", file=sys.stderr, flush=True)
        parts = build_components(ctx, template)
        load_s = time.perf_counter() - t0
        memory = wire.all_gather_json({"rank": ctx.rank, "memory": resident_memory(ctx.device)},
                                      device=ctx.device)
        if leader is not None:
            _announce(leader, load_s, ctx, memory)
        serve_loop(ctx, parts, spec, leader)
    finally:
        if leader is not None:
            leader.stop_http()
            if leader.store.db is not None:
                leader.store.db.close()
        ctx.destroy()
    if leader is not None:
        print("headmoe serve: stopped", file=sys.stderr, flush=True)


def _announce(leader: Leader, load_s: float, ctx: ParallelContext,
              memory: list[dict[str, Any]]) -> None:
    """The model is in (``load_s`` s; ``memory`` every rank's ``{"rank", "memory"}``)."""
    store = leader.store
    store.rank_memory(memory)
    store.model_loaded(load_s)
    host, port = leader.sock.getsockname()[:2]
    print(f"headmoe serve: listening on http://{host}:{port} ({ctx.world_size} rank(s), "
          f"model {leader.spec.deployment.model}, loaded in {load_s:.1f} s)", flush=True)
