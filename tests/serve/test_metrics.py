"""`headmoe.serve.metrics.ServerMetrics`: the text parses with prometheus_client's own
parser, the counters move with each record, two servers' registries stay apart; `JobStore`
records through its own at each change of a job (the drain and a restart's restore too)."""

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from headmoe.pipeline.request import GenerateRequest
from headmoe.serve import http
from headmoe.serve.metrics import JOB_BUCKETS, OUTCOMES, ServerMetrics, resident_memory
from headmoe.serve.state import JobStore
from headmoe.serve.store import JobDatabase


def samples(metrics):
    """{(sample name, sorted labels): value} of ``metrics.render()``, parsed."""
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


def test_render_parses_and_names_every_metric():
    families = {f.name: f.type for f in text_string_to_metric_families(
        ServerMetrics(replicas=2).render()[0].decode())}
    assert {name: families.get(name) for name in (
        "headmoe_requests", "headmoe_requests_rejected", "headmoe_queue_length",
        "headmoe_replicas", "headmoe_replicas_busy", "headmoe_job_seconds",
        "headmoe_step_seconds", "headmoe_model_loads", "headmoe_model_load_seconds",
        "headmoe_resident_memory_bytes")} == {
        "headmoe_requests": "counter", "headmoe_requests_rejected": "counter",
        "headmoe_queue_length": "gauge", "headmoe_replicas": "gauge",
        "headmoe_replicas_busy": "gauge", "headmoe_job_seconds": "histogram",
        "headmoe_step_seconds": "histogram", "headmoe_model_loads": "counter",
        "headmoe_model_load_seconds": "gauge", "headmoe_resident_memory_bytes": "gauge"}


def test_the_counters_move_with_each_record():
    m = ServerMetrics(replicas=2)
    before = samples(m)
    assert {before[("headmoe_requests_total", (("outcome", o),))] for o in OUTCOMES} == {0.0}
    assert before[("headmoe_replicas", ())] == 2.0
    m.job_queued()
    m.job_queued()
    m.job_finished("completed", 42.0)
    m.job_finished("failed", 7200.5)
    m.job_rejected(422)
    m.step_done(0.3)
    m.set_queue(waiting=1, busy=2)
    m.model_loaded(1.25)
    m.rank_memory(1, "host", 1 << 30)
    s = samples(m)
    assert s[("headmoe_requests_total", (("outcome", "queued"),))] == 2.0
    assert s[("headmoe_requests_total", (("outcome", "completed"),))] == 1.0
    assert s[("headmoe_requests_total", (("outcome", "failed"),))] == 1.0
    assert s[("headmoe_requests_total", (("outcome", "cancelled"),))] == 0.0
    assert s[("headmoe_requests_rejected_total", (("code", "422"),))] == 1.0
    assert s[("headmoe_job_seconds_bucket", (("le", "60.0"), ("outcome", "completed")))] == 1.0
    assert s[("headmoe_job_seconds_bucket", (("le", "3600.0"), ("outcome", "failed")))] == 0.0
    assert s[("headmoe_job_seconds_bucket", (("le", "14400.0"), ("outcome", "failed")))] == 1.0
    assert s[("headmoe_job_seconds_sum", (("outcome", "failed"),))] == 7200.5
    assert s[("headmoe_step_seconds_count", ())] == 1.0
    assert s[("headmoe_step_seconds_bucket", (("le", "0.25"),))] == 0.0
    assert s[("headmoe_step_seconds_bucket", (("le", "0.5"),))] == 1.0
    assert (s[("headmoe_queue_length", ())], s[("headmoe_replicas_busy", ())]) == (1.0, 2.0)
    assert s[("headmoe_model_loads_total", ())] == 1.0
    assert s[("headmoe_model_load_seconds", ())] == 1.25
    assert s[("headmoe_resident_memory_bytes", (("kind", "host"), ("rank", "1")))] == 2.0 ** 30


def test_two_servers_registries_are_independent():
    a, b = ServerMetrics(), ServerMetrics(replicas=3)  # the same names, no collision
    a.job_queued()
    a.step_done(1.0)
    sa, sb = samples(a), samples(b)
    assert sa[("headmoe_requests_total", (("outcome", "queued"),))] == 1.0
    assert sb[("headmoe_requests_total", (("outcome", "queued"),))] == 0.0
    assert (sa[("headmoe_step_seconds_count", ())], sb[("headmoe_step_seconds_count", ())]) \
        == (1.0, 0.0)
    assert (sa[("headmoe_replicas", ())], sb[("headmoe_replicas", ())]) == (1.0, 3.0)


def test_bad_values_are_refused_by_name():
    m = ServerMetrics()
    with pytest.raises(ValueError, match="outcome must be one of .* got 'queued'"):
        m.job_finished("queued", 1.0)
    with pytest.raises(ValueError, match="kind must be one of .* got 'gpu'"):
        m.rank_memory(0, "gpu", 1)
    with pytest.raises(ValueError, match="replicas must be a positive int, got 0"):
        ServerMetrics(replicas=0)


def test_resident_memory_of_a_cpu_rank_is_its_rss():
    kind, nbytes = resident_memory("cpu")
    assert kind == "host" and 1 << 20 < nbytes < 1 << 40


def test_job_buckets_span_seconds_to_hours():
    assert JOB_BUCKETS[0] <= 1.0 and JOB_BUCKETS[-1] >= 4 * 3600
    assert list(JOB_BUCKETS) == sorted(JOB_BUCKETS)


def test_resident_memory_of_a_cuda_rank_is_its_allocated_memory(monkeypatch):
    """The CUDA branch, on a CPU machine: torch.cuda's two calls stand in."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: asked.append(d) or 12345)
    assert resident_memory("cuda:1") == ("device", 12345)
    assert asked == [torch.device("cuda:1")]


def _store(tmp_path, db=None, max_queue=8):
    return JobStore(tmp_path / "out", max_queue, db)


def test_job_store_records_a_job_s_life_and_rejects(tmp_path):
    store = _store(tmp_path)
    run, wait = (store.submit(GenerateRequest(prompt=p)) for p in ("run", "wait"))
    s = samples(store.metrics)
    assert s[("headmoe_requests_total", (("outcome", "queued"),))] == 2.0
    assert (s[("headmoe_queue_length", ())], s[("headmoe_replicas_busy", ())]) == (2.0, 0.0)
    assert store.next_job(0.1) is run
    assert store.record_step(run, 1, 0.3) is False
    s = samples(store.metrics)
    assert (s[("headmoe_queue_length", ())], s[("headmoe_replicas_busy", ())]) == (1.0, 1.0)
    assert s[("headmoe_step_seconds_count", ())] == 1.0
    store.cancel(wait)
    store.finish(run, "completed", None, {})
    store.reject(429)
    store.model_loaded(2.5)
    store.rank_memory([{"rank": 3, "memory": ["host", 4096]}, {"rank": 5, "memory": None}])
    s = samples(store.metrics)
    assert s[("headmoe_requests_total", (("outcome", "completed"),))] == 1.0
    assert s[("headmoe_requests_total", (("outcome", "cancelled"),))] == 1.0
    assert s[("headmoe_job_seconds_count", (("outcome", "completed"),))] == 1.0
    assert s[("headmoe_job_seconds_count", (("outcome", "cancelled"),))] == 1.0
    assert s[("headmoe_requests_rejected_total", (("code", "429"),))] == 1.0
    assert (s[("headmoe_queue_length", ())], s[("headmoe_replicas_busy", ())]) == (0.0, 0.0)
    assert (s[("headmoe_model_loads_total", ())], store.model_loads, store.ready) == \
        (1.0, 1, True)
    assert s[("headmoe_model_load_seconds", ())] == store.model_load_s == 2.5
    assert s[("headmoe_resident_memory_bytes", (("kind", "host"), ("rank", "3")))] == 4096.0
    assert not any(k[0] == "headmoe_resident_memory_bytes" and ("rank", "5") in k[1]
                   for k in s)


def test_drain_counts_every_queued_job_cancelled(tmp_path):
    store = _store(tmp_path)
    jobs = [store.submit(GenerateRequest(prompt=str(i))) for i in range(3)]
    assert store.next_job(0.1) is jobs[0]
    assert store.start_drain() == [jobs[0]]
    s = samples(store.metrics)
    assert s[("headmoe_requests_total", (("outcome", "cancelled"),))] == 2.0
    assert s[("headmoe_job_seconds_count", (("outcome", "cancelled"),))] == 2.0
    assert (s[("headmoe_queue_length", ())], s[("headmoe_replicas_busy", ())]) == (0.0, 1.0)


def test_restore_counts_readmitted_jobs_queued_and_refused_ones_failed(tmp_path):
    db = JobDatabase(tmp_path / "state")
    first = _store(tmp_path, db)
    for p in ("kept", "refused", "later"):
        first.submit(GenerateRequest(prompt=p))

    def readmit(job):
        if job.request.prompt == "refused":
            raise ValueError("too big now")
        return job

    store = _store(tmp_path, db, max_queue=1)
    assert len(store.restore([r.to_job() for r in db.jobs()], readmit)) == 2
    s = samples(store.metrics)
    assert s[("headmoe_requests_total", (("outcome", "queued"),))] == 2.0
    assert s[("headmoe_requests_total", (("outcome", "failed"),))] == 1.0
    assert s[("headmoe_job_seconds_count", (("outcome", "failed"),))] == 1.0
    assert s[("headmoe_queue_length", ())] == 2.0
    db.close()


def test_connection_refusals_are_in_the_same_page(monkeypatch):
    monkeypatch.setattr(http, "REFUSED", type(http.REFUSED)({"refused": 3}))
    s = samples(ServerMetrics())
    assert s[("headmoe_connections_refused_total", (("reason", "refused"),))] == 3.0
