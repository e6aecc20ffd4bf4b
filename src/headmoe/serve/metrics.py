"""`ServerMetrics`: one server's Prometheus metrics (the ``prometheus_client`` package).

Each server owns a `CollectorRegistry` of its own (never the package's global default
registry), so two servers in one process never share or collide on a metric. The server
records with one call each (``metrics.job_finished("completed", 12.5)``) and serves
`ServerMetrics.render` at ``GET /metrics``.

=========================================  =========  ==========================================
metric                                     type       what
=========================================  =========  ==========================================
``headmoe_requests_total{outcome}``        counter    jobs queued, then ended: ``queued``,
                                                      ``completed``, ``failed``, ``cancelled``
``headmoe_requests_rejected_total{code}``  counter    requests refused before queueing (HTTP code)
``headmoe_queue_length``                   gauge      jobs waiting
``headmoe_replicas``                       gauge      data-parallel replicas of the server
``headmoe_replicas_busy``                  gauge      replicas running a job
``headmoe_job_seconds{outcome}``           histogram  a job's time from submission to its end
                                                      (`JOB_BUCKETS`: seconds to hours)
``headmoe_step_seconds``                   histogram  denoising step time (`STEP_BUCKETS`)
``headmoe_model_loads_total``              counter    times the ranks built and loaded the model
``headmoe_model_load_seconds``             gauge      the last model load's time
``headmoe_resident_memory_bytes{rank,      gauge      a rank's memory: ``kind="device"`` CUDA
kind}``                                               memory allocated, ``kind="host"`` the
                                                      process's resident set (the global rank)
``headmoe_connections_refused_total        counter    requests and connections refused by the
{reason}``                                            HTTP connection limits (429; read from
                                                      `headmoe.serve.http.REFUSED` at scrape)
=========================================  =========  ==========================================
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from headmoe.config import is_int
from headmoe.serve import http

#: the statuses a job ends in (`headmoe.serve.state.Job.status`)
TERMINAL = frozenset({"completed", "failed", "cancelled"})
#: upper bounds (seconds) of the step-time histogram's buckets
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: upper bounds (seconds) of the job-time histogram's buckets: a tiny CPU job's seconds to
#: a long MAGI-2 clip's hours
JOB_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
               7200.0, 14400.0, 28800.0)
#: what ``headmoe_requests_total`` counts: a job queued, then its end
OUTCOMES = ("queued", *sorted(TERMINAL))
#: the ``kind`` label of ``headmoe_resident_memory_bytes``
MEMORY_KINDS = ("device", "host")
#: the text format `render` writes (what every Prometheus scraper reads)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
_STATM = Path("/proc/self/statm")


def resident_memory(device: torch.device | str) -> tuple[str, int] | None:
    """This process's memory on ``device``: ``("device", bytes)`` CUDA memory allocated
    (``torch.cuda.memory_allocated``) for a CUDA device, else ``("host", bytes)`` the
    resident set (``/proc/self/statm``); None where neither can be read."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return "device", int(torch.cuda.memory_allocated(device))
    try:
        pages = int(_STATM.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return "host", pages * os.sysconf("SC_PAGE_SIZE")


class _RefusedCollector(Collector):
    """``headmoe_connections_refused_total{reason}``: `headmoe.serve.http.REFUSED` (the
    connection limits count in the HTTP protocol, which has no server at hand)."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "headmoe_connections_refused", "Requests and connections refused by the "
            "connection limits (429), by reason.", labels=["reason"])
        for reason, n in sorted(http.REFUSED.items()):
            family.add_metric([reason], n)
        yield family


class ServerMetrics:
    """The metrics of one server (the table of the module docstring), in ``registry``."""

    def __init__(self, replicas: int = 1):
        if not is_int(replicas) or replicas < 1:
            raise ValueError(f"replicas must be a positive int, got {replicas!r}")
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter("headmoe_requests", "Jobs queued, then ended, by outcome.",
                                 ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every outcome shows, at 0 until it happens
            self._requests.labels(outcome)
        self._rejected = Counter("headmoe_requests_rejected",
                                 "Requests refused before queueing, by HTTP code.", ["code"],
                                 registry=r)
        self._queue = Gauge("headmoe_queue_length", "Jobs waiting in the queue.", registry=r)
        self._replicas = Gauge("headmoe_replicas", "Data-parallel replicas.", registry=r)
        self._replicas.set(replicas)
        self._busy = Gauge("headmoe_replicas_busy", "Replicas running a job.", registry=r)
        self._job_s = Histogram("headmoe_job_seconds", "Job time from submission to its end.",
                                ["outcome"], buckets=JOB_BUCKETS, registry=r)
        self._step_s = Histogram("headmoe_step_seconds", "Denoising step time.",
                                 buckets=STEP_BUCKETS, registry=r)
        self._loads = Counter("headmoe_model_loads", "Times the ranks built and loaded the "
                              "model.", registry=r)
        self._load_s = Gauge("headmoe_model_load_seconds", "The last model load's time.",
                             registry=r)
        self._memory = Gauge("headmoe_resident_memory_bytes", "A rank's resident memory: "
                             "CUDA memory allocated (device) or the process's RSS (host).",
                             ["rank", "kind"], registry=r)
        r.register(_RefusedCollector())

    def job_queued(self) -> None:
        """A job was accepted into the queue."""
        self._requests.labels("queued").inc()

    def job_rejected(self, code: int) -> None:
        """A request was refused before queueing with HTTP status ``code``."""
        self._rejected.labels(str(code)).inc()

    def job_finished(self, outcome: str, seconds: float) -> None:
        """A job ended with ``outcome`` (a terminal status) ``seconds`` after submission."""
        if outcome not in TERMINAL:
            raise ValueError(f"outcome must be one of {sorted(TERMINAL)}, got {outcome!r}")
        self._requests.labels(outcome).inc()
        self._job_s.labels(outcome).observe(seconds)

    def step_done(self, seconds: float) -> None:
        """A denoising step took ``seconds``."""
        self._step_s.observe(seconds)

    def set_queue(self, waiting: int, busy: int) -> None:
        """``waiting`` jobs are queued and ``busy`` replicas run one."""
        self._queue.set(waiting)
        self._busy.set(busy)

    def set_replicas(self, replicas: int) -> None:
        """The server runs ``replicas`` data-parallel replicas."""
        self._replicas.set(replicas)

    def model_loaded(self, seconds: float) -> None:
        """The ranks built and loaded the model in ``seconds``."""
        self._loads.inc()
        self._load_s.set(seconds)

    def rank_memory(self, rank: int, kind: str, nbytes: int) -> None:
        """Rank ``rank`` holds ``nbytes`` of ``kind`` memory (`resident_memory`'s pair)."""
        if kind not in MEMORY_KINDS:
            raise ValueError(f"kind must be one of {MEMORY_KINDS}, got {kind!r}")
        self._memory.labels(str(rank), kind).set(nbytes)

    def render(self) -> tuple[bytes, str]:
        """(the Prometheus text of every metric, its content type) for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE
