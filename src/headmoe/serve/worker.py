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
from headmoe.distributed.replicas import (
    ReplicaPlace,
    join_replica,
    launch_store,
    replica_place,
    serve_store,
)
from headmoe.pipeline.image import ReferenceImage
from headmoe.pipeline.job import Components, GenerateJob, build_components, run_request
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.request import GenerateRequest
from headmoe.pipeline.stop import CANCEL, GO_ON, LayerGate, StopAtLayer
from headmoe.serve import wire
from headmoe.serve.http import bound_logs, uvicorn_options
from headmoe.serve.metrics import resident_memory
from headmoe.serve.replicas import Channel, RemoteLeader, ReplicaProxy, conclude, run_command
from headmoe.serve.spec import ServeSpec
from headmoe.serve.state import ID_PATTERN, Job, JobStore
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

    @property
    def output_dir(self) -> str:
        """Where replica 0's jobs write their mp4 and sidecar: ``--output-dir``."""
        return self.spec.output_dir

    def drain_late(self) -> bool:
        """The drain bound has passed: every running job stops at its next layer."""
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    def stop_now(self) -> bool:
        """Between two layers of the current job: cancel it now? (a cancel request, or the
        drain bound passed; read without the store's lock)"""
        return self.drain_late() or (self.current is not None and self.current.cancel_requested)

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
        return run_command(job)

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
        return cancel or self.drain_late()

    def server_facts(self) -> dict[str, Any]:
        """What the sidecar's ``server`` field records: proof the model loaded once."""
        s = self.store
        return {"model_loads": s.model_loads, "model_loaded_at": s.model_loaded_at,
                "model_load_s": s.model_load_s, "pid": os.getpid()}

    def finish(self, outcomes: list[dict[str, Any]], result: dict[str, Any] | None) -> None:
        """End the current job from every rank's outcome (``{"rank", "status", "message"}``)."""
        job, self.current = self.current, None
        assert job is not None
        done = result is not None and result.get("sidecar") and all(
            o["status"] == "completed" for o in outcomes)
        side = json.loads(Path(result["sidecar"]).read_text()) if done and result else None
        conclude(self.store, self.spec, job, outcomes, side)


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


#: the leader interface `run_one` and `serve_loop` call: rank 0's `Leader` (replica 0) or a
#: remote replica's `headmoe.serve.replicas.RemoteLeader`; None on the other ranks
AnyLeader = Leader | RemoteLeader | None


def run_one(ctx: ParallelContext, parts: Components, spec: ServeSpec, cmd: dict[str, Any],
            leader: AnyLeader, replica: int = 0) -> None:
    """Run command ``cmd`` (op "run") on this rank of replica ``replica``; its leader
    records the outcome."""
    job_id = cmd["id"]
    if not ID_PATTERN.fullmatch(job_id):
        raise ValueError(f"bad job id from rank 0: {job_id!r}")
    request = GenerateRequest(**cmd["request"])
    facts = leader.server_facts() if leader else {}
    extra = {"server": {"job_id": job_id, "replica": replica, **facts},
             "admission": cmd.get("admission", {})}
    image = None  # the leader (the image encoder's rank) holds the pixels; the others its
    if cmd.get("image") is not None:  # description
        image = leader.current.image if leader and leader.current else (
            ReferenceImage.from_dict(cmd["image"]))
    refiner = None if cmd.get("refiner") is None else RefinerStage.from_dict(cmd["refiner"])
    out = Path(leader.output_dir if leader else spec.output_dir) / f"{job_id}.mp4"
    job = spec.job(request, str(out), extra, image, refiner)
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
        print(f"headmoe serve: replica {replica} rank {ctx.rank}: {job_id} failed: "
              f"{outcome['message']}", file=sys.stderr, flush=True)
    outcomes = wire.all_gather_json(outcome, device=device)
    if leader is not None:
        leader.finish(outcomes, result)


def serve_loop(ctx: ParallelContext, parts: Components, spec: ServeSpec,
               leader: AnyLeader, replica: int = 0) -> None:
    """Follow the replica leader's commands until ``stop`` (every rank of the replica calls
    it together)."""
    while True:
        cmd = leader.next_command() if leader is not None else None
        cmd = wire.broadcast_json(cmd, device=ctx.device)
        if cmd["op"] == "stop":
            return
        if cmd["op"] == "run":
            run_one(ctx, parts, spec, cmd, leader, replica)


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


def serve_rank(spec: ServeSpec, rank: int, world_size: int, *,
               supervised: bool = False) -> None:
    """One rank of the server, from joining its replica to a drained exit (returns
    normally). A world of several ranks joins from torchrun's environment (as
    `headmoe.distributed.launch.LocalRanks` sets it) and splits into
    ``--data-parallel-size`` replicas (`headmoe.distributed.replicas`).
    ``supervised``: started by `headmoe.serve.supervisor`, so rank 0 stops if that parent
    process disappears."""
    place = replica_place(rank, world_size, spec.deployment.parallel)
    rspec = spec.replica_spec()
    leader: Leader | None = None
    if rank == 0:
        leader = Leader(rspec, bind(spec.host, spec.port), watch_parent=supervised)
        leader.store.set_replicas([place.ranks(k) for k in range(place.replicas)])
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, leader.on_signal)
        watch_signals(leader)
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    ctx, shared = _join(spec, place, world_size)
    remote = (RemoteLeader(Channel(shared, place.replica), rspec, place)
              if shared is not None and place.leads and place.replica > 0 else None)
    proxies = [] if leader is None or shared is None else [
        ReplicaProxy(leader, Channel(shared, k)) for k in range(1, place.replicas)]
    clean = False
    try:
        if leader is not None:
            _start_front(leader, proxies, world_size)
        t0 = time.perf_counter()
        parts = build_components(ctx, _template(rspec))
        load_s = time.perf_counter() - t0
        memory = wire.all_gather_json(  # every rank of the replica, global rank labels
            {"rank": place.rank, "memory": resident_memory(ctx.device)}, device=ctx.device)
        if leader is not None:
            _announce(leader, load_s, ctx, memory, place.replicas)
        elif remote is not None:
            remote.loaded(load_s)
        serve_loop(ctx, parts, rspec, leader or remote, place.replica)
        clean = True
    finally:
        if leader is not None:
            _stop_front(leader, proxies, clean)
        ctx.destroy()
    if leader is not None:
        print("headmoe serve: stopped", file=sys.stderr, flush=True)


def _join(spec: ServeSpec, place: ReplicaPlace, world_size: int
          ) -> tuple[ParallelContext, Any]:
    """This rank's replica context and the replicas' shared store (None in a world of one
    rank, where launched ranks run: CUDA when available, as generate)."""
    if world_size == 1:
        return ParallelContext.single(spec.replica_spec().deployment.parallel,
                                      device=rank_device()), None
    timeout = timedelta(seconds=spec.deployment.timeout_s)
    base = launch_store(place.rank, world_size, timeout)
    ctx = join_replica(place, base, spec.deployment.parallel, timeout)
    return ctx, serve_store(base)


def _template(spec: ServeSpec) -> GenerateJob:
    """The job the components are built for: with the release's refiner/ it carries a
    stage, so the refiner loads at start too."""
    return spec.job(GenerateRequest(prompt="", dtype=spec.deployment.dtype), None, {},
                    refiner=RefinerStage() if spec.deployment.has_refiner else None)


def _start_front(leader: Leader, proxies: list[ReplicaProxy], world_size: int) -> None:
    """Rank 0, before the model loads: the output folder, the HTTP thread (``/health``
    says loading until the model is in) and one proxy thread per remote replica."""
    Path(leader.spec.output_dir).mkdir(parents=True, exist_ok=True)
    leader.start_http()
    for proxy in proxies:
        proxy.start()
    print(f"headmoe serve: loading the model on {world_size} rank(s) "
          f"({len(proxies) + 1} replica(s)); /health says loading until it is in",
          file=sys.stderr, flush=True)


def _stop_front(leader: Leader, proxies: list[ReplicaProxy], clean: bool) -> None:
    """Rank 0 leaving: after a drain (``clean``) each proxy is joined as it stops its
    replica (within the drain bound and the collective timeout); then the HTTP thread and
    the database. After a failure the proxies are left (daemon threads): the launcher stops
    every rank."""
    bound = time.monotonic() + leader.spec.drain_timeout_s + leader.spec.deployment.timeout_s
    for proxy in proxies if clean else ():
        if not proxy.join(max(0.0, bound - time.monotonic())):
            print(f"headmoe serve: replica {proxy.k} did not stop in time", file=sys.stderr,
                  flush=True)
    leader.stop_http()
    if leader.store.db is not None:
        leader.store.db.close()


def _announce(leader: Leader, load_s: float, ctx: ParallelContext,
              memory: list[dict[str, Any]], replicas: int) -> None:
    """Replica 0's model is in (``load_s`` s; ``memory`` its ranks' ``{"rank",
    "memory"}``): the server takes jobs (the others' proxies send them jobs once theirs are
    in too)."""
    store = leader.store
    store.rank_memory(memory)
    store.replica_state(0, "idle")
    store.model_loaded(load_s)
    host, port = leader.sock.getsockname()[:2]
    ranks = f"{ctx.world_size} rank(s)" if replicas == 1 else (
        f"{ctx.world_size * replicas} rank(s), {replicas} replicas of {ctx.world_size}")
    print(f"headmoe serve: listening on http://{host}:{port} ({ranks}, model "
          f"{leader.spec.deployment.model}, loaded in {load_s:.1f} s)", flush=True)
